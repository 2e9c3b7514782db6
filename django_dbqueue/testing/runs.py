"""Running enqueued jobs in a test through the worker's own loop, and immediate mode (``testing``)."""

from __future__ import annotations

import dataclasses
import functools
import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, nullcontext
from typing import Any, Literal

from django.db import connections, transaction

from .. import conf, enqueue, lifecycle, progress, signals
from ..db import alias
from ..execution import Defaults
from ..models import DB_NOW, FailedJob, Job
from ..states import RunStatus
from ..worker import Worker, WorkerOptions
from .enqueued import Target, call_of, call_text, target_name

logger = logging.getLogger("django_dbqueue")

Backoff = Literal["skip", "honour"]

# The heartbeat's interval inside a test's transaction: its thread's connection cannot see the
# rows (or, on SQLite, would wait for the test's write lock), so it never extends them.
_NEVER = 1e9
# Seconds added to a wait for a delayed job (the database clock's resolution on SQLite: ms).
_WAIT_MARGIN = 0.01


@dataclasses.dataclass(frozen=True)
class RanJob:
    """One run of a job by ``run_jobs``, and how it ended (``outcome``: succeeded, released, failed)."""

    id: int
    name: str  # the registered name; a django.tasks task's own path
    queue: str
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    outcome: RunStatus
    attempt: int  # reservations of the job so far, this one included
    result: Any = None
    exception: BaseException | None = None
    error: str = ""  # a failure's stored error (the traceback); a release's exception
    delay: float = 0  # a release's: seconds until it may run again (its backoff, a snooze)

    @property
    def succeeded(self) -> bool:
        return self.outcome == "succeeded"

    @property
    def failed(self) -> bool:
        return self.outcome == "failed"

    @property
    def released(self) -> bool:
        return self.outcome == "released"

    def __str__(self) -> str:
        return f"{call_text(self.name, self.args, self.kwargs)} (job {self.id}, attempt {self.attempt}): {self.outcome}"


class Ran(list[RanJob]):
    """The runs of one ``run_jobs``, in the order they ended."""

    @property
    def succeeded(self) -> list[RanJob]:
        return [run for run in self if run.succeeded]

    @property
    def failed(self) -> list[RanJob]:
        return [run for run in self if run.failed]

    @property
    def released(self) -> list[RanJob]:
        return [run for run in self if run.released]

    def names(self) -> list[str]:
        """The job names, in the order the runs ended (a retried job once per run)."""
        return [run.name for run in self]

    def of(self, target: Target) -> list[RanJob]:
        """The runs of one job (definition, name or task)."""
        name = target_name(target)
        return [run for run in self if run.name == name]

    def assert_succeeded(self) -> None:
        """Raise ``AssertionError`` naming each run that did not succeed, with its error's last line."""
        bad = [run for run in self if not run.succeeded]
        if bad:
            lines = [f"  {run}: {_last_line(run.error)}" for run in bad]
            raise AssertionError(f"{len(bad)} of {len(self)} run(s) did not succeed:\n" + "\n".join(lines))


# -- running jobs ------------------------------------------------------------------


def run_jobs(
    queue: str | Sequence[str] | None = None,
    *,
    backoff: Backoff = "skip",
    delayed: bool = False,
    max_jobs: int | None = 1000,
    max_seconds: float = 60,
) -> Ran:
    """Run the jobs of ``queue`` (a name, a list in priority order; None: every queue that holds
    jobs) as ``queue_work --stop-when-empty`` would, until none is left to run; return the runs.

    ``backoff="skip"`` runs a released job again at once (a retry, a snooze), ``"honour"`` waits
    for it (real time: keep test backoffs short); ``delayed`` also runs jobs enqueued with a delay
    at once. What the runs enqueue (chain steps, callbacks, batch callbacks) runs too. Raises
    ``RuntimeError`` if jobs still wait after ``max_jobs`` runs or ``max_seconds``.
    """
    if backoff not in ("skip", "honour"):
        raise ValueError(f"run_jobs(backoff=...) must be 'skip' or 'honour', not {backoff!r}")
    queues = [queue] if isinstance(queue, str) else list(queue) if queue is not None else None
    ran = Ran()
    deadline = time.monotonic() + max_seconds
    outer = _local.pending is None
    if outer:
        _local.pending = set()  # what immediate mode enqueues meanwhile runs here
    try:
        while True:
            served = _queues_to_serve(queues)
            before = len(ran)
            if served:
                _run_worker(served, ran, deadline, None if max_jobs is None else max_jobs - len(ran))
            over = max_jobs is not None and len(ran) >= max_jobs
            if (over or time.monotonic() >= deadline) and _waiting(served):
                limit = f"max_jobs={max_jobs} runs" if over else f"max_seconds={max_seconds:g}"
                raise RuntimeError(f"run_jobs stopped after {limit}, with jobs still waiting in {served}")
            if len(ran) == before and not _next_delayed(served, backoff, delayed, deadline):
                return ran
    finally:
        if outer:
            _local.pending = None


drain = run_jobs


class _Local(threading.local):
    # The queues immediate mode enqueued into while ``run_jobs`` runs (None: it does not).
    pending: set[str] | None = None


_local = _Local()


def _queues_to_serve(queues: list[str] | None) -> list[str]:
    """``queues`` (None: those that hold jobs nobody holds), then those enqueued into meanwhile."""
    pending = _local.pending or set()
    if _local.pending is not None:
        _local.pending = set()
    if queues is not None:
        return [*queues, *sorted(pending - set(queues))]
    held = Job.objects.using(alias()).filter(reserved_at__isnull=True).order_by().values_list("queue", flat=True)
    return sorted(set(held.distinct()) | pending)


def _waiting(queues: list[str]) -> bool:
    return Job.objects.using(alias()).waiting().filter(queue__in=queues).exists()


def _defaults() -> Defaults:
    """The worker's defaults, from ``DBQUEUE`` (as ``queue_work`` without options)."""
    settings = conf.get_settings()
    return Defaults(
        tries=settings["TRIES"],
        timeout=settings["TIMEOUT"] or None,
        backoff=settings["BACKOFF"],
        timeout_grace=settings["TIMEOUT_GRACE"],
    )


def _run_worker(queues: list[str], ran: Ran, deadline: float, max_jobs: int | None) -> None:
    """One ``Worker.run`` over ``queues`` until they are empty, recording each outcome in ``ran``."""
    options = WorkerOptions(
        queues=queues,
        defaults=_defaults(),
        sleep=0,
        stop_when_empty=True,
        batch=1,  # each outcome is stored before the next claim: the order a test reads
        max_jobs=max_jobs,
        max_time=max(0.0, deadline - time.monotonic()),
        schedule=False,
    )
    worker = Worker(options)
    connection = connections[alias()]
    in_test_transaction = connection.in_atomic_block
    if in_test_transaction:
        # Its thread's connection cannot see this transaction's rows: no row refresh, no extension.
        worker.heartbeat.queues = None
        worker.heartbeat.interval = _NEVER
        run = worker.executor.collect
        setattr(worker.executor, "collect", lambda: _in_savepoint(connection, run))  # noqa: B010
    captured = len(connection.run_on_commit)
    with _recording(worker.worker_id, ran), _progress_here() if in_test_transaction else nullcontext():
        worker.run()
    if in_test_transaction:
        _run_on_commit(connection, captured)


class _Unusable(Exception):
    """Rolls a run back to its savepoint: a query of the job failed and left the transaction unusable."""


def _in_savepoint(connection: Any, run: Callable[[], list[Any]]) -> list[Any]:
    """Run a job inside a savepoint of the test's transaction, rolled back only if a failed query of
    the job left the transaction unusable (PostgreSQL), so that the outcome can still be stored."""
    finished: list[Any] = []
    block = transaction.atomic(using=connection.alias)
    setattr(block, "_from_testcase", True)  # noqa: B010 - as the TestCase's own: a job's durable atomic() may open
    try:
        with block:
            finished = run()
            if connection.needs_rollback or _failed_transaction(connection):
                raise _Unusable
    except _Unusable:
        logger.info("a job's query failed in the test's transaction: its writes were rolled back")
    return finished


def _failed_transaction(connection: Any) -> bool:
    """Tell whether PostgreSQL refuses every statement until a rollback (psycopg 2 and 3: INERROR, 3)."""
    if connection.vendor != "postgresql" or connection.connection is None:
        return False
    return int(connection.connection.info.transaction_status) == 3


@contextmanager
def _progress_here() -> Iterator[None]:
    """Write progress through the test's connection: the worker's own progress connection would not
    see the test's rows (and on SQLite would wait for its write lock)."""
    writer = progress._writer
    setattr(progress, "_writer", lambda: connections[alias()])  # noqa: B010
    try:
        yield
    finally:
        setattr(progress, "_writer", writer)  # noqa: B010


@contextmanager
def _recording(worker_id: str, ran: Ran) -> Iterator[None]:
    """Append to ``ran`` each outcome that ``worker_id`` reports while inside."""

    def receiver(outcome: RunStatus) -> Callable[..., None]:
        def record(sender: Any, job: Job, **kwargs: Any) -> None:
            if kwargs.get("worker_id") == worker_id:
                ran.append(_ran_job(job, outcome, kwargs))

        return record

    receivers = [
        (signals.job_succeeded, receiver("succeeded")),
        (signals.job_released, receiver("released")),
        (signals.job_failed, receiver("failed")),
    ]
    for signal, record in receivers:
        signal.connect(record, weak=False)
    try:
        yield
    finally:
        for signal, record in receivers:
            signal.disconnect(record)


def _ran_job(job: Job, outcome: RunStatus, sent: dict[str, Any]) -> RanJob:
    name, args, kwargs = call_of(job)
    exception = sent.get("exception")
    failed_job: FailedJob | None = sent.get("failed_job")
    if failed_job is not None:
        error = failed_job.error
    elif exception is not None:
        error = f"{type(exception).__qualname__}: {exception}"
    else:
        error = ""
    return RanJob(
        id=job.pk,
        name=name,
        queue=job.queue,
        args=args,
        kwargs=kwargs,
        outcome=outcome,
        attempt=job.attempts,
        result=sent.get("result"),
        exception=exception,
        error=error,
        delay=float(sent.get("delay") or 0),
    )


def _run_on_commit(connection: Any, start: int) -> None:
    """Run the ``transaction.on_commit`` callbacks registered since ``start`` (they never fire in
    a ``TestCase``), as ``captureOnCommitCallbacks(execute=True)`` does, and forget them."""
    while len(connection.run_on_commit) > start:
        callbacks = connection.run_on_commit[start:]
        del connection.run_on_commit[start:]
        for _, callback, robust in callbacks:
            if not robust:
                callback()
                continue
            try:
                callback()
            except Exception:  # robust: logged, as Django's own commit does
                logger.exception("on_commit callback %r raised", callback)


def _next_delayed(queues: list[str], backoff: Backoff, delayed: bool, deadline: float) -> bool:
    """Make the delayed jobs of ``queues`` that the options run now runnable (``backoff="honour"``:
    wait for the next released one); tell whether any became runnable."""
    rows = Job.objects.using(alias()).delayed().filter(queue__in=queues)
    made = lifecycle.run_now(rows.filter(attempts__gt=0)) if backoff == "skip" else 0
    if delayed:
        made += lifecycle.run_now(rows.filter(attempts=0))
    if made or backoff != "honour":
        return bool(made)
    released = rows.filter(attempts__gt=0).order_by("available_at").only("name", "available_at")
    first = released.annotate(**DB_NOW).first()
    if first is None:
        return False
    name, pk = first.name, first.pk
    seconds = (first.available_at - first.db_now).total_seconds() + _WAIT_MARGIN
    if time.monotonic() + seconds > deadline:
        raise RuntimeError(
            f"run_jobs(backoff='honour'): {name} (job {pk}) runs again in {seconds:.1f} s, "
            "past max_seconds; shorten its backoff in the test, or pass backoff='skip'"
        )
    time.sleep(max(0.0, seconds))
    return True


# -- immediate mode (DBQUEUE["IMMEDIATE"]) ------------------------------------------


def run_immediately(queues: set[str]) -> None:
    """``enqueue``'s immediate mode: run the jobs just stored once their enqueue commits (now, if
    no transaction but a ``TestCase``'s is open), with ``run_jobs``; while ``run_jobs`` runs, the
    jobs it runs enqueue are left to it."""
    if _local.pending is not None:
        _local.pending.update(queues)
        return
    if _in_own_transaction():
        transaction.on_commit(functools.partial(_run_now, queues), using=alias())
    else:
        _run_now(queues)


def _run_now(queues: set[str]) -> None:
    if _local.pending is not None:
        _local.pending.update(queues)
        return
    # Every queue: what the jobs enqueue in their outcome (chain steps, callbacks) may go elsewhere.
    run_jobs()


def _in_own_transaction() -> bool:
    """Tell whether a transaction of the project's is open (not one a ``TestCase`` opened)."""
    connection = connections[alias()]
    return connection.in_atomic_block and not all(
        getattr(block, "_from_testcase", False) for block in connection.atomic_blocks
    )


enqueue.run_stored_with(run_immediately)


def _last_line(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[-1].strip() if lines else "(no error)"
