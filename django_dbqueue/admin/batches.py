"""The batches' page: counts, state and progress; cancel a batch, retry its failed members.

Batch rows are written only by batches.py, so the page is read-only. Only a finished batch may be
deleted (as ``batches.prune`` does): an unfinished one's members would end without a batch to count them.
"""

from __future__ import annotations

import functools
import json
import math
from collections.abc import Callable
from typing import Any

from django.contrib import admin, messages
from django.contrib.admin import actions as admin_actions
from django.contrib.admin.utils import unquote
from django.core.exceptions import PermissionDenied
from django.db.models import Count, Q, QuerySet
from django.http import HttpRequest, HttpResponse
from django.template.loader import render_to_string
from django.urls import path
from django.utils.html import format_html_join
from django.utils.http import urlencode
from django.utils.translation import ngettext
from django.views.decorators.http import require_POST

from .. import batches, operations
from ..models import BatchState, FailedJob, Job, JobBatch
from .base import GoneError, ReadOnlyAdmin, StateFilter, permission

# Failed members listed on a batch's page; the failed job list (filtered by batch) shows them all.
FAILED_MEMBERS_SHOWN = 20
# Failed members retried per transaction: bounded memory and short locks.
RETRY_CHUNK = operations.RETRY_CHUNK
CANCELLED_REFUSAL = (
    "it was cancelled, so its failed members are not retried into it. Retry them from the failed job "
    "list: there they run on their own, outside any batch."
)
UNFINISHED_REFUSAL = (
    "it has not finished: its members would end without a batch to count them. Cancel it, "
    "and delete it once its running members have ended."
)
Check = Callable[[HttpRequest], bool]
Press = Callable[[HttpRequest, int], None]
RUNNING = Q(cancelled_at__isnull=True, finished_at__isnull=True)


def _in_state(rows: Any, *, state: BatchState) -> QuerySet[JobBatch]:
    return rows.in_state(state)  # type: ignore[no-any-return]


class BatchStateFilter(StateFilter):
    # Each value of ``JobBatch.state``, in SQL (``JobBatch.objects.in_state``).
    states = {state.value: (state.label, functools.partial(_in_state, state=state)) for state in BatchState}


def retry_members(batch_id: int) -> int | None:
    """Retry the failed members of a batch that was not cancelled, a chunk per transaction; return
    how many, or None for a cancelled batch (see ``batches.retry_failed``)."""
    if JobBatch.objects.filter(pk=batch_id, cancelled_at__isnull=False).exists():
        return None
    # A cancel committed meanwhile: FailedJobQuerySet.retry runs the rest outside the batch.
    return operations.retry_failed(FailedJob.objects.filter(batch_id=batch_id), chunk_size=RETRY_CHUNK)


class JobBatchAdmin(ReadOnlyAdmin):
    # state and succeeded: JobBatch's properties.
    list_display = [
        "id",
        "name",
        "state",
        "progress",
        "total",
        "succeeded",
        "failed",
        "cancelled",
        "pending",
        "created_at",
        "finished_at",
        "cancelled_at",
    ]
    list_display_links = ["id", "name"]
    list_filter = [BatchStateFilter]
    search_fields = ["name", "=id"]
    fieldsets = [
        (None, {"fields": ["id", "name", "state", "progress", "allow_failures"]}),
        ("Members", {"fields": [("total", "succeeded", "failed", "cancelled", "pending")]}),
        ("Callbacks", {"fields": ["callbacks_summary"]}),
        ("Times", {"fields": [("created_at", "finished_at", "cancelled_at")]}),
    ]
    # No readonly_fields: a user who may not change a row (no one may) sees the fieldsets read-only.
    actions = ["cancel_selected", "retry_failed_selected", "delete_selected"]
    change_form_template = "admin/django_dbqueue/jobbatch/change_form.html"

    def get_urls(self) -> list[Any]:
        view = self.admin_site.admin_view
        return [
            path("<int:pk>/cancel/", view(require_POST(self.cancel_view)), name="django_dbqueue_jobbatch_cancel"),
            path("<int:pk>/retry/", view(require_POST(self.retry_view)), name="django_dbqueue_jobbatch_retry"),
            *super().get_urls(),
        ]

    @admin.display(description="progress")
    def progress(self, batch: JobBatch) -> str:
        """A bar of the batch's ended members (succeeded, failed, cancelled) and the percent ended."""
        ended = (batch.succeeded, batch.failed, batch.cancelled)
        widths = [f"{100.0 * count / batch.total:.2f}" if batch.total else "0" for count in ended]
        # Rounded down: a batch shows 100% only once every member ended.
        percent = 100 if batch.pending == 0 else math.floor(batch.percent)
        context = {"batch": batch, "percent": percent, "widths": widths}
        return render_to_string("admin/django_dbqueue/jobbatch/progress.html", context)

    @admin.display(description="callbacks")
    def callbacks_summary(self, batch: JobBatch) -> str:
        """Each kind of callback and the names of its jobs, in the order they are enqueued."""
        if not batch.callbacks:
            return "-"
        try:
            steps = json.loads(batch.callbacks)
        except ValueError:
            return "unreadable: none will be enqueued"
        rows = [
            (kind, ", ".join(str(step.get("name", "?")) for step in steps[kind]))
            for kind in batches.CALLBACKS
            if steps.get(kind)
        ]
        return format_html_join("", "<div><b>{}</b>: {}</div>", rows) if rows else "-"

    has_cancel_permission = permission("cancel_batch")

    def has_retry_permission(self, request: HttpRequest) -> bool:
        """The permission to retry failed jobs, as the failed jobs' admin checks it."""
        if not self.admin_site.is_registered(FailedJob):
            return False
        failed_admin = self.admin_site.get_model_admin(FailedJob)
        return bool(getattr(failed_admin, "has_retry_permission", lambda request: False)(request))

    @admin.action(description="Cancel selected batches (waiting members are deleted)", permissions=["cancel"])
    def cancel_selected(self, request: HttpRequest, queryset: QuerySet[JobBatch]) -> None:
        ids = list(queryset.values_list("pk", flat=True))
        open_ids = list(JobBatch.objects.filter(RUNNING, pk__in=ids).values_list("pk", flat=True))
        deleted = sum(batches.cancel(pk) for pk in open_ids)
        if open_ids:
            count = len(open_ids)
            cancelled = ngettext("%d batch was cancelled", "%d batches were cancelled", count) % count
            members = ngettext(
                ": %d waiting member was deleted; running members finish.",
                ": %d waiting members were deleted; running members finish.",
                deleted,
            )
            messages.success(request, cancelled + members % deleted)
        if closed := len(ids) - len(open_ids):
            message = ngettext(
                "%d batch was cancelled or finished already.", "%d batches were cancelled or finished already.", closed
            )
            messages.warning(request, message % closed)

    @admin.action(description="Retry failed members of selected batches", permissions=["retry"])
    def retry_failed_selected(self, request: HttpRequest, queryset: QuerySet[JobBatch]) -> None:
        outcomes = {pk: retry_members(pk) for pk in queryset.values_list("pk", flat=True)}
        retried = [count for count in outcomes.values() if count is not None]
        cancelled = sorted(pk for pk, count in outcomes.items() if count is None)
        count, reopened = sum(retried), sum(1 for n in retried if n)
        if count:
            members = ngettext("%d failed member", "%d failed members", count) % count
            of = ngettext("%d batch", "%d batches", reopened) % reopened
            verb = ngettext("was", "were", count)
            messages.success(request, f"{members} of {of} {verb} put back on the queue.")
        elif not cancelled:
            messages.warning(request, "The selected batches have no failed members to retry.")
        if cancelled:
            messages.warning(request, f"Not retried: batch {', '.join(map(str, cancelled))}: {CANCELLED_REFUSAL}")

    def _button_view(self, request: HttpRequest, pk: int, allowed: Check, press: Press) -> HttpResponse:
        """A button of a batch's page: refused without permission; ``press`` runs if the batch still exists."""
        if not allowed(request):
            raise PermissionDenied
        if not JobBatch.objects.filter(pk=pk).exists():
            messages.warning(request, f"Batch {pk} no longer exists.")
            return self.redirect("jobbatch_changelist")
        press(request, pk)
        return self.redirect("jobbatch_change", pk)

    def cancel_view(self, request: HttpRequest, pk: int) -> HttpResponse:
        return self._button_view(request, pk, self.has_cancel_permission, self._cancel)

    def retry_view(self, request: HttpRequest, pk: int) -> HttpResponse:
        return self._button_view(request, pk, self.has_retry_permission, self._retry)

    def _cancel(self, request: HttpRequest, pk: int) -> None:
        if JobBatch.objects.filter(RUNNING, pk=pk).exists():
            deleted = batches.cancel(pk)
            message = ngettext(
                "Batch %(pk)d was cancelled: %(count)d waiting member was deleted; running members finish.",
                "Batch %(pk)d was cancelled: %(count)d waiting members were deleted; running members finish.",
                deleted,
            )
            messages.success(request, message % {"pk": pk, "count": deleted})
        else:
            messages.warning(request, f"Batch {pk} was cancelled or finished already.")

    def _retry(self, request: HttpRequest, pk: int) -> None:
        count = retry_members(pk)
        if count is None:
            messages.warning(request, f"Batch {pk} was not retried: {CANCELLED_REFUSAL}")
        elif count:
            message = ngettext(
                "%(count)d failed member of batch %(pk)d was put back on the queue.",
                "%(count)d failed members of batch %(pk)d were put back on the queue.",
                count,
            )
            messages.success(request, message % {"count": count, "pk": pk})
        else:
            messages.warning(request, f"Batch {pk} has no failed members to retry.")

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        if obj is not None and obj.finished_at is None:
            return False
        return super().has_delete_permission(request, obj)

    @admin.action(description="Delete selected finished batches", permissions=["delete"])
    def delete_selected(self, request: HttpRequest, queryset: QuerySet[JobBatch]) -> HttpResponse | None:
        """Delete the selected batches that have finished, after a confirmation page; refuse the others."""
        finished = queryset.filter(finished_at__isnull=False)
        unfinished = 0 if request.POST.get("post") else queryset.filter(finished_at__isnull=True).count()
        if unfinished:
            message = ngettext("%d batch is not deleted: ", "%d batches are not deleted: ", unfinished)
            messages.error(request, message % unfinished + UNFINISHED_REFUSAL)
        return admin_actions.delete_selected(self, request, finished) if finished.exists() else None

    def delete_queryset(self, request: HttpRequest, queryset: QuerySet[JobBatch]) -> None:
        # The filter runs again in the DELETE: a batch reopened by a retry meanwhile stays.
        queryset.filter(finished_at__isnull=False).delete()

    def delete_model(self, request: HttpRequest, obj: JobBatch) -> None:
        if not JobBatch.objects.filter(pk=obj.pk, finished_at__isnull=False).delete()[0]:
            raise GoneError

    def delete_view(self, request: HttpRequest, object_id: str, extra_context: dict[str, Any] | None = None) -> Any:
        try:
            return super().delete_view(request, object_id, extra_context)
        except GoneError:
            messages.error(request, f"Batch {object_id} was not deleted: {UNFINISHED_REFUSAL}")
            return self.redirect("jobbatch_change", unquote(object_id))

    def change_view(
        self, request: HttpRequest, object_id: str, form_url: str = "", extra_context: dict[str, Any] | None = None
    ) -> HttpResponse:
        batch = self.get_object(request, unquote(object_id))
        extra = {**(extra_context or {}), **(self._members_context(request, batch) if batch is not None else {})}
        return super().change_view(request, object_id, form_url, extra_context=extra)

    def _members_context(self, request: HttpRequest, batch: JobBatch) -> dict[str, Any]:
        """The batch's waiting and running members (in the job list), its failed ones (in the failed job list)."""
        by_batch = urlencode({"batch_id": batch.pk})
        may_retry = self.has_retry_permission(request) and batch.failed > 0
        context: dict[str, Any] = {
            "can_cancel": self.has_cancel_permission(request) and batch.state == "running",
            "can_retry": may_retry and batch.cancelled_at is None,
            # Said where the button would be: a cancelled batch's failed members are retried one by one.
            "retry_refusal": CANCELLED_REFUSAL if may_retry and batch.cancelled_at is not None else "",
            "show_jobs": self.may_view(request, Job),
            "show_failed": self.may_view(request, FailedJob),
        }
        if context["show_jobs"]:
            members = Job.objects.filter(batch_id=batch.pk)
            context.update(
                members.aggregate(
                    waiting=Count("pk", filter=Q(reserved_at__isnull=True)),
                    running=Count("pk", filter=Q(reserved_at__isnull=False)),
                )
            )
            context["jobs_url"] = f"{self.url('job_changelist')}?{by_batch}"
        if context["show_failed"]:
            failed = FailedJob.objects.filter(batch_id=batch.pk).order_by("id")
            shown = list(failed.only("id", "name", "exception_class", "failed_at")[:FAILED_MEMBERS_SHOWN])
            context["failed_members"] = shown
            context["failed_count"] = len(shown) if len(shown) < FAILED_MEMBERS_SHOWN else failed.count()
            context["failed_url"] = f"{self.url('failedjob_changelist')}?{by_batch}"
        return context
