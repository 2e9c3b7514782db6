"""Admin pages: jobs with their state, failed jobs with retry, progress, a queue overview, schedules and batches."""

from __future__ import annotations

import dataclasses
from datetime import datetime
from typing import Any

from django.contrib import admin, messages
from django.contrib.admin import actions as admin_actions
from django.contrib.admin.utils import unquote
from django.contrib.admin.views.main import ChangeList
from django.core.exceptions import PermissionDenied
from django.db.models import Exists, OuterRef, QuerySet, Subquery
from django.db.models.functions import Length, Right
from django.http import HttpRequest, HttpResponse, HttpResponseRedirect
from django.template.response import TemplateResponse
from django.urls import path, reverse
from django.utils.html import format_html
from django.utils.translation import ngettext
from django.views.decorators.http import require_POST

from . import dashboard, lifecycle, pauses, payload, schedules
from .batch_admin import JobBatchAdmin
from .db import DbNow
from .models import CANCELLED_CLASS, FailedJob, Job, JobBatch, JobProgress, LeaseOver, ScheduleState
from .operations import (
    QueueStats,
    cancel_jobs,
    delete_unreserved,
    job_state,
    queue_overview,
    release_expired,
    retry_failed,
    run_now,
)

# Characters of a failed job's error read for the change list's one-line
# summary: the end of the traceback, where the exception line is.
ERROR_TAIL = 1000

RESERVED_REFUSAL = (
    "a worker has reserved it and may be running it. Deleting it would drop its outcome and, in a chain, "
    "the steps still to run; cancel it instead (the Cancel actions), or delete it once it is waiting again."
)


def pretty_payload(text: str) -> str:
    """A stored payload as indented JSON, or as stored when it is nested deeper than the parser goes
    (a row written by raw SQL may be)."""
    try:
        return payload.pretty(text)
    except RecursionError:
        return text


class StateFilter(admin.SimpleListFilter):
    title = "state"
    parameter_name = "state"

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, str]]:
        return [
            ("waiting", "waiting"),
            ("delayed", "delayed"),
            ("blocked", "blocked (concurrency limit)"),
            ("reserved", "reserved"),
            ("expired", "reservation expired"),
        ]

    def queryset(self, request: HttpRequest, queryset: QuerySet[Job]) -> QuerySet[Job]:
        value = self.value()
        if value == "waiting":
            return queryset.filter(reserved_at__isnull=True, blocked=False, available_at__lte=DbNow())
        if value == "delayed":
            return queryset.filter(reserved_at__isnull=True, blocked=False, available_at__gt=DbNow())
        if value == "blocked":
            return queryset.filter(reserved_at__isnull=True, blocked=True)
        if value in ("reserved", "expired"):
            # Compared in SQL (models.LeaseOver): no reserved row is read to filter them.
            reserved = queryset.filter(reserved_at__isnull=False).alias(lease_over=LeaseOver())
            return reserved.filter(lease_over=value == "expired")
        return queryset


class DeferringChangeList(ChangeList):
    """A change list that leaves out the model admin's ``changelist_defer`` columns (big texts no column shows)."""

    def get_queryset(self, request: HttpRequest, exclude_parameters: Any = None) -> QuerySet[Any]:
        queryset: QuerySet[Any] = super().get_queryset(request, exclude_parameters)
        return queryset.defer(*getattr(self.model_admin, "changelist_defer", ()))


@dataclasses.dataclass(frozen=True)
class OverviewRow:
    """One queue's counts as a user may see them: None where a count is hidden from that user."""

    queue: str
    waiting: int | None
    delayed: int | None
    reserved: int | None
    failed: int | None
    oldest_waiting_seconds: float | None
    # When the queue was paused; None: it is not paused.
    paused_at: datetime | None = None

    @classmethod
    def of(cls, stats: QueueStats, *, jobs: bool, failed: bool) -> OverviewRow:
        """Return the row of ``stats`` with the job counts only if ``jobs``, the failed count only if ``failed``."""
        return cls(
            stats.queue,
            stats.waiting if jobs else None,
            stats.delayed if jobs else None,
            stats.reserved if jobs else None,
            stats.failed if failed else None,
            stats.oldest_waiting_seconds if jobs else None,
            stats.paused_at,
        )

    @property
    def paused(self) -> bool:
        return self.paused_at is not None


class _StillReserved(Exception):
    """A job chosen for deletion was reserved by a worker before the DELETE ran."""


class ReadOnlyMixin:
    def has_add_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False


@admin.register(Job)
class JobAdmin(ReadOnlyMixin, admin.ModelAdmin):  # type: ignore[type-arg]
    list_display = [
        "id",
        "name",
        "queue",
        "state",
        "priority",
        "attempts",
        "available_at",
        "reserved_at",
        "reserved_by",
    ]
    list_filter = [StateFilter, "queue"]
    search_fields = ["name", "queue", "=id", "=unique_key", "=concurrency_key"]
    changelist_defer = ["payload"]
    readonly_fields = [
        "id",
        "name",
        "queue",
        "priority",
        "attempts",
        "max_tries",
        "retry_after",
        "timeout",
        "available_at",
        "reserved_at",
        "reserved_by",
        "created_at",
        "unique_key",
        "unique_until_start",
        "concurrency_key",
        "concurrency_limit",
        "blocked",
        "rate_key",
        "rate_limit",
        "pretty_payload",
    ]
    exclude = ["payload"]
    actions = ["run_now", "release_expired", "cancel_selected", "cancel_selected_hard", "delete_selected"]
    change_list_template = "admin/django_dbqueue/job/change_list.html"

    def get_queryset(self, request: HttpRequest) -> QuerySet[Job]:
        queryset: QuerySet[Job] = super().get_queryset(request).annotate(**{"db_now": DbNow()})
        return queryset

    def get_changelist(self, request: HttpRequest, **kwargs: Any) -> type[ChangeList]:
        return DeferringChangeList

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        """Refuse the deletion of a reserved job: its worker would run on and its outcome be lost."""
        if obj is not None and obj.reserved_at is not None:
            return False
        return super().has_delete_permission(request, obj)

    @admin.action(description="Delete selected jobs (not reserved ones)", permissions=["delete"])
    def delete_selected(self, request: HttpRequest, queryset: QuerySet[Job]) -> HttpResponse | None:
        """Delete the selected jobs that no worker has reserved, after a confirmation page; refuse the others."""
        if not request.POST.get("post"):
            reserved = queryset.filter(reserved_at__isnull=False).count()
            self._refuse_reserved(request, reserved)
            unreserved = queryset.filter(reserved_at__isnull=True)
            if not unreserved.exists():
                return None
            response: HttpResponse | None = admin_actions.delete_selected(self, request, unreserved)
            return response
        ids = list(queryset.values_list("pk", flat=True))
        deleted = delete_unreserved(ids)
        if deleted:
            self.log_deletions(request, deleted)  # type: ignore[arg-type]
            count = len(deleted)
            self.message_user(
                request, ngettext("%d job was deleted.", "%d jobs were deleted.", count) % count, messages.SUCCESS
            )
        self._refuse_reserved(request, Job.objects.filter(pk__in=ids, reserved_at__isnull=False).count())
        return None

    def _refuse_reserved(self, request: HttpRequest, count: int) -> None:
        if count:
            message = ngettext(
                "%d job was not deleted: a worker has reserved it and may be running it. Deleting it would drop "
                "its outcome and, in a chain, the steps still to run; cancel it instead, or delete it once it is "
                "waiting again.",
                "%d jobs were not deleted: workers have reserved them and may be running them. Deleting them would "
                "drop their outcomes and, in a chain, the steps still to run; cancel them instead, or delete them "
                "once they are waiting again.",
                count,
            )
            self.message_user(request, message % count, messages.ERROR)

    def delete_queryset(self, request: HttpRequest, queryset: QuerySet[Job]) -> None:
        delete_unreserved(list(queryset.values_list("pk", flat=True)))

    def delete_model(self, request: HttpRequest, obj: Job) -> None:
        if not delete_unreserved([obj.pk]):
            # Raised inside the delete view's transaction, so its log entry is rolled back.
            raise _StillReserved

    def delete_view(self, request: HttpRequest, object_id: str, extra_context: dict[str, Any] | None = None) -> Any:
        job = self.get_object(request, unquote(object_id))
        if job is not None and job.reserved_at is not None and super().has_delete_permission(request, job):
            return self._refuse_reserved_job(request, job)
        try:
            return super().delete_view(request, object_id, extra_context)
        except _StillReserved:
            assert job is not None
            return self._refuse_reserved_job(request, job)

    def _refuse_reserved_job(self, request: HttpRequest, job: Job) -> HttpResponse:
        self.message_user(request, f"Job {job.pk} was not deleted: {RESERVED_REFUSAL}", messages.ERROR)
        return HttpResponseRedirect(reverse("admin:django_dbqueue_job_change", args=[job.pk]))

    @admin.display(description="state")
    def state(self, job: Job) -> str:
        return job_state(job, getattr(job, "db_now", None))

    @admin.display(description="payload")
    def pretty_payload(self, job: Job) -> str:
        return format_html("<pre>{}</pre>", pretty_payload(job.payload))

    def has_run_permission(self, request: HttpRequest) -> bool:
        return request.user.has_perm("django_dbqueue.change_job")

    @admin.action(description="Run selected jobs now", permissions=["run"])
    def run_now(self, request: HttpRequest, queryset: QuerySet[Job]) -> None:
        count = run_now(queryset)
        self.message_user(
            request, ngettext("%d job is available now.", "%d jobs are available now.", count) % count, messages.SUCCESS
        )

    def has_cancel_permission(self, request: HttpRequest) -> bool:
        return request.user.has_perm("django_dbqueue.cancel_job")

    @admin.action(description="Cancel selected jobs (running ones stop when they next check)", permissions=["cancel"])
    def cancel_selected(self, request: HttpRequest, queryset: QuerySet[Job]) -> None:
        self._cancel(request, queryset, hard=False)

    @admin.action(description="Cancel selected jobs, stopping running ones at once", permissions=["cancel"])
    def cancel_selected_hard(self, request: HttpRequest, queryset: QuerySet[Job]) -> None:
        self._cancel(request, queryset, hard=True)

    def _cancel(self, request: HttpRequest, queryset: QuerySet[Job], *, hard: bool) -> None:
        reason = f"cancelled in the admin by {request.user.get_username()}"
        outcomes = cancel_jobs(queryset.values_list("pk", flat=True), hard=hard, reason=reason)
        cancelled = sum(1 for outcome in outcomes.values() if outcome == "cancelled")
        requested = sum(1 for outcome in outcomes.values() if outcome == "requested")
        if cancelled:
            self.message_user(
                request,
                ngettext(
                    "%d job was cancelled; it is listed with the failed jobs.",
                    "%d jobs were cancelled; they are listed with the failed jobs.",
                    cancelled,
                )
                % cancelled,
                messages.SUCCESS,
            )
        if requested:
            self.message_user(
                request,
                ngettext("%d running job was asked to stop.", "%d running jobs were asked to stop.", requested)
                % requested
                + (" They are stopped as at a timeout." if hard else " Each stops when it next checks."),
                messages.SUCCESS,
            )
        if len(outcomes) > cancelled + requested:
            missing = len(outcomes) - cancelled - requested
            self.message_user(request, f"{missing} job(s) had finished already.", messages.WARNING)

    @admin.action(description="Release expired reservations", permissions=["run"])
    def release_expired(self, request: HttpRequest, queryset: QuerySet[Job]) -> None:
        count = release_expired(queryset)
        self.message_user(
            request,
            ngettext("%d expired reservation was released.", "%d expired reservations were released.", count) % count,
            messages.SUCCESS,
        )

    def get_urls(self) -> list[Any]:
        return [
            path("overview/", self.admin_site.admin_view(self.overview_view), name="django_dbqueue_overview"),
            path("dashboard/", self.admin_site.admin_view(dashboard.view_for(self)), name="django_dbqueue_dashboard"),
            path(
                "overview/pause/",
                self.admin_site.admin_view(require_POST(self.pause_view)),
                name="django_dbqueue_pause",
            ),
            path(
                "overview/resume/",
                self.admin_site.admin_view(require_POST(self.resume_view)),
                name="django_dbqueue_resume",
            ),
            *super().get_urls(),
        ]

    def overview_view(self, request: HttpRequest) -> HttpResponse:
        """Show per queue the counts the user may see: jobs with view_job, failed jobs with view_failedjob;
        whether it is paused, with Pause and Resume buttons for users with pause_queue."""
        show_jobs = self.has_view_permission(request)
        show_failed = self._may_view_failed(request)
        may_pause = self.has_pause_permission(request)
        if not (show_jobs or show_failed or may_pause):
            raise PermissionDenied
        rows = [
            OverviewRow.of(stats, jobs=show_jobs, failed=show_failed)
            for stats in queue_overview()
            # A queue is listed only for a count the user may see, or for a user who may pause
            # it, so its name alone tells nothing more.
            if ((show_jobs or may_pause) and (stats.size or stats.paused)) or (show_failed and stats.failed)
        ]
        context = {
            **self.admin_site.each_context(request),
            "title": "Queue overview",
            "opts": self.model._meta,
            "rows": rows,
            "show_jobs": show_jobs,
            "show_failed": show_failed,
            "may_pause": may_pause,
            "jobs_url": reverse("admin:django_dbqueue_job_changelist") if show_jobs else "",
            "failed_url": reverse("admin:django_dbqueue_failedjob_changelist") if show_failed else "",
        }
        return TemplateResponse(request, "admin/django_dbqueue/overview.html", context)

    def has_pause_permission(self, request: HttpRequest) -> bool:
        return request.user.has_perm("django_dbqueue.pause_queue")

    def pause_view(self, request: HttpRequest) -> HttpResponse:
        """Pause the queue named in the POST; only a queue something uses (see ``pauses.is_known``)."""
        if not self.has_pause_permission(request):
            raise PermissionDenied
        queue = request.POST.get("queue", "")
        try:
            paused = pauses.pause(queue)
        except ValueError as exc:
            self.message_user(request, f"Nothing was paused: {exc}.", messages.ERROR)
        else:
            if paused:
                message = f"Paused queue '{queue}': workers claim none of its jobs until it is resumed."
                self.message_user(request, message, messages.SUCCESS)
            else:
                self.message_user(request, f"Queue '{queue}' was already paused.", messages.WARNING)
        return HttpResponseRedirect(reverse("admin:django_dbqueue_overview"))

    def resume_view(self, request: HttpRequest) -> HttpResponse:
        """Resume the queue named in the POST."""
        if not self.has_pause_permission(request):
            raise PermissionDenied
        queue = request.POST.get("queue", "")
        try:
            resumed = pauses.resume(queue)
        except ValueError as exc:
            self.message_user(request, f"Nothing was resumed: {exc}.", messages.ERROR)
        else:
            if resumed:
                self.message_user(request, f"Resumed queue '{queue}'.", messages.SUCCESS)
            else:
                self.message_user(request, f"Queue '{queue}' was not paused.", messages.WARNING)
        return HttpResponseRedirect(reverse("admin:django_dbqueue_overview"))

    def _may_view_failed(self, request: HttpRequest) -> bool:
        if self.admin_site.is_registered(FailedJob):
            return bool(self.admin_site.get_model_admin(FailedJob).has_view_permission(request))
        return False


@admin.register(FailedJob)
class FailedJobAdmin(ReadOnlyMixin, admin.ModelAdmin):  # type: ignore[type-arg]
    list_display = ["id", "name", "queue", "attempts", "failed_at", "exception_class", "short_error"]
    list_filter = ["queue", "name", "exception_class", "failed_at"]
    # Not the error: a LIKE over every traceback is a full scan of the biggest column.
    search_fields = ["name", "queue", "=id"]
    changelist_defer = ["payload", "error"]
    date_hierarchy = "failed_at"
    fields = (
        "id",
        "job_id",
        "name",
        "queue",
        "attempts",
        "exception_class",
        "created_at",
        "failed_at",
        "pretty_payload",
        "traceback",
    )
    readonly_fields = fields
    actions = ["retry_selected"]
    change_form_template = "admin/django_dbqueue/failedjob/change_form.html"

    def get_changelist(self, request: HttpRequest, **kwargs: Any) -> type[ChangeList]:
        return DeferringChangeList

    def get_queryset(self, request: HttpRequest) -> QuerySet[FailedJob]:
        # The change list defers ``error``; its summary column reads only the end.
        queryset: QuerySet[FailedJob] = (
            super().get_queryset(request).annotate(error_tail=Right("error", ERROR_TAIL), error_length=Length("error"))
        )
        return queryset

    @admin.display(description="error")
    def short_error(self, failed: FailedJob) -> str:
        tail = getattr(failed, "error_tail", None)
        if tail is None:
            summary = failed.error_summary
        else:
            lines = [line.strip() for line in tail.splitlines() if line.strip()]
            summary = lines[-1] if lines else ""
            if len(lines) == 1 and failed.error_length > len(tail):  # type: ignore[attr-defined]
                summary = "…" + summary  # the last line is longer than the tail read
        return summary if len(summary) <= 120 else summary[:119] + "…"

    @admin.display(description="payload")
    def pretty_payload(self, failed: FailedJob) -> str:
        return format_html("<pre>{}</pre>", pretty_payload(failed.payload))

    @admin.display(description="error")
    def traceback(self, failed: FailedJob) -> str:
        return format_html("<pre>{}</pre>", failed.error)

    def has_retry_permission(self, request: HttpRequest) -> bool:
        opts = self.model._meta
        return request.user.has_perm(f"{opts.app_label}.change_{opts.model_name}") and request.user.has_perm(
            "django_dbqueue.add_job"
        )

    @admin.action(description="Retry selected failed jobs", permissions=["retry"])
    def retry_selected(self, request: HttpRequest, queryset: QuerySet[FailedJob]) -> None:
        count = retry_failed(queryset)
        self.message_user(
            request,
            ngettext("%d job was put back on the queue.", "%d jobs were put back on the queue.", count) % count,
            messages.SUCCESS,
        )

    def get_urls(self) -> list[Any]:
        return [
            path(
                "<int:pk>/retry/",
                self.admin_site.admin_view(require_POST(self.retry_view)),
                name="django_dbqueue_failedjob_retry",
            ),
            *super().get_urls(),
        ]

    def retry_view(self, request: HttpRequest, pk: int) -> HttpResponse:
        if not self.has_retry_permission(request):
            raise PermissionDenied
        if lifecycle.retry(FailedJob.objects.filter(pk=pk)):
            self.message_user(request, f"Failed job {pk} was put back on the queue.", messages.SUCCESS)
        else:
            self.message_user(request, f"Failed job {pk} no longer exists.", messages.WARNING)
        return HttpResponseRedirect(reverse("admin:django_dbqueue_failedjob_changelist"))

    def change_view(
        self, request: HttpRequest, object_id: str, form_url: str = "", extra_context: dict[str, Any] | None = None
    ) -> HttpResponse:
        extra = {**(extra_context or {}), "can_retry": self.has_retry_permission(request)}
        return super().change_view(request, object_id, form_url, extra_context=extra)


@admin.register(JobProgress)
class JobProgressAdmin(ReadOnlyMixin, admin.ModelAdmin):  # type: ignore[type-arg]
    list_display = ["key", "bar", "stage", "finished", "failed", "updated_at"]
    list_filter = ["finished", "failed"]
    search_fields = ["key", "stage"]

    @admin.display(description="percent")
    def bar(self, progress: JobProgress) -> str:
        color = "#ba2121" if progress.failed else "#417690"
        return format_html(
            '<div style="width:160px;background:#eee;border-radius:3px" title="{}%">'
            '<div style="width:{}%;background:{};height:12px;border-radius:3px"></div></div>',
            f"{progress.percent:.0f}",
            f"{progress.percent:.1f}",
            color,
        )


@admin.register(ScheduleState)
class ScheduleStateAdmin(ReadOnlyMixin, admin.ModelAdmin):  # type: ignore[type-arg]
    """Periodic schedules: when each runs next, how its last run went; run one now, enable or disable."""

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
        last_job = Job.objects.filter(pk=OuterRef("last_job_id"))
        queryset: QuerySet[ScheduleState] = (
            super()
            .get_queryset(request)
            .annotate(
                last_reserved=Exists(last_job.filter(reserved_at__isnull=False)),
                last_queued=Exists(last_job),
                last_failed_class=Subquery(
                    FailedJob.objects.filter(job_id=OuterRef("last_job_id")).values("exception_class")[:1]
                ),
            )
        )
        return queryset

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

    def has_run_permission(self, request: HttpRequest) -> bool:
        return request.user.has_perm("django_dbqueue.run_schedule")

    def has_toggle_permission(self, request: HttpRequest) -> bool:
        return request.user.has_perm("django_dbqueue.change_schedulestate")

    @admin.action(description="Run selected schedules now (one extra run each)", permissions=["run"])
    def run_selected_now(self, request: HttpRequest, queryset: QuerySet[ScheduleState]) -> None:
        started, stale = [], []
        for name in queryset.values_list("name", flat=True):
            try:
                handle = schedules.run_now(name)
            except LookupError:
                stale.append(name)
            else:
                started.append(f"{name} (job {handle.id})")
        if started:
            self.message_user(request, f"Enqueued now: {', '.join(started)}.", messages.SUCCESS)
        if stale:
            self.message_user(
                request, f"Not run, not declared in this code (stale): {', '.join(stale)}.", messages.WARNING
            )

    @admin.action(description="Enable selected schedules (from their next tick on)", permissions=["toggle"])
    def enable_selected(self, request: HttpRequest, queryset: QuerySet[ScheduleState]) -> None:
        count = schedules.set_enabled(list(queryset.values_list("name", flat=True)), True)
        self.message_user(
            request, ngettext("%d schedule was enabled.", "%d schedules were enabled.", count) % count, messages.SUCCESS
        )

    @admin.action(description="Disable selected schedules", permissions=["toggle"])
    def disable_selected(self, request: HttpRequest, queryset: QuerySet[ScheduleState]) -> None:
        count = schedules.set_enabled(list(queryset.values_list("name", flat=True)), False)
        self.message_user(
            request,
            ngettext("%d schedule was disabled.", "%d schedules were disabled.", count) % count,
            messages.SUCCESS,
        )


admin.site.register(JobBatch, JobBatchAdmin)
