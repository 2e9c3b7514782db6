"""Retry from ``FailedJob``: the same envelope back as a fresh job, its failed row removed, in one transaction."""

from __future__ import annotations

import logging
from typing import Any

from django.db import connections, transaction
from django.db.models import QuerySet

from .. import insert, steps
from ..db import DbNow
from ..exceptions import PayloadError
from ..models import JOB_RECORDS, RETRIED, FailedJob, Job, JobBatch, TaskResultRecord, record_id
from ..payload import raw
from ..signals import job_enqueued
from ..validation import row_error
from .reactions import LEFT, RETRIED_BACK, react

logger = logging.getLogger("django_dbqueue")


def retry(failed_jobs: QuerySet[FailedJob]) -> list[Job]:
    """Put each failed job back as a fresh job and remove its failed row, in one transaction."""
    using = failed_jobs.db
    with transaction.atomic(using=using):
        failed = list(failed_jobs.select_for_update().order_by("id"))
        # A failed member of a cancelled batch would not run in it: it runs on its own.
        batches = {row.batch_id for row in failed if row.batch_id is not None}
        cancelled = JobBatch.objects.using(using).filter(pk__in=batches, cancelled_at__isnull=False)
        outside = set(cancelled.values_list("pk", flat=True)) if batches else set()
        rows = [
            Job(
                queue=row.queue, name=row.name, payload=row.payload, priority=row.priority,
                max_tries=row.max_tries, retry_after=row.retry_after, timeout=row.timeout,
                available_at=DbNow(), created_at=DbNow(),
                batch_id=None if row.batch_id in outside else row.batch_id, node_id=row.node_id,
                **_flow_columns(row.payload),
            )
            for row in failed
        ]  # fmt: skip
        failed, rows = _retryable(failed, rows)
        if any(row.unique_key for row in rows):
            # A key taken since the check above: that failed job stays failed.
            kept = [(old, new) for old, new in zip(failed, insert.insert_each(rows, using), strict=True) if new]
            failed, jobs = [old for old, _ in kept], [new for _, new in kept if new is not None]
        else:
            jobs = insert.bulk_enqueue(rows, using)
        FailedJob.objects.using(using).filter(pk__in=[row.pk for row in failed]).delete()
        # Told of the new rows (a member of a cancelled batch has none there): their ids, batches and nodes.
        react(
            using,
            {
                RETRIED_BACK: [job for job in jobs if job.pk is not None],
                LEFT: [row for row in failed if row.batch_id in outside],
            },
        )
        # A handle of the failed id follows the job to its new run, and so do its durable steps.
        _retry_pointers([(row.job_id, job) for row, job in zip(failed, jobs, strict=True)])
        steps.move(using, [(row.job_id, job.pk) for row, job in zip(failed, jobs, strict=True) if job.pk is not None])
    for job in jobs:
        job_enqueued.send_robust(sender=FailedJob, job=job)
    return jobs


def _retry_pointers(retried: list[tuple[int, Job]]) -> None:
    """Point the result records of failed jobs just retried (old id, new row) at their new runs,
    in one upsert (replacing a record the failed run kept)."""
    records = []
    fallback = None
    for old_id, job in retried:
        if job.pk is None:  # MySQL (not MariaDB) returns no ids from a bulk insert
            continue
        created = job.created_at
        if hasattr(created, "resolve_expression"):
            # Not read back (Django 5.2, MySQL): the stored time of the first row, read once.
            fallback = fallback or Job.objects.filter(pk=job.pk).values_list("created_at", flat=True).get()
            created = fallback
        records.append(
            TaskResultRecord(
                id=record_id(old_id), task_path=job.name, backend=JOB_RECORDS, queue=job.queue,
                priority=job.priority, status=RETRIED, job_id=job.pk, enqueued_at=created, finished_at=created,
            )
        )  # fmt: skip
    if not records:
        return
    connection = connections[TaskResultRecord.objects.db]
    TaskResultRecord.objects.bulk_create(
        records,
        update_conflicts=True,
        # MySQL's ON DUPLICATE KEY UPDATE names no target; the primary key is implied.
        unique_fields=["id"] if connection.features.supports_update_conflicts_with_target else None,
        update_fields=["status", "job_id", "task_path", "queue", "priority", "enqueued_at", "finished_at"],
    )


# The flow columns a failed job's envelope keeps (its "flow"); anything else there is left out.
_FLOW_COLUMNS = frozenset(
    ("unique_key", "unique_until_start", "concurrency_key", "concurrency_limit", "rate_key", "rate_limit")
)


def _flow_columns(text: str) -> dict[str, Any]:
    try:
        flow = raw(text).get("flow")
    except (ValueError, PayloadError, RecursionError):
        return {}
    return {name: value for name, value in flow.items() if name in _FLOW_COLUMNS} if isinstance(flow, dict) else {}


def _retryable(failed: list[FailedJob], rows: list[Job]) -> tuple[list[FailedJob], list[Job]]:
    """Leave out the failed jobs whose row would hold a value out of bounds, or whose unique key
    another job holds now: they stay failed, logged."""
    keys = [row.unique_key for row in rows if row.unique_key]
    taken = set(Job.objects.filter(unique_key__in=keys).values_list("unique_key", flat=True)) if keys else set()
    kept = []
    for old, new in zip(failed, rows, strict=True):
        error = row_error(new.__dict__)
        if error is not None:
            logger.error("failed job not retried failed_id=%s job=%s: its row %s", old.pk, old.name, error)
        elif new.unique_key in taken:
            logger.warning(
                "failed job %s (%s) not retried: job %s with the same unique key %r is waiting or running",
                old.pk,
                old.name,
                Job.objects.filter(unique_key=new.unique_key).values_list("pk", flat=True).first(),
                new.unique_key,
            )
        else:
            kept.append((old, new))
    return [old for old, _ in kept], [new for _, new in kept]
