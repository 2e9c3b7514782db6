"""Moving job rows to ``FailedJob``: the columns a failed row takes, and the cancel of rows nobody holds."""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

from django.db import transaction

from ..db import DbNow, alias
from ..models import CANCELLED_CLASS, FailedJob, Job
from ..signals import job_cancelled
from ..validation import NULLABLE_BOUNDS, ROW_BOUNDS, row_error


def failed_values(job: Job) -> dict[str, Any]:
    """The ``FailedJob`` columns of ``job``, brought within the job table's bounds (a row written
    past them must still move)."""
    values = {
        "job_id": job.pk, "batch_id": job.batch_id, "node_id": job.node_id, "queue": job.queue, "name": job.name,
        "payload": job.payload, "created_at": job.created_at, "priority": job.priority,
        "max_tries": job.max_tries, "retry_after": job.retry_after, "timeout": job.timeout,
        "attempts": job.attempts,
    }  # fmt: skip
    if row_error(values) is None:
        return values
    for column, (low, high) in ROW_BOUNDS.items():
        value = values.get(column)
        if column not in values or (value is None and column in NULLABLE_BOUNDS):
            continue
        value = value if isinstance(value, int) else low
        values[column] = max(low, value) if high is None else min(high, max(low, value))
    return values


def gone(rows: list[Job]) -> list[Job]:
    """The rows among ``rows`` that are gone (on SQLite, with no row locks, a worker may have claimed one)."""
    ids = [row.pk for row in rows]
    kept = {
        pk
        for start in range(0, len(ids), 900)
        for pk in Job.objects.filter(pk__in=ids[start : start + 900]).values_list("pk", flat=True)
    }
    return [row for row in rows if row.pk not in kept]


def cancel_unstarted(job_ids: Sequence[int], errors: Callable[[Job], str], using: str | None = None) -> list[Job]:
    """Move the jobs among ``job_ids`` that nobody holds to ``FailedJob`` as cancelled, with
    ``errors(job)``, in the caller's transaction; return them. No reaction runs (the caller is one)."""
    using = using or alias()
    rows = list(
        Job.objects.using(using).filter(pk__in=job_ids, reserved_at__isnull=True).select_for_update().order_by("id")
    )
    if not rows:
        return []
    unreserved = Job.objects.db_manager(using).get_queryset().filter(pk__in=[row.pk for row in rows])
    if unreserved.filter(reserved_at__isnull=True).delete_now() != len(rows):
        rows = gone(rows)  # SQLite, no row lock: a claim came first
    failed = FailedJob.objects.using(using).bulk_create(
        [
            FailedJob(**failed_values(row), exception_class=CANCELLED_CLASS, error=errors(row), failed_at=DbNow())
            for row in rows
        ]
    )
    for row, failed_job in zip(rows, failed, strict=True):
        send = functools.partial(job_cancelled.send_robust, sender=Job, job_id=row.pk, failed_job=failed_job)
        transaction.on_commit(send, using=using, robust=True)
    return rows
