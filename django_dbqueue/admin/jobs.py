"""The jobs' pages: the job list by state, its actions (run now, reclaim, cancel, delete), and progress."""

from __future__ import annotations

import functools
from typing import Any

from django.contrib import admin, messages
from django.contrib.admin import actions as admin_actions
from django.contrib.admin.utils import unquote
from django.db.models import QuerySet
from django.http import HttpRequest, HttpResponse
from django.template.loader import render_to_string
from django.urls import path
from django.utils.translation import ngettext
from django.views.decorators.http import require_http_methods, require_POST

from .. import bulk
from ..db import DbNow
from ..models import Job, JobProgress, JobQuerySet, State
from ..operations import cancel_jobs, delete_unreserved, job_state, release_expired, run_now
from . import dashboard
from .base import GoneError, ReadOnlyAdmin, StateFilter, permission, pretty_payload
from .dashboard import pause_for
from .matching import BulkAction, matching_view

# Jobs cancelled per transaction by "Cancel all matching".
CANCEL_CHUNK = bulk.CHUNK
RESERVED_REFUSAL = (
    "a worker has reserved it and may be running it. Deleting it would drop its outcome and, in a chain, "
    "the steps still to run; cancel it instead (the Cancel actions), or delete it once it is waiting again."
)


class JobStateFilter(StateFilter):
    # The models' one vocabulary of states (State, JobQuerySet.in_state); the admin says why
    # a row is blocked.
    states = {
        state.value: (
            "blocked (concurrency limit)" if state == State.BLOCKED else state.label,
            functools.partial(JobQuerySet.in_state, state=state),
        )
        for state in State
    }


class JobAdmin(ReadOnlyAdmin):
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
    list_filter = [JobStateFilter, "queue"]
    search_fields = ["name", "queue", "=id", "=unique_key", "=concurrency_key"]
    changelist_defer = ["payload"]
    # Every column, in the model's order; the payload as indented JSON.
    readonly_fields = [*(field.name for field in Job._meta.fields if field.name != "payload"), "pretty_payload"]
    exclude = ["payload"]
    actions = ["run_now", "release_expired", "cancel_selected", "cancel_selected_hard", "delete_selected"]
    change_list_template = "admin/django_dbqueue/job/change_list.html"

    def get_queryset(self, request: HttpRequest) -> QuerySet[Job]:
        queryset: QuerySet[Job] = super().get_queryset(request)
        return queryset.annotate(**{"db_now": DbNow()})  # a dict: Job declares db_now for mypy

    def get_urls(self) -> list[Any]:
        view = self.admin_site.admin_view
        return [
            path("overview/", view(dashboard.overview_for(self)), name="django_dbqueue_overview"),
            path("overview/pause/", view(require_POST(pause_for(self, pause=True))), name="django_dbqueue_pause"),
            path("overview/resume/", view(require_POST(pause_for(self, pause=False))), name="django_dbqueue_resume"),
            path(
                "cancel-matching/",
                view(require_http_methods(["GET", "POST"])(self.cancel_matching_view)),
                name="django_dbqueue_job_cancel_matching",
            ),
            *super().get_urls(),
        ]

    @admin.display(description="state")
    def state(self, job: Job) -> str:
        return job_state(job, getattr(job, "db_now", None))

    @admin.display(description="payload")
    def pretty_payload(self, job: Job) -> str:
        return pretty_payload(job.payload)

    # Delete: never a reserved job, whose worker would run on and its outcome be lost.

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        if obj is not None and obj.reserved_at is not None:
            return False
        return super().has_delete_permission(request, obj)

    @admin.action(description="Delete selected jobs (not reserved ones)", permissions=["delete"])
    def delete_selected(self, request: HttpRequest, queryset: JobQuerySet) -> HttpResponse | None:
        """Delete the selected jobs that no worker has reserved, after a confirmation page; refuse the others."""
        if not request.POST.get("post"):
            self._refuse_reserved(request, queryset.reserved().count())
            unreserved = queryset.filter(reserved_at__isnull=True)
            return admin_actions.delete_selected(self, request, unreserved) if unreserved.exists() else None
        ids = list(queryset.values_list("pk", flat=True))
        deleted = delete_unreserved(ids)
        if deleted:
            self.log_deletions(request, deleted)  # type: ignore[arg-type]
            count = len(deleted)
            messages.success(request, ngettext("%d job was deleted.", "%d jobs were deleted.", count) % count)
        self._refuse_reserved(request, Job.objects.reserved().filter(pk__in=ids).count())
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
            messages.error(request, message % count)

    def delete_queryset(self, request: HttpRequest, queryset: QuerySet[Job]) -> None:
        delete_unreserved(list(queryset.values_list("pk", flat=True)))

    def delete_model(self, request: HttpRequest, obj: Job) -> None:
        if not delete_unreserved([obj.pk]):
            raise GoneError

    def delete_view(self, request: HttpRequest, object_id: str, extra_context: dict[str, Any] | None = None) -> Any:
        job = self.get_object(request, unquote(object_id))
        if job is None or job.reserved_at is None or not super().has_delete_permission(request, job):
            try:
                return super().delete_view(request, object_id, extra_context)
            except GoneError:  # reserved after the page was read
                assert job is not None
        messages.error(request, f"Job {job.pk} was not deleted: {RESERVED_REFUSAL}")
        return self.redirect("job_change", job.pk)

    has_run_permission = permission("change_job")
    has_cancel_permission = permission("cancel_job")

    @admin.action(description="Run selected jobs now", permissions=["run"])
    def run_now(self, request: HttpRequest, queryset: QuerySet[Job]) -> None:
        count = run_now(queryset)
        messages.success(request, ngettext("%d job is available now.", "%d jobs are available now.", count) % count)

    @admin.action(description="Release expired reservations", permissions=["run"])
    def release_expired(self, request: HttpRequest, queryset: QuerySet[Job]) -> None:
        count = release_expired(queryset)
        message = ngettext("%d expired reservation was released.", "%d expired reservations were released.", count)
        messages.success(request, message % count)

    @admin.action(description="Cancel selected jobs (running ones stop when they next check)", permissions=["cancel"])
    def cancel_selected(self, request: HttpRequest, queryset: QuerySet[Job]) -> None:
        self._cancel(request, queryset, hard=False)

    @admin.action(description="Cancel selected jobs, stopping running ones at once", permissions=["cancel"])
    def cancel_selected_hard(self, request: HttpRequest, queryset: QuerySet[Job]) -> None:
        self._cancel(request, queryset, hard=True)

    def cancel_matching_view(self, request: HttpRequest) -> HttpResponse:
        """Cancel every job nobody holds that the list's current filter selects, after a page with their
        count; running jobs are left to run (the Cancel selected actions ask them to stop)."""

        def cancel(request: HttpRequest, counted: bulk.Counted) -> int:
            reason = f"cancelled in the admin by {request.user.get_username()}"
            return bulk.cancel_all(counted, reason=reason, chunk_size=CANCEL_CHUNK)

        def running(selection: QuerySet[Job]) -> str:
            count = bulk.running(selection)
            if not count:
                return ""
            return (
                f"{count:,} running job(s) match too and are left to run: select them and use a Cancel "
                "selected action to ask them to stop."
            )

        action = BulkAction(
            allowed=self.has_cancel_permission,
            count=bulk.waiting_to_cancel,
            act=cancel,
            title="Cancel all matching waiting jobs",
            verb="Cancel",
            nouns=("waiting job", "waiting jobs"),
            done=(
                "%s job was cancelled; it is listed with the failed jobs.",
                "%s jobs were cancelled; they are listed with the failed jobs.",
            ),
            note=running,
        )
        return matching_view(self, request, action)

    def changelist_view(self, request: HttpRequest, extra_context: dict[str, Any] | None = None) -> HttpResponse:
        extra = {**(extra_context or {}), "can_cancel": self.has_cancel_permission(request)}
        return super().changelist_view(request, extra_context=extra)

    def _cancel(self, request: HttpRequest, queryset: QuerySet[Job], *, hard: bool) -> None:
        reason = f"cancelled in the admin by {request.user.get_username()}"
        outcomes = list(cancel_jobs(queryset.values_list("pk", flat=True), hard=hard, reason=reason).values())
        cancelled, requested = outcomes.count("cancelled"), outcomes.count("requested")
        if cancelled:
            message = ngettext(
                "%d job was cancelled; it is listed with the failed jobs.",
                "%d jobs were cancelled; they are listed with the failed jobs.",
                cancelled,
            )
            messages.success(request, message % cancelled)
        if requested:
            message = ngettext("%d running job was asked to stop.", "%d running jobs were asked to stop.", requested)
            stop = " They are stopped as at a timeout." if hard else " Each stops when it next checks."
            messages.success(request, message % requested + stop)
        if len(outcomes) > cancelled + requested:
            messages.warning(request, f"{len(outcomes) - cancelled - requested} job(s) had finished already.")


class JobProgressAdmin(ReadOnlyAdmin):
    list_display = ["key", "bar", "stage", "finished", "failed", "updated_at"]
    list_filter = ["finished", "failed"]
    search_fields = ["key", "stage"]

    @admin.display(description="percent")
    def bar(self, progress: JobProgress) -> str:
        context = {"progress": progress, "title": f"{progress.percent:.0f}", "width": f"{progress.percent:.1f}"}
        return render_to_string("admin/django_dbqueue/jobprogress/bar.html", context)
