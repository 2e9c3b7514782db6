"""The queue overview: per queue the counts a user may see, and its Pause and Resume buttons."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from datetime import datetime

from django.contrib import messages
from django.core.exceptions import PermissionDenied
from django.http import HttpRequest, HttpResponse
from django.template.response import TemplateResponse
from django.urls import reverse

from .. import pauses
from ..models import FailedJob
from ..operations import QueueStats, queue_overview
from .base import ReadOnlyAdmin

View = Callable[[HttpRequest], HttpResponse]


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


def may_pause(request: HttpRequest) -> bool:
    return request.user.has_perm("django_dbqueue.pause_queue")


def view_for(jobs: ReadOnlyAdmin) -> View:
    """The overview of the job admin ``jobs``: job counts with view_job, failed counts with view_failedjob;
    whether each queue is paused, with Pause and Resume buttons for users with pause_queue."""

    def overview_view(request: HttpRequest) -> HttpResponse:
        show_jobs = jobs.has_view_permission(request)
        show_failed = jobs.may_view(request, FailedJob)
        pause = may_pause(request)
        if not (show_jobs or show_failed or pause):
            raise PermissionDenied
        rows = [
            OverviewRow.of(stats, jobs=show_jobs, failed=show_failed)
            for stats in queue_overview()
            # A queue is listed only for a count the user may see, or for a user who may pause
            # it, so its name alone tells nothing more.
            if ((show_jobs or pause) and (stats.size or stats.paused)) or (show_failed and stats.failed)
        ]
        context = {
            **jobs.admin_site.each_context(request),
            "title": "Queue overview",
            "opts": jobs.model._meta,
            "rows": rows,
            "show_jobs": show_jobs,
            "show_failed": show_failed,
            "may_pause": pause,
            "jobs_url": reverse(f"{jobs.admin_site.name}:django_dbqueue_job_changelist") if show_jobs else "",
            "failed_url": reverse(f"{jobs.admin_site.name}:django_dbqueue_failedjob_changelist") if show_failed else "",
        }
        return TemplateResponse(request, "admin/django_dbqueue/overview.html", context)

    return overview_view


def pause_for(jobs: ReadOnlyAdmin) -> View:
    """Pause the queue named in the POST; only a queue something uses (see ``pauses.is_known``)."""

    def pause_view(request: HttpRequest) -> HttpResponse:
        queue = _queue(request)
        try:
            if pauses.pause(queue):
                message = f"Paused queue '{queue}': workers claim none of its jobs until it is resumed."
                messages.success(request, message)
            else:
                messages.warning(request, f"Queue '{queue}' was already paused.")
        except ValueError as exc:
            messages.error(request, f"Nothing was paused: {exc}.")
        return jobs.redirect("overview")

    return pause_view


def resume_for(jobs: ReadOnlyAdmin) -> View:
    def resume_view(request: HttpRequest) -> HttpResponse:
        queue = _queue(request)
        try:
            if pauses.resume(queue):
                messages.success(request, f"Resumed queue '{queue}'.")
            else:
                messages.warning(request, f"Queue '{queue}' was not paused.")
        except ValueError as exc:
            messages.error(request, f"Nothing was resumed: {exc}.")
        return jobs.redirect("overview")

    return resume_view


def _queue(request: HttpRequest) -> str:
    if not may_pause(request):
        raise PermissionDenied
    return request.POST.get("queue", "")
