"""Bulk actions on a filter: retry the failed jobs, or cancel the waiting jobs, that a filter selects.

One home for the filter (job name, queue, error text, a time range), the count an operator confirms
and the chunked loop, shared by the admin's "all matching" pages and ``queue_retry`` / ``queue_cancel``.
Each chunk is one transaction of ``lifecycle.retry`` or ``lifecycle.cancel_unreserved``, so a
million-row action never holds one huge transaction or its locks, and an interrupted one leaves
each job either changed or as it was. Only the rows counted are acted on (ids up to the highest
counted): a job that fails or is enqueued after the confirmation is not swept in.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from datetime import datetime
from typing import Any

from django.db import connections
from django.db.models import Count, Max, QuerySet

from . import lifecycle
from .insert import analyze_if_large
from .models import ANALYZE_AFTER, FailedJob, Job

# Rows changed per transaction: bounded memory and lock time. Under ANALYZE_AFTER, so PostgreSQL
# analyzes the job table once at the end of a retry, not after each chunk.
CHUNK = ANALYZE_AFTER - 1


@dataclasses.dataclass(frozen=True)
class JobFilter:
    """What a bulk action selects; each part left None selects any. ``error_contains`` (failed jobs
    only) is matched without regard to case; ``since``/``until`` bound when a failed job failed, or
    when a job was enqueued (``since`` included, ``until`` not)."""

    name: str | None = None
    queue: str | None = None
    error_contains: str | None = None
    since: datetime | None = None
    until: datetime | None = None

    def __post_init__(self) -> None:
        if self.since is not None and self.until is not None and self.until <= self.since:
            raise ValueError(
                f"the time range ends ({self.until.isoformat()}) before it starts ({self.since.isoformat()})"
            )
        if self.error_contains is not None and not self.error_contains.strip():
            raise ValueError("the error text to match is empty")

    @property
    def empty(self) -> bool:
        """Whether it selects every row."""
        return all(value is None for value in dataclasses.astuple(self))

    def failed(self) -> QuerySet[FailedJob]:
        """The failed jobs it selects."""
        failed: QuerySet[FailedJob] = FailedJob.objects.get_queryset()
        if self.error_contains is not None:
            failed = error_contains(failed, self.error_contains)
        return self._common(failed, "failed_at")

    def jobs(self) -> QuerySet[Job]:
        """The jobs it selects, in any state; ``error_contains`` is refused (a job has no error)."""
        if self.error_contains is not None:
            raise ValueError("only failed jobs have an error text to match")
        return self._common(Job.objects.get_queryset(), "created_at")

    def _common(self, rows: QuerySet[Any], at: str) -> QuerySet[Any]:
        if self.name is not None:
            rows = rows.filter(name=self.name)
        if self.queue is not None:
            rows = rows.filter(queue=self.queue)
        if self.since is not None:
            rows = rows.filter(**{f"{at}__gte": self.since})
        if self.until is not None:
            rows = rows.filter(**{f"{at}__lt": self.until})
        return rows

    def describe(self) -> str:
        """The filter in words: ``queue=emails, error contains 'timeout'``; ``every job`` when empty."""
        parts = [f"name={self.name}" if self.name is not None else "", f"queue={self.queue}" if self.queue else ""]
        if self.error_contains is not None:
            parts.append(f"error contains {self.error_contains!r}")
        if self.since is not None:
            parts.append(f"since {self.since.isoformat()}")
        if self.until is not None:
            parts.append(f"until {self.until.isoformat()}")
        return ", ".join(part for part in parts if part) or "every job"


def error_contains(failed: QuerySet[FailedJob], text: str) -> QuerySet[FailedJob]:
    """The failed jobs whose error holds ``text``, whatever its case (a scan of the errors: the
    chunks page through it by id, a chunk at a time)."""
    return failed.filter(error__icontains=text)


@dataclasses.dataclass(frozen=True)
class Counted:
    """A selection counted before an operator confirms its action; the action changes only these rows."""

    selection: QuerySet[Any]
    count: int
    # Highest id counted, so rows that match only after the count are left alone.
    last_id: int | None

    def rows(self) -> QuerySet[Any]:
        """The rows counted that still match."""
        return self.selection.filter(pk__lte=self.last_id if self.last_id is not None else 0)


def count(selection: QuerySet[Any], last_id: int | None = None) -> Counted:
    """Count ``selection`` (only ids up to ``last_id`` if given: a count confirmed on an earlier page)."""
    if last_id is not None:
        selection = selection.filter(pk__lte=last_id)
    found = selection.order_by().aggregate(count=Count("pk"), last_id=Max("pk"))
    return Counted(selection, found["count"], found["last_id"])


def failed_to_retry(selection: QuerySet[FailedJob], last_id: int | None = None) -> Counted:
    """Count the failed jobs ``selection`` holds, to retry them."""
    return count(selection, last_id)


def waiting_to_cancel(selection: QuerySet[Job], last_id: int | None = None) -> Counted:
    """Count the jobs ``selection`` holds that nobody has reserved (waiting, delayed, blocked), to cancel them."""
    return count(selection.filter(reserved_at__isnull=True), last_id)


def running(selection: QuerySet[Job]) -> int:
    """How many jobs of ``selection`` a worker holds: a bulk cancel leaves them to run (cancel one by id
    to ask it to stop)."""
    return selection.filter(reserved_at__isnull=False).count()


def retry_all(counted: Counted, *, chunk_size: int = CHUNK, progress: Callable[[int], object] | None = None) -> int:
    """Retry the failed jobs ``counted``, a transaction per chunk; return how many went back on the queue."""
    return retry_failed(counted.rows(), chunk_size=chunk_size, progress=progress)


def cancel_all(
    counted: Counted, *, reason: str = "", chunk_size: int = CHUNK, progress: Callable[[int], object] | None = None
) -> int:
    """Cancel the jobs ``counted`` that nobody holds yet, a transaction per chunk (a job reserved
    since the count is left to its worker); return how many were cancelled."""
    cancelled = 0
    for chunk in id_chunks(counted.rows(), chunk_size):
        cancelled += len(lifecycle.cancel_unreserved(chunk, reason=reason))
        if progress is not None:
            progress(cancelled)
    return cancelled


def retry_failed(
    failed: QuerySet[FailedJob],
    *,
    chunk_size: int = CHUNK,
    progress: Callable[[int], object] | None = None,
) -> int:
    """Put failed jobs back as fresh jobs, ``chunk_size`` ids per transaction in id order; return how many.

    ``progress`` gets the number retried after each chunk; if anything raises, the chunks done stay retried.
    """
    retried = 0
    for chunk in id_chunks(failed, chunk_size):
        retried += len(lifecycle.retry(FailedJob.objects.filter(pk__in=chunk)))
        if progress is not None:
            progress(retried)
    analyze_if_large(failed.db, retried)
    return retried


def id_chunks(selection: QuerySet[Any], chunk_size: int) -> Iterator[list[int]]:
    """The ids of ``selection`` in ascending order, ``chunk_size`` at a time, each read after the last was used."""
    limit = connections[selection.db].features.max_query_params
    size = max(1, min(chunk_size, limit) if limit else chunk_size)
    page = selection.order_by("pk")
    while chunk := list(page.values_list("pk", flat=True)[:size]):
        yield chunk
        if len(chunk) < size:
            return
        page = selection.order_by("pk").filter(pk__gt=chunk[-1])
