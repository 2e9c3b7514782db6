"""The failed jobs' pages: the dead-letter list with each error's last line, retry one or many."""

from __future__ import annotations

from typing import Any

from django.contrib import admin, messages
from django.core.exceptions import PermissionDenied
from django.db.models import QuerySet
from django.db.models.functions import Length, Right
from django.http import HttpRequest, HttpResponse
from django.urls import path
from django.utils.html import format_html
from django.utils.translation import ngettext
from django.views.decorators.http import require_http_methods, require_POST

from .. import bulk, lifecycle
from ..models import FailedJob
from ..operations import retry_failed
from .base import ReadOnlyAdmin, permission, pretty_payload
from .matching import BulkAction, TextFilter, matching_view

# Characters of a failed job's error read for the change list's one-line
# summary: the end of the traceback, where the exception line is.
ERROR_TAIL = 1000
# Characters of that line the column shows.
SUMMARY_LENGTH = 120
# Failed jobs retried per transaction by "Retry all matching".
RETRY_CHUNK = bulk.CHUNK


class ErrorFilter(TextFilter):
    """The failed jobs whose error holds a text, whatever its case: a scan of the errors, run only when asked."""

    title = "error contains"
    parameter_name = "error"

    def queryset(self, request: HttpRequest, queryset: QuerySet[FailedJob]) -> QuerySet[FailedJob]:
        value = self.value()
        return bulk.error_contains(queryset, value) if value and value.strip() else queryset


class FailedJobAdmin(ReadOnlyAdmin):
    list_display = ["id", "name", "queue", "attempts", "failed_at", "exception_class", "short_error"]
    list_filter = ["queue", "name", "exception_class", "failed_at", ErrorFilter]
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
    # Its CSS keeps long names, exception classes and errors inside the table.
    change_list_template = "admin/django_dbqueue/failedjob/change_list.html"

    def get_queryset(self, request: HttpRequest) -> QuerySet[FailedJob]:
        # The change list defers ``error``; its summary column reads only the end.
        queryset: QuerySet[FailedJob] = super().get_queryset(request)
        return queryset.annotate(error_tail=Right("error", ERROR_TAIL), error_length=Length("error"))

    def get_urls(self) -> list[Any]:
        retry = self.admin_site.admin_view(require_POST(self.retry_view))
        matching = self.admin_site.admin_view(require_http_methods(["GET", "POST"])(self.retry_matching_view))
        return [
            path("<int:pk>/retry/", retry, name="django_dbqueue_failedjob_retry"),
            path("retry-matching/", matching, name="django_dbqueue_failedjob_retry_matching"),
            *super().get_urls(),
        ]

    @admin.display(description="error")
    def short_error(self, failed: FailedJob) -> str:
        """The error's last line, cut at ``SUMMARY_LENGTH`` (the whole line read in its tooltip); the
        change list's CSS wraps it anywhere, so a long dotted path or URL stays inside the table."""
        tail = getattr(failed, "error_tail", None)
        if tail is None:
            summary = failed.error_summary
        else:
            lines = [line.strip() for line in tail.splitlines() if line.strip()]
            summary = lines[-1] if lines else ""
            if len(lines) == 1 and failed.error_length > len(tail):  # type: ignore[attr-defined]
                summary = "…" + summary  # the last line is longer than the tail read
        if len(summary) <= SUMMARY_LENGTH:
            return summary
        return format_html('<span title="{}">{}…</span>', summary, summary[: SUMMARY_LENGTH - 1])

    @admin.display(description="payload")
    def pretty_payload(self, failed: FailedJob) -> str:
        return pretty_payload(failed.payload)

    @admin.display(description="error")
    def traceback(self, failed: FailedJob) -> str:
        return format_html("<pre>{}</pre>", failed.error)

    has_retry_permission = permission("change_failedjob", "add_job")

    @admin.action(description="Retry selected failed jobs", permissions=["retry"])
    def retry_selected(self, request: HttpRequest, queryset: QuerySet[FailedJob]) -> None:
        count = retry_failed(queryset)
        message = ngettext("%d job was put back on the queue.", "%d jobs were put back on the queue.", count)
        messages.success(request, message % count)

    def retry_view(self, request: HttpRequest, pk: int) -> HttpResponse:
        if not self.has_retry_permission(request):
            raise PermissionDenied
        if lifecycle.retry(FailedJob.objects.filter(pk=pk)):
            messages.success(request, f"Failed job {pk} was put back on the queue.")
        else:
            messages.warning(request, f"Failed job {pk} no longer exists.")
        return self.redirect("failedjob_changelist")

    def retry_matching_view(self, request: HttpRequest) -> HttpResponse:
        """Retry every failed job the list's current filter selects, after a page with their count."""
        action = BulkAction(
            allowed=self.has_retry_permission,
            count=bulk.failed_to_retry,
            act=lambda request, counted: bulk.retry_all(counted, chunk_size=RETRY_CHUNK),
            title="Retry all matching failed jobs",
            verb="Retry",
            nouns=("failed job", "failed jobs"),
            done=("%s job was put back on the queue.", "%s jobs were put back on the queue."),
        )
        return matching_view(self, request, action)

    def changelist_view(self, request: HttpRequest, extra_context: dict[str, Any] | None = None) -> HttpResponse:
        extra = {**(extra_context or {}), "can_retry": self.has_retry_permission(request)}
        return super().changelist_view(request, extra_context=extra)

    def change_view(
        self, request: HttpRequest, object_id: str, form_url: str = "", extra_context: dict[str, Any] | None = None
    ) -> HttpResponse:
        extra = {**(extra_context or {}), "can_retry": self.has_retry_permission(request)}
        return super().change_view(request, object_id, form_url, extra_context=extra)
