"""Batches: many jobs as one unit, with callbacks when it finishes and progress.

``batch(resize.bind(1), resize.bind(2)).then(notify.bind(owner)).enqueue()`` stores a ``JobBatch``
row and its members (rows with ``batch_id``) in one transaction. The transaction that ends a
member moves the counters and enqueues the callbacks (``lifecycle``), so they fire exactly once
per event (docs/batches.md). Here: declaring, enqueueing, the handle and the operations.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime, timedelta
from typing import Any

from asgiref.sync import sync_to_async
from django.db import transaction
from django.db.models import F

from . import lifecycle
from .chains import Chain
from .db import DbNow, alias, read_back
from .enqueue import Prepared, handles_of, store_all
from .exceptions import WaitTimeout
from .handles import await_until, refuse_endless_wait_in_job, wait_seconds, wait_until
from .models import FailedJob, Job, JobBatch
from .registry import Handle, JobCall, JobDefinition
from .rows import check_queue, prepare, step
from .running import current_job

logger = logging.getLogger("django_dbqueue")

CALLBACKS = lifecycle.CALLBACKS


class BatchClosed(Exception):
    """Members cannot be added: the batch was cancelled or has finished."""


class BatchWaitTimeout(WaitTimeout):
    """``BatchHandle.wait`` ran out of time before the batch finished; it was left as it was.
    ``batch_id`` and ``status`` (the batch's state) say which and how far; no ``job_id``."""

    def __init__(self, message: str, *, batch_id: int, status: str) -> None:
        Exception.__init__(self, message)
        self.batch_id = batch_id
        self.status = status


def _member(item: Any) -> JobCall | Chain:
    if isinstance(item, JobDefinition):
        return item.bind()
    if isinstance(item, (JobCall, Chain)):
        return item
    raise TypeError(f"a batch member must be a job call such as my_job.bind(...) or a chain, not {item!r}")


def _call(item: Any) -> JobCall:
    call = _member(item)
    if not isinstance(call, JobCall):
        raise TypeError(f"a batch callback must be a job call such as my_job.bind(...), not {item!r}")
    return call


@dataclasses.dataclass(frozen=True)
class Batch:
    """Jobs (or chains) that run in parallel as one unit; build it with ``batch(...)``."""

    members: tuple[JobCall | Chain, ...]
    name: str = ""
    allow_failures: bool = False
    callbacks: Mapping[str, tuple[JobCall, ...]] = dataclasses.field(default_factory=dict)

    def _with(self, kind: str, calls: Iterable[JobCall | JobDefinition[..., Any]]) -> Batch:
        added = (*self.callbacks.get(kind, ()), *map(_call, calls))
        return dataclasses.replace(self, callbacks={**self.callbacks, kind: added})

    def then(self, *calls: JobCall | JobDefinition[..., Any]) -> Batch:
        """Return this batch with jobs to enqueue once every member succeeded (see ``allow_failures``)."""
        return self._with("then", calls)

    def on_failure(self, *calls: JobCall | JobDefinition[..., Any]) -> Batch:
        """Return this batch with jobs to enqueue when a member first fails for good."""
        return self._with("on_failure", calls)

    def on_finish(self, *calls: JobCall | JobDefinition[..., Any]) -> Batch:
        """Return this batch with jobs to enqueue once every member ended, whichever way."""
        return self._with("on_finish", calls)

    def enqueue(self, *, batch_size: int = 1000) -> BatchHandle:
        """Store the batch and its members in one transaction (the caller's, if open); return its handle.
        A unique member whose key is held is not stored and not counted."""
        prepared = [_prepared(member) for member in self.members]
        steps = {kind: [step(call) for call in calls] for kind, calls in self.callbacks.items() if calls}
        for kind_steps in steps.values():
            for callback in kind_steps:
                check_queue(callback["name"], callback.get("queue"))
        with transaction.atomic(using=alias(), savepoint=False):
            row = JobBatch(
                name=self.name[:200],
                allow_failures=self.allow_failures,
                callbacks=json.dumps(steps, separators=(",", ":")) if steps else "",
                created_at=DbNow(),
            )
            row.save(force_insert=True, using=alias())
            read_back(row, "created_at")
            stored = _insert_members(row.pk, prepared, batch_size)
            added = sum(1 for job in stored if isinstance(job, Job))
            if added:
                JobBatch.objects.filter(pk=row.pk).update(total=added, pending=added)
            else:
                lifecycle.finish_batch(row, cancelled=False)
            row.refresh_from_db()
        logger.info("enqueued batch id=%s name=%s members=%s", row.pk, row.name or "-", added)
        return BatchHandle(row)


def batch(*members: JobCall | Chain | JobDefinition[..., Any], name: str = "", allow_failures: bool = False) -> Batch:
    """Return a batch of job calls or chains (``allow_failures``: ``then`` runs even if members failed)."""
    return Batch(tuple(_member(item) for item in members), name=name, allow_failures=allow_failures)


def _prepared(member: JobCall | Chain) -> Prepared:
    return member.prepared() if isinstance(member, Chain) else prepare(member)


def _insert_members(batch_id: int, prepared: Sequence[Prepared], batch_size: int) -> list[Any]:
    return store_all([(new._replace(batch_id=batch_id), window) for new, window in prepared], batch_size=batch_size)


class BatchHandle:
    """A batch as last read: counts, state and times; ``refresh()`` reads it again."""

    def __init__(self, row: JobBatch) -> None:
        self._row = row

    def __repr__(self) -> str:
        return f"<BatchHandle id={self.id} state={self.state} {self.done}/{self.total}>"

    id = property(lambda self: self._row.pk)
    name = property(lambda self: self._row.name)
    total = property(lambda self: self._row.total)
    pending = property(lambda self: self._row.pending)
    failed = property(lambda self: self._row.failed)
    cancelled = property(lambda self: self._row.cancelled)
    succeeded = property(lambda self: self._row.succeeded)
    done = property(lambda self: self._row.done)
    percent = property(lambda self: self._row.percent)
    state = property(lambda self: self._row.state)
    allow_failures = property(lambda self: self._row.allow_failures)

    @property
    def created_at(self) -> datetime:
        return self._row.created_at

    @property
    def finished_at(self) -> datetime | None:
        return self._row.finished_at

    @property
    def cancelled_at(self) -> datetime | None:
        return self._row.cancelled_at

    @property
    def finished(self) -> bool:
        """Every member ended (a reopened batch is not finished until its retried members end)."""
        return self._row.finished_at is not None

    @property
    def is_cancelled(self) -> bool:
        return self._row.cancelled_at is not None

    @property
    def progress_key(self) -> str:
        """The key of the batch's progress: ``batch:<id>``."""
        return f"batch:{self.id}"

    def refresh(self) -> BatchHandle:
        self._row.refresh_from_db()
        return self

    def cancel(self) -> int:
        """Cancel the batch (see ``cancel``); return how many waiting members were deleted."""
        count = cancel(self.id)
        self.refresh()
        return count

    def add(self, *members: JobCall | Chain | JobDefinition[..., Any], batch_size: int = 1000) -> list[Handle]:
        """Add members (see ``add``); return their handles."""
        handles = add(self.id, members, batch_size=batch_size)
        self.refresh()
        return handles

    def retry_failed(self) -> list[Job]:
        """Retry the batch's failed members; return the new job rows."""
        jobs = retry_failed(self.id)
        self.refresh()
        return jobs

    def wait(self, timeout: float | timedelta | None = None) -> BatchHandle:
        """Block until every member has ended (``finished``) and return this handle, read again;
        after ``timeout`` seconds raise ``BatchWaitTimeout`` (a ``WaitTimeout``) and leave the batch
        alone. As ``JobHandle.wait``: read with backoff (10 ms, doubling to 0.5 s), woken on
        PostgreSQL by the batch's end; inside a job, only with a timeout (docs/batches.md)."""
        seconds = self._checked_timeout(timeout)
        wait_until(self._read_finished, self._timed_out, seconds, channel=_batch_channel, ids=self._ids)
        return self

    async def wait_async(self, timeout: float | timedelta | None = None) -> BatchHandle:
        """``wait`` for async code: ``await batch.wait_async(timeout=60)``; the event loop runs on."""
        seconds = await sync_to_async(self._checked_timeout)(timeout)
        await await_until(sync_to_async(self._read_finished), self._timed_out, seconds)
        return self

    def _read_finished(self) -> bool:
        return self.refresh().finished

    def _ids(self) -> set[int | None]:
        return {self.id}

    def _checked_timeout(self, timeout: float | timedelta | None) -> float | None:
        """``timeout`` in seconds; refuse the waits that cannot end well (may read the running job's row)."""
        seconds = wait_seconds(timeout)
        running = current_job()
        if running is not None and Job.objects.filter(pk=running[0], batch_id=self.id).exists():
            raise RuntimeError(
                f"{running[1]} (job {running[0]}) waits for its own batch {self.id}: the batch cannot finish "
                "while this member runs"
            )
        refuse_endless_wait_in_job(f"batch {self.id}", "the members it waits for", seconds)
        return seconds

    def _timed_out(self, seconds: float) -> BatchWaitTimeout:
        return BatchWaitTimeout(
            f"batch {self.id} ({self.name or 'unnamed'}) is still {self.state} after {seconds:g} s, "
            f"{self.done} of {self.total} members ended; it was left as it is",
            batch_id=self.id,
            status=str(self.state),
        )


def _batch_channel() -> str:
    return lifecycle.BATCH_ENDED_CHANNEL


def get_batch(batch_id: int) -> BatchHandle:
    """The batch with this id; raise ``JobBatch.DoesNotExist`` if there is none (or it was pruned)."""
    return BatchHandle(JobBatch.objects.get(pk=batch_id))


def add(
    batch_id: int, members: Iterable[JobCall | Chain | JobDefinition[..., Any]], *, batch_size: int = 1000
) -> list[Handle]:
    """Add members to a running batch in one transaction (a member may: the batch cannot finish while it
    runs); raise ``BatchClosed`` if it was cancelled or has finished."""
    prepared = [_prepared(_member(item)) for item in members]
    with transaction.atomic(using=alias(), savepoint=False):
        row = JobBatch.objects.select_for_update().filter(pk=batch_id).first()
        if row is None:
            raise JobBatch.DoesNotExist(f"there is no batch {batch_id}")
        if row.cancelled_at is not None or row.finished_at is not None:
            raise BatchClosed(
                f"batch {batch_id} was {'cancelled' if row.cancelled_at else 'finished'}: no members can be added"
            )
        stored = _insert_members(batch_id, prepared, batch_size)
        added = sum(1 for job in stored if isinstance(job, Job))
        if added:
            JobBatch.objects.filter(pk=batch_id).update(total=F("total") + added, pending=F("pending") + added)
    return handles_of(stored)


def cancel(batch_id: int) -> int:
    """Cancel a batch: delete its waiting members (counted ``cancelled``; running ones finish, then
    ``on_finish`` runs, never ``then``); return how many (0 if it was cancelled or finished already)."""
    deleted = lifecycle.cancel_batch(batch_id)
    if deleted is None:
        return 0
    forget_cancelled()
    logger.info("cancelled batch id=%s waiting_members_deleted=%s", batch_id, deleted)
    return deleted


def retry_failed(batch_id: int) -> list[Job]:
    """Retry the failed members of a batch; the batch counts them pending again (``BatchClosed``: cancelled)."""
    if JobBatch.objects.filter(pk=batch_id, cancelled_at__isnull=False).exists():
        raise BatchClosed(f"batch {batch_id} was cancelled: its failed members are not retried into it")
    return lifecycle.retry(FailedJob.objects.filter(batch_id=batch_id))


def prune(hours: float) -> int:
    """Delete batches finished more than ``hours`` ago (their failed members stay); return how many."""
    deleted, _ = JobBatch.objects.filter(finished_at__lt=DbNow() - timedelta(hours=hours)).delete()
    return deleted


# Seconds a worker trusts its read of the cancelled batches: a member claimed before its batch
# was cancelled does not start later than this after the cancel committed.
CANCEL_CHECK = 0.5

_cancelled_lock = threading.Lock()
_cancelled: dict[str, tuple[float, frozenset[int]]] = {}


def cancelled_lately(batch_id: int, using: str | None = None) -> bool:
    """Tell whether batch ``batch_id`` is cancelled and not finished, as read at most ``CANCEL_CHECK`` ago."""
    using = using or alias()
    now = time.monotonic()
    with _cancelled_lock:
        read = _cancelled.get(using)
    if read is None or now - read[0] >= CANCEL_CHECK:
        ids = frozenset(
            JobBatch.objects.using(using)
            .filter(cancelled_at__isnull=False, finished_at__isnull=True)
            .values_list("pk", flat=True)
        )
        read = (now, ids)
        with _cancelled_lock:
            _cancelled[using] = read
    return batch_id in read[1]


def forget_cancelled() -> None:
    """Read the cancelled batches afresh at the next ``cancelled_lately`` (tests, ``cancel``)."""
    with _cancelled_lock:
        _cancelled.clear()
