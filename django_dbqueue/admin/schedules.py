"""The schedules' page: when each runs next, how its last run went; run one now, enable or disable."""

from __future__ import annotations

from typing import Any

from django.contrib import admin, messages
from django.db.models import Exists, OuterRef, QuerySet, Subquery
from django.http import HttpRequest
from django.utils.translation import ngettext

from .. import schedules
from ..models import CANCELLED_CLASS, FailedJob, Job, ScheduleState
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
        "created_at",
        "updated_at",
    ]
    actions = ["run_selected_now", "enable_selected", "disable_selected"]

    def get_queryset(self, request: HttpRequest) -> QuerySet[ScheduleState]:
        # The last run's outcome in the same query: its job row (waiting, delayed or
        # running) or its failed row; neither once it succeeded.
        last_job = OuterRef("last_job_id")
        queryset: QuerySet[ScheduleState] = super().get_queryset(request)
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
        """False for a stale schedule: its row outlived its declaration, and it does not tick."""
        return not schedules.is_stale(state)

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
