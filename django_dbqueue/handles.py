"""Job handles: what ``enqueue`` returns, and what any process can look up by a job's id.

A status is read from where the job is: its row, its ``FailedJob`` row, or once the row is gone
its record in the result store (``TaskResultRecord``, shared with the ``django.tasks`` backend);
without a record the job succeeded (rows are deleted then). A retry's record points to the new
id, so a handle follows its job through retries (docs/howto/handles.md).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from datetime import timedelta
from typing import TYPE_CHECKING, Any, cast

from asgiref.sync import sync_to_async

from . import conf, lifecycle, payload, registry
from .db import DbNow, IdListener, alias, notify_ids
from .exceptions import PayloadTooLarge, WaitTimeout
from .models import CANCELLED_CLASS, JOB_RECORDS, RETRIED, FailedJob, Job, TaskResultRecord, record_id
from .running import current_job
from .states import JobStatus

if TYPE_CHECKING:
    from .insert import Row

# A handle follows at most this many retries from FailedJob.
MAX_RETRIES_FOLLOWED = 100
# ``wait`` reads the job again after this many seconds, doubling up to the last: a short job is
# seen finished within about 10 ms, a long one costs a read per half second.
WAIT_FIRST, WAIT_LONGEST = 0.01, 0.5
# Where the end of a job that keeps its result is announced (PostgreSQL), for ``wait``.
ENDED_CHANNEL = "dbqueue_ended"


@dataclasses.dataclass(eq=False)
class JobHandle:
    """A job as its caller follows it: its status now, and its result once kept.

    ``id``: the id enqueued; ``job_id``: the row that runs it now (another after a retry).
    ``result``, ``errors`` and ``finished_at`` are filled when the job keeps its result.
    ``enqueued`` False: an enqueue whose unique key or window another job held, whose handle this is.
    """

    id: int
    name: str = ""
    queue: str = ""
    status: JobStatus = JobStatus.WAITING
    job_id: int | None = None
    errors: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    finished_at: Any = None
    _job: Job | None = dataclasses.field(default=None, repr=False)
    _result: Any = dataclasses.field(default=None, repr=False)
    enqueued: bool = True
    # Builds ``job`` when first asked for (a bulk enqueue's handles: most are never asked).
    _make_job: Callable[[], Job] | None = dataclasses.field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self.job_id is None:
            self.job_id = self.id

    @property
    def job(self) -> Job | None:
        """The row as enqueued, on a handle an enqueue returned; else None."""
        if self._job is None and self._make_job is not None:
            self._job = self._make_job()
            self._make_job = None
        return self._job

    @property
    def pk(self) -> int:
        return self.id

    @property
    def finished(self) -> bool:
        return self.status.finished

    @property
    def result(self) -> Any:
        """The kept return value, decoded (a model instance only if the return annotation names its model)."""
        if self._result is None:
            return None
        definition = registry.find(self.name) if self.name else None
        # Stored with the arguments' encoder: tags for dates, decimals, model references.
        envelope = payload.decode(json.dumps({"args": [self._result], "kwargs": {}}))
        return payload.arguments(envelope, definition.func if definition else None, result=True)[0][0]

    @classmethod
    def from_job(cls, job: Job) -> JobHandle:
        """The handle of a row just enqueued."""
        delayed = job.available_at > job.created_at
        return cls(job.pk, job.name, job.queue, JobStatus.DELAYED if delayed else JobStatus.WAITING, _job=job)

    @classmethod
    def from_row(cls, row: Row) -> JobHandle:
        """The handle of a row a bulk enqueue inserted; its ``job`` is built if asked for."""
        status = JobStatus.DELAYED if row.available_at > row.created_at else JobStatus.WAITING
        return cls(row.pk, row.new.name, row.new.queue, status, _make_job=row.job)

    @classmethod
    def not_enqueued(cls, job_ids: Sequence[int | None]) -> list[JobHandle]:
        """The handles of the jobs that hold duplicate enqueues' keys, ``enqueued`` False (one query for rows)."""
        wanted = {pk for pk in job_ids if pk is not None}
        rows = {
            row["pk"]: row
            for row in Job.objects.filter(pk__in=wanted)
            .annotate(clock=DbNow())
            .values("pk", "name", "queue", "reserved_at", "available_at", "clock")
        }
        handles = []
        for pk in job_ids:
            # None only for a window opened by enqueue_many on plain MySQL, which returns no ids.
            handle = cls(id=cast(int, pk), enqueued=False)
            if pk in rows:
                handle._read_row(rows[pk])
            elif pk is not None:
                handle.refresh()
            handles.append(handle)
        return handles

    @classmethod
    def get(cls, job_id: int) -> JobHandle:
        """Return the handle of the job enqueued with ``job_id``, from any process."""
        handle = cls(id=int(job_id))
        handle.refresh()
        return handle

    @classmethod
    async def aget(cls, job_id: int) -> JobHandle:
        """Return the handle of the job enqueued with ``job_id``: the async form of ``get``."""
        handle: JobHandle = await sync_to_async(cls.get)(job_id)
        return handle

    def refresh(self) -> None:
        """Read the job's status (and kept result) again."""
        current = self.id
        for _ in range(MAX_RETRIES_FOLLOWED):
            self.job_id = current
            row = (
                Job.objects.filter(pk=current)
                .annotate(clock=DbNow())
                .values("name", "queue", "reserved_at", "available_at", "clock")
                .first()
            )
            if row is not None:
                self._read_row(row)
                return
            failed = (
                FailedJob.objects.filter(job_id=current)
                .order_by("-id")
                .values("name", "queue", "failed_at", "exception_class")
                .first()
            )
            record = TaskResultRecord.objects.filter(pk=record_id(current)).first()
            if record is not None and record.status == RETRIED and record.job_id is not None and failed is None:
                current = record.job_id
                continue
            if record is not None:
                self.name, self.queue = record.task_path, record.queue
                self.errors = list(record.errors)
                self.finished_at = record.finished_at
                self._result = record.return_value
            if failed is not None:
                self.name, self.queue = failed["name"], failed["queue"]
                cancelled = failed["exception_class"] == CANCELLED_CLASS
                self.status = JobStatus.CANCELLED if cancelled else JobStatus.FAILED
                self.finished_at = failed["failed_at"]
            elif record is not None and record.status == JobStatus.FAILED:
                self.status = JobStatus.FAILED
            else:
                # The row is gone without failing: deleted when it succeeded.
                self.status = JobStatus.SUCCEEDED
            return

    def _read_row(self, row: Mapping[str, Any]) -> None:
        """Take name, queue and status from the job's row (read with the database's clock)."""
        self.name, self.queue = row["name"], row["queue"]
        if row["reserved_at"] is not None:
            self.status = JobStatus.RUNNING
        elif row["available_at"] > row["clock"]:
            self.status = JobStatus.DELAYED
        else:
            self.status = JobStatus.WAITING

    async def arefresh(self) -> None:
        await sync_to_async(self.refresh)()

    def wait(self, timeout: float | timedelta | None = None) -> JobHandle:
        """Block until the job has finished (succeeded, failed or cancelled) and return this handle,
        read again: ``handle.wait(timeout=30).result``. After ``timeout`` seconds raise
        ``WaitTimeout`` and leave the job alone. The job is read with backoff (10 ms, doubling to
        0.5 s). Inside a job, a wait needs a timeout: the job it waits for may need this worker's
        slot (docs/howto/handles.md)."""
        seconds = self._checked_timeout(timeout)
        wait_until(self._read_finished, self._timed_out, seconds, channel=self._channel, ids=self._ids)
        return self

    async def wait_async(self, timeout: float | timedelta | None = None) -> JobHandle:
        """``wait`` for async code: ``await handle.wait_async(timeout=30)``; the event loop runs on
        between reads."""
        seconds = self._checked_timeout(timeout)
        await await_until(sync_to_async(self._read_finished), self._timed_out, seconds)
        return self

    def _read_finished(self) -> bool:
        self.refresh()
        return self.finished

    def _channel(self) -> str | None:
        # Its end is announced only if it keeps its result, which is known once it was read.
        return ENDED_CHANNEL if keeps_result(self.name) else None

    def _ids(self) -> set[int | None]:
        return {self.id, self.job_id}

    def _checked_timeout(self, timeout: float | timedelta | None) -> float | None:
        """``timeout`` in seconds; refuse the waits that cannot end well."""
        seconds = wait_seconds(timeout)
        running = current_job()
        if running is not None and running[0] in (self.id, self.job_id):
            raise RuntimeError(f"job {self.id} ({running[1]}) waits for itself: it would never finish")
        refuse_endless_wait_in_job(f"job {self.id}", "the job it waits for", seconds)
        return seconds

    def _timed_out(self, seconds: float) -> WaitTimeout:
        return WaitTimeout(
            f"job {self.id} ({self.name or 'unknown'}) is still {self.status} after {seconds:g} s; "
            "it was left as it is",
            job_id=self.id,
            status=str(self.status),
        )

    def cancel(self, *, hard: bool = False, reason: str = "") -> bool:
        """Cancel the job, or ask it to stop if it runs (``hard``: as at a timeout); False if it had finished."""
        self.refresh()
        if self.finished or self.job_id is None:
            return False
        outcome = lifecycle.cancel(self.job_id, hard=hard, reason=reason)
        self.refresh()
        return outcome != "missing"

    async def acancel(self, *, hard: bool = False, reason: str = "") -> bool:
        cancelled: bool = await sync_to_async(self.cancel)(hard=hard, reason=reason)
        return cancelled


# -- waiting for an end: jobs here, batches (batches.py) ----------------------------


def wait_seconds(timeout: float | timedelta | None) -> float | None:
    """``timeout`` in seconds (None: no end); ValueError unless it is 0 or more."""
    if isinstance(timeout, timedelta):
        timeout = timeout.total_seconds()
    if timeout is not None and not timeout >= 0:
        raise ValueError(f"timeout must be seconds (0 or more), or None to wait without end; got {timeout!r}")
    return timeout


def refuse_endless_wait_in_job(waited: str, needed: str, seconds: float | None) -> None:
    """Raise RuntimeError if the running job (``running.current_job``) waits for ``waited`` without a timeout."""
    running = current_job()
    if running is not None and seconds is None:
        raise RuntimeError(
            f"{running[1]} (job {running[0]}) waits for {waited} without a timeout: {needed} may need the "
            "slot this job holds, and then neither ends. Pass a timeout, or enqueue the next step as a chain, "
            "a batch callback or a job of its own."
        )


def wait_until(
    finished: Callable[[], bool],
    timed_out: Callable[[float], Exception],
    seconds: float | None,
    *,
    channel: Callable[[], str | None],
    ids: Callable[[], set[int | None]],
) -> None:
    """Call ``finished`` (it reads again) until it is True, with backoff (``WAIT_FIRST`` doubling
    to ``WAIT_LONGEST``), or sooner once one of ``ids`` is announced on the ``channel`` it names
    (PostgreSQL, ``DBQUEUE["LISTEN"]``); after ``seconds`` raise ``timed_out(seconds)``."""
    deadline = None if seconds is None else time.monotonic() + seconds
    pause = WAIT_FIRST
    listener: IdListener | None = None
    try:
        while True:
            if finished():
                return
            name = channel() if listener is None and conf.get("LISTEN") else None
            if name is not None:
                # Listen, then read once more (it may have ended meanwhile).
                listener = IdListener(conf.get("LISTEN_DATABASE") or alias(), name)
                if listener.open():
                    continue
            pause = _next_pause(deadline, pause, seconds, timed_out)
            _pause(listener, pause, ids)
    finally:
        if listener is not None:
            listener.close()


async def await_until(
    finished: Callable[[], Awaitable[bool]], timed_out: Callable[[float], Exception], seconds: float | None
) -> None:
    """``wait_until`` for async code: the event loop runs on between reads (it polls)."""
    deadline = None if seconds is None else time.monotonic() + seconds
    pause = WAIT_FIRST
    while not await finished():
        pause = _next_pause(deadline, pause, seconds, timed_out)
        await asyncio.sleep(pause)


def _pause(listener: IdListener | None, seconds: float, ids: Callable[[], set[int | None]]) -> None:
    """Sleep ``seconds``, or less if one of ``ids`` is announced meanwhile."""
    end = time.monotonic() + seconds
    while (left := end - time.monotonic()) > 0:
        if listener is None or listener.connection is None:
            time.sleep(left)
            return
        if ids() & listener.wait(left):
            return


def _next_pause(
    deadline: float | None, pause: float, seconds: float | None, timed_out: Callable[[float], Exception]
) -> float:
    """The pause before the next read, within ``deadline``; raise ``timed_out`` once it passed."""
    if deadline is None or seconds is None:
        return min(pause * 2, WAIT_LONGEST)
    left = deadline - time.monotonic()
    if left <= 0:
        raise timed_out(seconds)
    return min(pause * 2, WAIT_LONGEST, left)


get_job = JobHandle.get
aget_job = JobHandle.aget


def encode_result(value: Any) -> tuple[Any, str | None]:
    """The JSON data a job's return value is kept as, and None; or None and why it cannot be."""
    try:
        return payload.encode_arguments((value,), {})["args"][0], None
    except TypeError as exc:
        return None, f"the return value was not kept: {exc}".replace("argument 0 (args[0])", "the return value")


def result_refusal(job: Job, value: Any) -> PayloadTooLarge | None:
    """The error of a return value of ``job`` too large to keep: its JSON is over
    ``DBQUEUE["MAX_PAYLOAD_SIZE"]``, the limit of what a result may be passed on as; else None."""
    limit = conf.get("MAX_PAYLOAD_SIZE")
    # Short for sure, no encoding to measure: a number, or text of 6 bytes a character at most (\u escapes).
    if (
        limit is None
        or isinstance(value, (bool, int, float))
        or (isinstance(value, str) and len(value) * 6 + 2 <= limit)
    ):
        return None
    encoded, _ = encode_result(value)
    if encoded is None:
        return None  # it cannot be kept at all: its record says so (``outcome_record``)
    found = payload.size(json.dumps(encoded, separators=(",", ":"), ensure_ascii=False))
    if found <= limit:
        return None
    return PayloadTooLarge(
        f"the return value of {job.name} (job {job.pk}) is {found:,} bytes as JSON, over "
        f"DBQUEUE['MAX_PAYLOAD_SIZE'] ({limit:,} bytes), so it cannot be kept as its result. Return a "
        "reference (a model instance, a file path) instead of the data, or raise the limit.",
        name=job.name,
        size=found,
        limit=limit,
    )


# The job that runs django.tasks tasks keeps its result in the task's own record.
TASKS_JOB = "django_dbqueue.run_task"


# In the envelope of a job whose result another job reads (a workflow node's parent): kept whatever its options say.
KEEP_RESULT = "keep_result"
_KEEP_RESULT_TEXT = f'"{KEEP_RESULT}":true'


def keeps_result(name: str, envelope_text: str = "") -> bool:
    """Whether jobs named ``name`` keep their results: the job's ``results`` option, else
    ``DBQUEUE["RESULTS"]``; always if its envelope (``envelope_text``) asks for it."""
    if name == TASKS_JOB:
        return False
    if _KEEP_RESULT_TEXT in envelope_text:
        return True
    definition = registry.find(name)
    chosen = definition.results if definition is not None else None
    return bool(conf.get("RESULTS") if chosen is None else chosen)


def outcome_record(
    job: Job,
    *,
    status: str,
    worker_id: str,
    result: Any = None,
    error: str = "",
    exception_class: str = "",
) -> TaskResultRecord:
    """The result store's row for ``job`` after this attempt (``status`` waiting: it runs again), to save."""
    # Only an earlier attempt of this row can have written its record.
    earlier = TaskResultRecord.objects.filter(pk=record_id(job.pk)).first() if job.attempts > 1 else None
    record = earlier or TaskResultRecord(
        id=record_id(job.pk),
        task_path=job.name,
        backend=JOB_RECORDS,
        queue=job.queue,
        priority=job.priority,
        enqueued_at=job.created_at,
        job_id=job.pk,
    )
    record.status = status
    record.worker_ids = [*record.worker_ids, worker_id]
    record.last_attempted_at = DbNow()
    notes = [(error, exception_class)]
    if status == JobStatus.SUCCEEDED:
        record.return_value, note = encode_result(result)
        notes.append((note or "", "TypeError"))
    added = [{"attempt": job.attempts, "exception_class": kind, "traceback": text} for text, kind in notes if text]
    record.errors = [*record.errors, *added]

    if status in (JobStatus.SUCCEEDED, JobStatus.FAILED):
        record.finished_at = DbNow()
    return record


def save_records(records: Sequence[TaskResultRecord], using: str) -> None:
    """Save the result store's rows after an attempt, in the outcome's transaction, and announce
    the jobs they finish to ``JobHandle.wait`` (PostgreSQL: one NOTIFY, sent at commit)."""
    for record in records:
        record.save(using=using, force_insert=record._state.adding)
    notify_ids(
        using, ENDED_CHANNEL, [record.job_id for record in records if record.finished_at is not None and record.job_id]
    )


def prune_results(hours: float) -> int:
    """Delete kept results (of jobs and of django.tasks tasks) finished more than ``hours`` ago; return how many."""
    deleted, _ = TaskResultRecord.objects.filter(finished_at__lt=DbNow() - timedelta(hours=hours)).delete()
    return deleted
