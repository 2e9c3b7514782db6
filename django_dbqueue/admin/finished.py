"""The finished jobs' pages (``finished``): the history searched by name, queue, outcome, time and
argument JSON, each run's page with its stored result, and enqueue a run again.

The table may hold millions of rows: the list never counts them all (``CappedPaginator``), offers
no filter whose choices are read from the table, and sorts only by ``finished_at``, the order its
indexes keep (alone, or after the name or the queue)."""

from __future__ import annotations

import json
from datetime import datetime, time, timedelta
from typing import Any

from django.contrib import admin, messages
from django.core.exceptions import PermissionDenied
from django.core.paginator import Paginator
from django.db import connections
from django.db.models import QuerySet
from django.http import HttpRequest, HttpResponse
from django.urls import path
from django.utils import timezone
from django.utils.dateformat import format as date_format
from django.utils.dateparse import parse_date, parse_datetime
from django.utils.functional import cached_property
from django.utils.html import format_html, format_html_join
from django.utils.safestring import mark_safe
from django.utils.translation import ngettext
from django.views.decorators.http import require_POST

from .. import finished
from ..models import FinishedJob, TaskResultRecord, record_id
from ..operations import enqueue_again
from .base import ReadOnlyAdmin, permission
from .matching import TextFilter

# Rows the change list counts at most: past it, it says "more than" and pages no further.
COUNT_LIMIT = 10_000
# Finished runs one "Enqueue again" enqueues at most (a selection "across" every page included).
ENQUEUE_AGAIN_LIMIT = 1000
OUTCOME_STYLES = {"failed": "color:var(--error-fg);font-weight:bold", "cancelled": "color:var(--body-quiet-color)"}


class CappedPaginator(Paginator):  # type: ignore[type-arg]
    """A paginator that counts at most ``COUNT_LIMIT + 1`` rows (``capped``: there are more)."""

    limit = f"{COUNT_LIMIT:,}"

    @cached_property
    def count(self) -> int:
        return int(self.object_list.order_by()[: COUNT_LIMIT + 1].count())  # type: ignore[attr-defined]

    @property
    def capped(self) -> bool:
        return self.count > COUNT_LIMIT


class FinishedFilter(TextFilter):
    """A text filter by one column: ``parse`` reads the text (a ValueError is said as an error
    message, and no row is shown), ``lookup`` selects by what it read."""

    lookup: str

    def parse(self, text: str) -> Any:
        return text

    def queryset(self, request: HttpRequest, queryset: QuerySet[FinishedJob]) -> QuerySet[FinishedJob]:
        text = (self.value() or "").strip()
        if not text:
            return queryset
        try:
            value = self.parse(text)
        except ValueError as error:
            messages.error(request, f"{self.title}: {error}")
            return queryset.none()
        return queryset.filter(**{self.lookup: value})


class NameFilter(FinishedFilter):
    title = "name (exact)"
    parameter_name = lookup = "name"


class QueueFilter(FinishedFilter):
    title = "queue (exact)"
    parameter_name = lookup = "queue"


class JobIdFilter(FinishedFilter):
    title = "job id"
    parameter_name = lookup = "job_id"

    def parse(self, text: str) -> int:
        if not text.isdigit():
            raise ValueError(f"a job id is a number: {text!r}")
        return int(text)


def moment(text: str, *, end_of_day: bool) -> datetime:
    """A date or a date and time typed in the current time zone; a date alone is its first moment,
    or the first moment of the day after (``end_of_day``: an "until" date includes its day)."""
    day = parse_date(text)  # before parse_datetime, which reads a date alone as its midnight
    when = parse_datetime(text) if day is None else datetime.combine(day + timedelta(days=end_of_day), time())
    if when is None:
        raise ValueError(f"use a date or a date and time, such as 2025-01-31 or 2025-01-31 14:00: {text!r}")
    return when if timezone.is_aware(when) else timezone.make_aware(when)


class SinceFilter(FinishedFilter):
    title = "finished since"
    parameter_name = "since"
    lookup = "finished_at__gte"

    def parse(self, text: str) -> datetime:
        return moment(text, end_of_day=False)


class UntilFilter(FinishedFilter):
    title = "finished until"
    parameter_name = "until"
    lookup = "finished_at__lt"

    def parse(self, text: str) -> datetime:
        return moment(text, end_of_day=True)


class FinishedJobAdmin(ReadOnlyAdmin):
    list_display = [
        "finished_time",
        "dotted_name",
        "queue",
        "coloured_outcome",
        "attempts",
        "seconds",
        "worker",
        "job_id",
    ]
    list_filter = ["outcome", NameFilter, QueueFilter, SinceFilter, UntilFilter, JobIdFilter]
    # The search box reads argument JSON (get_search_results), never a LIKE over the payloads.
    search_fields = ["payload"]
    search_help_text = 'Arguments as JSON: {"order_id": 42} for keyword arguments, [42] or 42 for positional ones.'
    changelist_defer = ["payload", "error"]
    ordering = ["-finished_at", "-id"]
    # The order the indexes keep; another would sort the whole selection for one page.
    sortable_by = ["finished_time"]
    paginator = CappedPaginator
    show_full_result_count = False
    show_facets = admin.ShowFacets.NEVER
    # Short values a few to a line, then the payload, the error and the result.
    fields = (
        ("job_id", "name", "queue"), ("outcome", "attempts", "priority", "exception_class"),
        ("created_at", "started_at", "finished_at", "seconds"), ("worker", "batch_id", "node_id", "id"),
        "pretty_payload", "traceback", "result",
    )  # fmt: skip
    readonly_fields = [name for line in fields for name in ((line,) if isinstance(line, str) else line)]
    actions = ["enqueue_again_selected"]
    change_form_template = "admin/django_dbqueue/finishedjob/change_form.html"
    change_list_template = "admin/django_dbqueue/finishedjob/change_list.html"

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    has_enqueue_again_permission = permission("view_finishedjob", "add_job")

    def get_urls(self) -> list[Any]:
        again = self.admin_site.admin_view(require_POST(self.enqueue_again_view))
        return [
            path("<int:pk>/enqueue-again/", again, name="django_dbqueue_finishedjob_enqueue_again"),
            *super().get_urls(),
        ]

    def get_search_results(
        self, request: HttpRequest, queryset: QuerySet[FinishedJob], search_term: str
    ) -> tuple[QuerySet[FinishedJob], bool]:
        if not search_term.strip():
            return queryset, False
        try:
            condition = finished.argument_filter(search_term, connections[queryset.db].vendor)
        except ValueError as error:
            messages.error(request, str(error))
            return queryset.none(), False
        return queryset.filter(condition), False

    @admin.display(description="finished at", ordering="finished_at")
    def finished_time(self, row: FinishedJob) -> str:
        return date_format(timezone.localtime(row.finished_at), "Y-m-d H:i:s")

    @admin.display(description="name")
    def dotted_name(self, row: FinishedJob) -> str:
        """The name, which may break after each dot (a dotted path is one long word)."""
        return format_html_join(mark_safe(".<wbr>"), "{}", ((part,) for part in row.name.split(".")))

    @admin.display(description="outcome")
    def coloured_outcome(self, row: FinishedJob) -> str:
        return format_html('<span style="{}">{}</span>', OUTCOME_STYLES.get(row.outcome, ""), row.outcome)

    @admin.display(description="duration")
    def seconds(self, row: FinishedJob) -> str:
        if row.duration is None:
            return ""
        return f"{row.duration * 1000:.1f} ms" if row.duration < 1 else f"{row.duration:.2f} s"

    @admin.display(description="payload")
    def pretty_payload(self, row: FinishedJob) -> str:
        if row.payload is None:
            return "not kept: the envelope could not be read as JSON"
        return format_html("<pre>{}</pre>", json.dumps(row.payload, indent=2, ensure_ascii=False, sort_keys=True))

    @admin.display(description="error")
    def traceback(self, row: FinishedJob) -> str:
        return format_html("<pre>{}</pre>", row.error) if row.error else ""

    @admin.display(description="result")
    def result(self, row: FinishedJob) -> str:
        """The result stored for the job (a definition with ``results=True``), read now: it may have been pruned."""
        record = TaskResultRecord.objects.filter(pk=record_id(row.job_id)).first()
        if record is None:
            return "not stored"
        value = json.dumps(record.return_value, indent=2, ensure_ascii=False, sort_keys=True)
        return format_html("{}, returned:<pre>{}</pre>", record.status, value)

    @admin.action(description="Enqueue selected finished jobs again", permissions=["enqueue_again"])
    def enqueue_again_selected(self, request: HttpRequest, queryset: QuerySet[FinishedJob]) -> None:
        ids = list(queryset.order_by().values_list("pk", flat=True)[: ENQUEUE_AGAIN_LIMIT + 1])
        if len(ids) > ENQUEUE_AGAIN_LIMIT:
            messages.error(request, f"Nothing was enqueued: select at most {ENQUEUE_AGAIN_LIMIT:,} finished jobs.")
            return
        self._enqueue_again(request, ids)

    def enqueue_again_view(self, request: HttpRequest, pk: int) -> HttpResponse:
        if not self.has_enqueue_again_permission(request):
            raise PermissionDenied
        if not FinishedJob.objects.filter(pk=pk).exists():
            messages.warning(request, f"Finished job {pk} no longer exists (pruned).")
            return self.redirect("finishedjob_changelist")
        self._enqueue_again(request, [pk])
        return self.redirect("finishedjob_change", pk)

    def _enqueue_again(self, request: HttpRequest, ids: list[int]) -> None:
        try:
            handles = enqueue_again(ids)
        except ValueError as error:
            messages.error(request, f"Nothing was enqueued: {error}.")
            return
        count, new = len(handles), ", ".join(str(handle.id) for handle in handles)
        message = ngettext(
            "%d finished job was enqueued again: job %s.", "%d finished jobs were enqueued again: jobs %s.", count
        )
        messages.success(request, message % (count, new))

    def changelist_view(self, request: HttpRequest, extra_context: dict[str, Any] | None = None) -> HttpResponse:
        extra = {**(extra_context or {}), "keeping": finished.keeping()}
        return super().changelist_view(request, extra_context=extra)

    def change_view(
        self, request: HttpRequest, object_id: str, form_url: str = "", extra_context: dict[str, Any] | None = None
    ) -> HttpResponse:
        extra = {**(extra_context or {}), "can_enqueue_again": self.has_enqueue_again_permission(request)}
        return super().change_view(request, object_id, form_url, extra_context=extra)
