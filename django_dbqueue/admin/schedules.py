"""The schedules' pages: when each runs next, how its last run went; run one now, enable or disable
(``ScheduleStateAdmin``, read-only: schedules in code are changed in code); and the stored schedules,
made and edited here (``StoredScheduleAdmin``, each save checked and logged in the admin's history)."""

from __future__ import annotations

from typing import Any

from django import forms
from django.contrib import admin, messages
from django.core.exceptions import NON_FIELD_ERRORS
from django.db.models import Exists, OuterRef, QuerySet, Subquery
from django.http import HttpRequest
from django.utils.translation import ngettext

from .. import registry, schedules, stored_schedules
from ..models import CANCELLED_CLASS, FailedJob, Job, ScheduleState, StoredSchedule
from .base import ReadOnlyAdmin, permission


class ScheduleStateAdmin(ReadOnlyAdmin):
    list_display = [
        "name",
        "job_name",
        "expression",
        "timezone",
        "next_run",
        "last_run",
        "last_outcome",
        "enabled",
        "in_code",
        "stored",
    ]
    list_filter = ["enabled", "job_name"]
    search_fields = ["name", "job_name"]
    readonly_fields = [
        "name",
        "job_name",
        "expression",
        "timezone",
        "arguments",
        "enabled",
        "next_tick",
        "last_tick",
        "last_run_at",
        "last_job_id",
        "last_outcome",
        "runs",
        "skipped",
        "in_code",
        "stored",
        "created_at",
        "updated_at",
    ]
    actions = ["run_selected_now", "enable_selected", "disable_selected"]

    def get_queryset(self, request: HttpRequest) -> QuerySet[ScheduleState]:
        # The last run's outcome in the same query: its job row (waiting, delayed or
        # running) or its failed row; neither once it succeeded.
        last_job = OuterRef("last_job_id")
        queryset: QuerySet[ScheduleState] = schedules.with_stored(super().get_queryset(request))
        return queryset.annotate(
            last_reserved=Exists(Job.objects.reserved().filter(pk=last_job)),
            last_queued=Exists(Job.objects.filter(pk=last_job)),
            last_failed_class=Subquery(FailedJob.objects.filter(job_id=last_job).values("exception_class")[:1]),
        )

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        """Only a stale schedule's row may be deleted: a declared one would come back at the next worker start."""
        if obj is None or not schedules.is_stale(obj):
            return False
        return super().has_delete_permission(request, obj)

    @admin.display(description="next run", ordering="next_tick")
    def next_run(self, state: ScheduleState) -> Any:
        return state.next_tick if state.enabled and not schedules.is_stale(state) else "-"

    @admin.display(description="last run", ordering="last_run_at")
    def last_run(self, state: ScheduleState) -> Any:
        return state.last_run_at or "-"

    @admin.display(description="last outcome")
    def last_outcome(self, state: ScheduleState) -> str:
        if state.last_job_id is None:
            return "-"
        if getattr(state, "last_reserved", False):
            return "running"
        if getattr(state, "last_queued", False):
            return "waiting"
        failed_class = getattr(state, "last_failed_class", None)
        if failed_class:
            return "cancelled" if failed_class == CANCELLED_CLASS else "failed"
        return "succeeded"

    @admin.display(description="in code", boolean=True)
    def in_code(self, state: ScheduleState) -> bool:
        """False for a stored schedule and a stale one (its row outlived its declaration; it does not tick)."""
        return not schedules.is_stale(state) and not self.stored(state)

    @admin.display(description="stored", boolean=True)
    def stored(self, state: ScheduleState) -> bool:
        """True for a stored schedule's row (edited under Stored schedules)."""
        return bool(getattr(state, "stored", False))

    has_run_permission = permission("run_schedule")
    has_toggle_permission = permission("change_schedulestate")

    @admin.action(description="Run selected schedules now (one extra run each)", permissions=["run"])
    def run_selected_now(self, request: HttpRequest, queryset: QuerySet[ScheduleState]) -> None:
        started, stale = [], []
        for name in queryset.values_list("name", flat=True):
            try:
                started.append(f"{name} (job {schedules.run_now(name).id})")
            except LookupError:
                stale.append(name)
        if started:
            messages.success(request, f"Enqueued now: {', '.join(started)}.")
        if stale:
            messages.warning(request, f"Not run, not declared in this code (stale): {', '.join(stale)}.")

    @admin.action(description="Enable selected schedules (from their next tick on)", permissions=["toggle"])
    def enable_selected(self, request: HttpRequest, queryset: QuerySet[ScheduleState]) -> None:
        count = schedules.set_enabled(list(queryset.values_list("name", flat=True)), True)
        messages.success(request, ngettext("%d schedule was enabled.", "%d schedules were enabled.", count) % count)

    @admin.action(description="Disable selected schedules", permissions=["toggle"])
    def disable_selected(self, request: HttpRequest, queryset: QuerySet[ScheduleState]) -> None:
        count = schedules.set_enabled(list(queryset.values_list("name", flat=True)), False)
        messages.success(request, ngettext("%d schedule was disabled.", "%d schedules were disabled.", count) % count)


class StoredScheduleForm(forms.ModelForm):  # type: ignore[type-arg]
    """A stored schedule, checked as ``schedules.save_stored`` checks it: the job (one of those
    registered), its arguments against its parameters, the cron expression, the time zone, the queue."""

    class Meta:
        model = StoredSchedule
        fields = [
            "name",
            "job_name",
            "args",
            "kwargs",
            "tick_argument",
            "cron",
            "timezone",
            "queue",
            "jitter",
            "enabled",
        ]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if "job_name" in self.fields:
            names = sorted(registry.all_definitions())
            current = self.instance.job_name
            if current and current not in names:
                names.insert(0, current)  # no longer registered: shown, and refused on save
            self.fields["job_name"] = forms.ChoiceField(
                choices=[("", "---------"), *((name, name) for name in names)],
                help_text=StoredSchedule._meta.get_field("job_name").help_text,
            )

    def clean(self) -> dict[str, Any]:
        data: dict[str, Any] = super().clean() or {}
        row = StoredSchedule(pk=self.instance.pk, name=self.instance.name)
        for field in self.Meta.fields:
            if field in data:
                setattr(row, field, data[field])
        if self.errors:  # a field that could not be read: its own error says why
            return data
        for field, reasons in stored_schedules.errors(row, schedules.all_schedules()).items():
            for reason in reasons:
                self.add_error(None if field == NON_FIELD_ERRORS or field not in self.fields else field, reason)
        return data


class StoredScheduleAdmin(admin.ModelAdmin):  # type: ignore[type-arg]
    """Schedules made at runtime: add, edit, disable or delete one; every worker ticks it as saved
    within ``ticker.STORED_CHECK`` seconds. Its runs are on the Schedules page."""

    form = StoredScheduleForm
    list_display = ["name", "job_name", "cron", "timezone", "queue", "jitter", "enabled", "next_run", "updated_at"]
    list_filter = ["enabled", "job_name"]
    search_fields = ["name", "job_name"]

    def get_queryset(self, request: HttpRequest) -> QuerySet[StoredSchedule]:
        queryset: QuerySet[StoredSchedule] = super().get_queryset(request)
        state = ScheduleState.objects.filter(name=OuterRef("name"), enabled=True)
        return queryset.annotate(state_next_tick=Subquery(state.values("next_tick")[:1]))

    def get_readonly_fields(self, request: HttpRequest, obj: Any = None) -> list[str]:
        # Its ScheduleState row has its name: a new name would be a new schedule.
        return ["name", "created_at", "updated_at"] if obj is not None else []

    @admin.display(description="next run", ordering="state_next_tick")
    def next_run(self, row: StoredSchedule) -> Any:
        next_tick = getattr(row, "state_next_tick", None)
        return next_tick if row.enabled and next_tick is not None else "-"

    def save_model(self, request: HttpRequest, obj: StoredSchedule, form: Any, change: bool) -> None:
        schedules.save_stored(obj)

    def delete_model(self, request: HttpRequest, obj: StoredSchedule) -> None:
        schedules.delete_stored([obj.name])

    def delete_queryset(self, request: HttpRequest, queryset: QuerySet[StoredSchedule]) -> None:
        schedules.delete_stored(list(queryset.values_list("name", flat=True)))
