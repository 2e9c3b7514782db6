"""Jobs about an object: every job whose arguments hold a model instance, found from that object.

A job's references (``JobReference``: its id and ``payload.reference``, such as ``demo.order:42``)
are written by ``insert.refer`` with the job's row, in its transaction, by every path that inserts
one (enqueue, enqueue_many, a chain's next step, a batch, a callback, a retry): a job enqueued in
a transaction that rolls back leaves none. Only the arguments of the job itself are read, not those
of the steps that follow it. A job without a model instance among its arguments costs one ``in``
on its payload text and no statement. A retry from ``FailedJob`` inserts the same payload as a
new job, so the new id is recorded in its transaction; the failed run's references stay as long
as its history row does. ``prune`` deletes the references of jobs that are in no table.

``jobs_for(obj)`` reads them back: the handles of the jobs in the queue and in ``FailedJob``, and
the history rows (``FinishedJob``, with ``DBQUEUE["KEEP_FINISHED"]``), newest first. Limits
(docs/howto/jobs-about-objects.md): plain MySQL (not MariaDB) returns no ids from a bulk insert,
so the jobs it inserts that way (``enqueue_many``, a batch, a chain's next step, a retry) are not
recorded; at most ``payload.MAX_REFERENCES`` objects a job.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from django.db import models

from . import finished
from .db import DbNow, alias
from .handles import JobHandle
from .models import CANCELLED_CLASS, FailedJob, FinishedJob, Job, JobReference
from .payload import reference
from .states import JobStatus

# Job ids looked at per statement by ``prune``.
PRUNE_CHUNK = 1000


@dataclasses.dataclass(frozen=True)
class JobsAbout:
    """The jobs about one object (``ref``), newest first, at most ``jobs_for``'s ``limit`` of each
    kind: the rows in the queue (``queued_rows``: waiting, delayed, blocked or running, each read
    with the database's clock as ``db_now``), in ``FailedJob`` (``failed_rows``: failed or
    cancelled) and in the history (``finished``)."""

    ref: str
    queued_rows: list[Job]
    failed_rows: list[FailedJob]
    finished: list[FinishedJob]

    @property
    def queued(self) -> list[JobHandle]:
        """The handles of the jobs in the queue (``handle.job``: the row)."""
        return [
            JobHandle(job.pk, job.name, job.queue, job.state(job.db_now).status, _job=job) for job in self.queued_rows
        ]

    @property
    def failed(self) -> list[JobHandle]:
        """The handles of the jobs in ``FailedJob``, failed or cancelled."""
        return [
            JobHandle(
                row.job_id,
                row.name,
                row.queue,
                JobStatus.CANCELLED if row.exception_class == CANCELLED_CLASS else JobStatus.FAILED,
                finished_at=row.failed_at,
            )
            for row in self.failed_rows
        ]

    @property
    def handles(self) -> list[JobHandle]:
        """The handles of the jobs in the queue, then of those in ``FailedJob``."""
        return [*self.queued, *self.failed]

    def __len__(self) -> int:
        return len(self.queued_rows) + len(self.failed_rows) + len(self.finished)


def reference_of(obj: models.Model) -> str:
    """The reference that names ``obj`` among jobs' arguments; ValueError if it is not saved."""
    if obj.pk is None:
        raise ValueError(f"{obj._meta.label} instance is not saved: no job can be about it")
    return reference(type(obj), obj.pk)


def jobs_for(obj: models.Model, *, limit: int = 50, history: bool = True, using: str | None = None) -> JobsAbout:
    """Return the jobs whose arguments hold ``obj``: in the queue, failed, and finished (if kept,
    and ``history``), newest first, at most ``limit`` of each."""
    if limit < 1:
        raise ValueError(f"limit must be at least 1, not {limit!r}")
    ref = reference_of(obj)
    using = using or alias()
    ids = JobReference.objects.using(using).filter(ref=ref).values("job_id")
    queued = Job.objects.using(using).filter(pk__in=ids).annotate(**{"db_now": DbNow()}).order_by("-id")
    failed = FailedJob.objects.using(using).filter(job_id__in=ids).order_by("-failed_at", "-id")
    kept: list[FinishedJob] = []
    if history and finished.keeping():
        kept = list(FinishedJob.objects.using(using).filter(job_id__in=ids).order_by("-finished_at", "-id")[:limit])
    return JobsAbout(ref, list(queued[:limit]), list(failed[:limit]), kept)


def is_about(obj: models.Model, job_id: int, using: str | None = None) -> bool:
    """Whether job ``job_id``'s arguments hold ``obj`` (the admin checks a button's job with it)."""
    rows = JobReference.objects.using(using or alias())
    return bool(rows.filter(ref=reference_of(obj), job_id=job_id).exists())


def prune() -> int:
    """Delete the references of jobs in no table (neither queued, failed nor kept finished: they
    succeeded without history, were forgotten, or their history was pruned); return how many."""
    using = alias()
    refs = JobReference.objects.using(using)
    deleted, after = 0, 0
    while True:
        ids = list(
            refs.filter(job_id__gt=after).order_by("job_id").values_list("job_id", flat=True).distinct()[:PRUNE_CHUNK]
        )
        if not ids:
            return deleted
        after = ids[-1]
        # Read in the order a job moves (queued, failed, finished): one that moves meanwhile is seen later on.
        kept: set[Any] = set(Job.objects.using(using).filter(pk__in=ids).values_list("pk", flat=True))
        kept |= set(FailedJob.objects.using(using).filter(job_id__in=ids).values_list("job_id", flat=True))
        kept |= set(FinishedJob.objects.using(using).filter(job_id__in=ids).values_list("job_id", flat=True))
        gone = [job_id for job_id in ids if job_id not in kept]
        if gone:
            deleted += refs.filter(job_id__in=gone).delete()[0]
        if len(ids) < PRUNE_CHUNK:
            return deleted
