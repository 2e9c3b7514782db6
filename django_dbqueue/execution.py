"""Run one reserved job and decide its outcome. Writes nothing to the queue."""

from __future__ import annotations

import asyncio
import dataclasses
import faulthandler
import functools
import inspect
import logging
import math
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import UTC, datetime, timedelta
from types import MappingProxyType
from typing import Any, Literal

from asgiref.sync import async_to_sync
from django.db import DatabaseError
from django.utils import timezone

from . import middleware, payload, registry, tracing
from .context import JobContext
from .errors import clean
from .exceptions import PERMANENT_ERRORS, JobCancelled, JobTimeout, PayloadError, Snooze, WorkerStopped
from .models import Job
from .progress import Tracker
from .registry import Backoff, JobDefinition
from .rows import chain_of

logger = logging.getLogger("django_dbqueue")

Status = Literal["succeeded", "released", "failed"]


@dataclasses.dataclass(frozen=True)
class Defaults:
    """Options for jobs that set none: the worker's command line, then settings."""

    tries: int
    timeout: int | None
    backoff: Backoff
    timeout_grace: float = 5


@dataclasses.dataclass
class Outcome:
    status: Status
    duration: float
    result: Any = None
    exception: BaseException | None = None
    error: str = ""
    delay: float = 0
    tracker: Tracker | None = None
    # A release that spends no try: the job snoozed, or its database connection broke under it.
    given_back: bool = False
    # A release after the job raised: it counts towards the job's max_exceptions.
    counts_exception: bool = False

    @property
    def snoozed(self) -> bool:
        """Tell whether the job put itself back with ``Snooze``."""
        return isinstance(self.exception, Snooze)

    @property
    def exception_class(self) -> str:
        if self.exception is None:
            return ""
        cls = type(self.exception)
        return f"{cls.__module__}.{cls.__qualname__}"


class JobTimer:
    """The one-job worker's watch over the job that runs in its main thread.

    Nothing is ever raised into the job's code: an exception raised there at an
    arbitrary point (inside a query, between a library's ``lock.acquire()`` and its
    ``try``) would leave a broken connection or a held lock to every later job of
    the process. At the job's timeout, or when ``ask_to_stop`` names it (a hard
    cancel, a second stop signal), the job is asked to stop: its context's
    ``cancel_requested`` turns true, and ``check_cancelled()`` or ``progress()``
    end it with that reason. A job still running ``grace`` seconds later is handed
    to ``on_stuck(prepared, reason)`` in the timer's own thread, which records it
    and ends the process (the worker's ``_end_stuck_job``); the main thread never
    comes back from that job. Code that keeps the interpreter itself from running
    (C code holding the GIL) stops that thread too: then faulthandler's C thread
    ends the process ``LAST_RESORT_SLACK`` seconds later, and the job is reclaimed.

    A worker enters one timer for its life. Each job costs a lock and a few
    assignments: the thread is woken only when a deadline comes sooner than the
    one it sleeps until, and faulthandler (a thread started on every arming) is
    armed with ``HARD_STOP_SLACK`` to spare, so jobs that follow each other
    quickly share one arming. ``pause`` disarms it before the worker waits or
    talks to the database between jobs. Every request names the run it is for,
    compared under the lock with the run inside ``limit`` (job id and attempts):
    a stop meant for one job never reaches the next. Without ``on_stuck`` a run
    past its grace is only asked to stop.
    """

    def __init__(self, grace: float, on_stuck: Callable[[Prepared, BaseException], None] | None = None) -> None:
        self.grace = grace
        self._on_stuck = on_stuck
        # Reentrant: a stop signal's handler runs in the main thread, perhaps inside ``limit``.
        self._lock = threading.RLock()
        self._changed = threading.Condition(self._lock)
        # The run inside ``limit``, its deadlines (monotonic) and why it was asked to stop.
        self._prepared: Prepared | None = None
        self._seconds: int | None = None
        self._soft_at: float | None = None
        self._hard_at: float | None = None
        self._reason: BaseException | None = None
        # The thread took the run over: it records it and ends the process.
        self._taken = False
        self._sleeping_until = math.inf
        self._thread: threading.Thread | None = None
        self._closed = False
        # Monotonic time at which faulthandler fires; 0 when it is not armed.
        self._hard_stop_at = 0.0

    def __enter__(self) -> JobTimer:
        # The thread starts with the worker, not with its first job: creating a thread
        # blocks every signal in the creating thread for a moment, and a stop signal
        # that arrives then goes to another thread, which cannot wake the main thread
        # from a job's sleep (the suspected cause of a first SIGTERM, seen once in CI,
        # that was not handled until the job ended).
        with self._lock:
            self._closed = False
            self._wake_for(math.inf)
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.pause()
        with self._lock:
            self._closed = True
            self._changed.notify()

    def ask_to_stop(self, job: Job, reason: BaseException) -> bool:
        """Ask this reservation of ``job`` to stop, with ``reason``, if it runs under this
        timer now, and hand it to ``on_stuck`` if it still runs ``grace`` seconds later;
        callable from any thread. False when ``job`` does not run here (it ended, or
        another run has started since)."""
        with self._lock:
            prepared = self._prepared
            if self._taken or prepared is None or (prepared.job.pk, prepared.job.attempts) != (job.pk, job.attempts):
                return False
            if self._reason is None:
                self._reason = reason
            hard_at = time.monotonic() + self.grace
            if self._hard_at is None or hard_at < self._hard_at:
                self._hard_at = hard_at
                self._arm(hard_at)
            self._wake_for(hard_at)
            return True

    def asked_to_stop(self, job: Job) -> bool:
        """Tell whether this reservation of ``job`` was asked to stop (its cancel probe)."""
        with self._lock:
            prepared = self._prepared
            return (
                self._reason is not None
                and prepared is not None
                and (prepared.job.pk, prepared.job.attempts) == (job.pk, job.attempts)
            )

    @contextmanager
    def limit(self, prepared: Prepared, seconds: int | None) -> Iterator[None]:
        """Watch ``prepared``'s run inside (``seconds``: its timeout; None or 0: none)."""
        now = time.monotonic()
        with self._lock:
            self._prepared, self._seconds, self._reason = prepared, seconds, None
            self._soft_at = now + seconds if seconds else None
            self._hard_at = now + seconds + self.grace if seconds else None
            if self._soft_at is not None:
                self._wake_for(self._soft_at)
        if seconds:
            assert self._hard_at is not None
            # Keep the armed faulthandler if it fires after this job's last resort, and
            # not more than HARD_STOP_SLACK later.
            needed = self._hard_at + LAST_RESORT_SLACK
            if not needed <= self._hard_stop_at <= needed + HARD_STOP_SLACK:
                self._arm(self._hard_at, spare=HARD_STOP_SLACK)
        else:
            # An arming for an earlier job must not end this one.
            self.pause()
        try:
            yield
        except JobCancelled as exc:
            # The job stopped itself after it was asked to: it ends with the reason it was asked for.
            with self._lock:
                reason = self._reason
            if reason is not None and not isinstance(reason, JobCancelled):
                raise reason from exc
            raise
        finally:
            with self._lock:
                taken = self._taken
                if not taken:
                    self._prepared = self._reason = self._soft_at = self._hard_at = None
            if taken:
                # The timer's thread records this run and ends the process; nothing
                # after the run may touch the queue meanwhile.
                threading.Event().wait()

    def pause(self) -> None:
        """Disarm faulthandler until the next job (not once a stuck job is being recorded)."""
        if self._hard_stop_at and not self._taken:
            faulthandler.cancel_dump_traceback_later()
            self._hard_stop_at = 0.0

    def _arm(self, hard_at: float, *, spare: float = 0.0) -> None:
        """Make faulthandler end the process ``LAST_RESORT_SLACK`` seconds after ``hard_at``."""
        at = hard_at + LAST_RESORT_SLACK + spare
        hard_stop_later(max(0.001, at - time.monotonic()))
        self._hard_stop_at = at

    def _wake_for(self, at: float) -> None:
        # Under the lock. The thread starts when the timer is entered (again after it ended).
        if self._thread is None or not self._thread.is_alive():
            self._thread = threading.Thread(target=self._watch, name="dbqueue-timer", daemon=True)
            self._thread.start()
        elif at < self._sleeping_until:
            self._changed.notify()

    def _watch(self) -> None:
        with self._lock:
            while not self._closed:
                now = time.monotonic()
                prepared = self._prepared
                if prepared is not None and self._reason is None and self._soft_at is not None and self._soft_at <= now:
                    self._reason = JobTimeout(
                        f"the job ran longer than its timeout of {self._seconds} s and was stopped"
                    )
                    logger.warning(
                        "job=%s id=%s ran past its timeout of %ss: asked to stop; its process ends in %ss "
                        "unless it does",
                        prepared.job.name,
                        prepared.job.pk,
                        self._seconds,
                        self.grace,
                    )
                if prepared is not None and self._hard_at is not None and self._hard_at <= now:
                    if self._on_stuck is not None:
                        self._taken = True
                        break
                    self._hard_at = None
                due = self._soft_at if self._reason is None else self._hard_at
                self._sleeping_until = math.inf if due is None else due
                self._changed.wait(None if due is None else max(0.0, due - now))
            else:
                return
            reason = self._reason
        assert self._on_stuck is not None and reason is not None
        try:
            self._on_stuck(prepared, reason)
        except Exception:  # faulthandler ends the process anyway
            logger.exception("job=%s id=%s: its outcome could not be recorded", prepared.job.name, prepared.job.pk)


# Seconds a faulthandler arming for one job may outlast that job's last resort,
# so the jobs after it within that time need no new arming.
HARD_STOP_SLACK = 1.0
# Seconds faulthandler leaves the timer's thread, after a job's grace, to record
# the job and end the process in order, before it ends the process itself.
LAST_RESORT_SLACK = 5.0


def hard_stop_later(seconds: float) -> None:
    """End the process after ``seconds`` unless cancelled, printing where it was stuck."""
    for stream in (sys.stderr, sys.__stderr__):
        try:
            faulthandler.dump_traceback_later(seconds, exit=True, file=stream)  # type: ignore[arg-type]
            return
        except (AttributeError, ValueError, OSError):
            # A stream without a file descriptor (a test's capture, an embedding host).
            continue
    logger.warning("no file descriptor for faulthandler: a job stuck in C code cannot be ended after its timeout")


def prepare(job: Job) -> tuple[JobDefinition[..., Any], dict[str, Any], tuple[Any, ...], dict[str, Any]]:
    """Find the definition and arguments of ``job``; raise a permanent error if it cannot run."""
    definition = registry.get(job.name)
    envelope = payload.decode(job.payload)
    args, kwargs = payload.arguments(envelope, definition.func)
    return definition, envelope, args, kwargs


@functools.lru_cache(maxsize=1024)
def _signature(func: Callable[..., Any]) -> inspect.Signature:
    return inspect.signature(func)


def check_signature(definition: JobDefinition[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    try:
        _signature(definition.func).bind(*args, **kwargs)
    except TypeError as exc:
        raise PayloadError(
            f"the stored arguments no longer match {definition.name}(): {exc}. The function's "
            "signature changed after the job was enqueued; keep the old parameters (with "
            "defaults) until old jobs are drained, or forget this failed job."
        ) from None


def chain_position(envelope: dict[str, Any]) -> tuple[dict[str, Any] | None, int, int]:
    """The chain info of a step with its step number and step count; (None, 1, 1) outside a chain."""
    chain = chain_of(envelope)
    if chain is None:
        return None, 1, 1
    try:
        return chain, int(chain["step"]), int(chain["total"])
    except (TypeError, ValueError) as exc:
        raise PayloadError(f"the stored chain position {chain!r} is malformed: {exc}") from exc


@dataclasses.dataclass(slots=True)
class Prepared:
    """A claimed job turned into a call, ready to run (see ``prepare_run``)."""

    job: Job
    definition: JobDefinition[..., Any]
    envelope: dict[str, Any]
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    tries: int
    started: float
    tracker: Tracker
    context: JobContext | None
    # Built lazily by ``_context`` (middleware needs one): what a context is made of.
    worker_id: str = ""
    chain: dict[str, Any] | None = None
    step: int = 1
    steps: int = 1
    cancel_probe: Callable[[], int] | None = None

    @property
    def timeout(self) -> int | None:
        return self.job.timeout or None

    def middleware(self) -> tuple[middleware.Middleware, ...]:
        stack = middleware.from_settings()
        if self.definition.middleware:
            stack += middleware.for_job(self.definition.name, self.definition.middleware)
        return stack

    def make_context(self) -> JobContext:
        if self.context is None:
            self.context = _new_context(
                self.job,
                self.tries,
                self.worker_id,
                self.tracker,
                self.chain,
                self.step,
                self.steps,
                self.args,
                self.kwargs,
                self.cancel_probe,
                _batch_of(self.job, self.envelope),
            )
        return self.context


def execute(
    job: Job,
    *,
    worker_id: str,
    defaults: Defaults,
    timer: JobTimer | None = None,
    cancel_probe: Callable[[], int] | None = None,
) -> Outcome:
    """Run ``job`` and return what should happen to it. Never raises for the job's fault.

    ``timer`` is the worker's long-lived ``JobTimer`` (or a pool thread); without
    one, a timer is set up for this run alone, which only asks the job to stop at
    its timeout.
    ``cancel_probe`` tells the job's context whether a cancel request was seen.
    """
    if timer is None:
        with JobTimer(defaults.timeout_grace) as own_timer:
            return execute(job, worker_id=worker_id, defaults=defaults, timer=own_timer, cancel_probe=cancel_probe)
    prepared = prepare_run(job, worker_id=worker_id, defaults=defaults, cancel_probe=cancel_probe)
    if isinstance(prepared, Outcome):
        return prepared
    return run_prepared(prepared, defaults, timer)


def prepare_run(
    job: Job, *, worker_id: str, defaults: Defaults, cancel_probe: Callable[[], int] | None = None
) -> Prepared | Outcome:
    """Turn ``job`` into a call (definition, arguments, context); the outcome instead if it
    cannot run. May query the database (model arguments)."""
    started = time.monotonic()
    tracker = None
    envelope: dict[str, Any] = {}
    tries = job.tries_allowed(defaults.tries)
    try:
        definition, envelope, args, kwargs = prepare(job)
        chain, step, steps = chain_position(envelope)
        tracker = Tracker(job.pk, chain)
        prepared = Prepared(
            job,
            definition,
            envelope,
            args,
            kwargs,
            tries,
            started,
            tracker,
            None,
            worker_id,
            chain,
            step,
            steps,
            cancel_probe,
        )
        # Built only when used, by the job or by middleware: a frozen dataclass of
        # a dozen fields costs about 3 µs, a fifth of a bare run's overhead.
        if definition.takes_context:
            prepared.args = (prepared.make_context(), *args)
        check_signature(definition, prepared.args, kwargs)
    except PERMANENT_ERRORS as exc:
        outcome = _failed(exc, started, f"{job.name} (job {job.pk}) cannot run: {exc}", tracker)
    except DatabaseError as exc:
        # Fetching a model argument met the database's trouble, not the row's: retry.
        outcome = _after_error(job, exc, envelope, tries, defaults, started, tracker)
    except Exception as exc:  # noqa: BLE001 - any other fault of a stored row must not end the worker
        # A value no check above foresaw (a model pk of the wrong type, JSON nested
        # too deep): the row cannot become a call, and running it again cannot help.
        reason = PayloadError(f"the stored call could not be prepared: {type(exc).__name__}: {exc}")
        reason.__cause__ = exc
        outcome = _failed(
            reason, started, f"{job.name} (job {job.pk}) cannot run: {reason}\n\n{_traceback(exc)}", tracker
        )
    else:
        return prepared
    if tracing.enabled:
        tracing.unrunnable(job, outcome, worker_id)
    return outcome


def run_prepared(prepared: Prepared, defaults: Defaults, timer: JobTimer | Any) -> Outcome:
    """Call a prepared job in this thread, inside its middleware and under ``timer``."""
    if not tracing.enabled:
        return _run_prepared(prepared, defaults, timer)
    # The span is current while the job runs, outside its time limit.
    run = tracing.start_run(prepared)
    outcome = None
    try:
        outcome = _run_prepared(prepared, defaults, timer)
    finally:
        tracing.end_run(run, prepared.job, outcome)
    return outcome


def _run_prepared(prepared: Prepared, defaults: Defaults, timer: JobTimer | Any) -> Outcome:
    definition = prepared.definition
    try:
        with timer.limit(prepared, prepared.timeout or defaults.timeout):
            stack = prepared.middleware()
            if stack:
                call = functools.partial(_call, definition.func, prepared.args, prepared.kwargs)
                result = middleware.run(stack, prepared.make_context(), call)
            else:
                result = _call(definition.func, prepared.args, prepared.kwargs)
    except BaseException as exc:  # noqa: BLE001 - a job's SystemExit must not end the worker
        return outcome_of(prepared, exc, defaults)
    return Outcome("succeeded", time.monotonic() - prepared.started, result=result, tracker=prepared.tracker)


async def arun_prepared(prepared: Prepared, defaults: Defaults) -> Outcome:
    """Await a prepared ``async def`` job on the running event loop, inside its async
    middleware and its timeout (``asyncio.timeout``: the job is cancelled at its next
    ``await``). The caller checked ``loop_middleware`` first."""
    if not tracing.enabled:
        return await _arun_prepared(prepared, defaults)
    # Each task runs in a copy of the context: the span is current in this task only.
    run = tracing.start_run(prepared)
    outcome = None
    try:
        outcome = await _arun_prepared(prepared, defaults)
    finally:
        tracing.end_run(run, prepared.job, outcome)
    return outcome


async def _arun_prepared(prepared: Prepared, defaults: Defaults) -> Outcome:
    definition = prepared.definition
    seconds = prepared.timeout or defaults.timeout
    stack = middleware.for_loop(prepared.middleware())
    assert stack is not None
    try:
        async with asyncio.timeout(seconds or None) as deadline:
            try:
                if stack:
                    result = await middleware.arun(
                        stack, prepared.make_context(), lambda: definition.func(*prepared.args, **prepared.kwargs)
                    )
                else:
                    result = await definition.func(*prepared.args, **prepared.kwargs)
            except asyncio.CancelledError as exc:
                # Cancelled by the worker (a hard cancel or a forced stop): say why.
                reason = _cancel_reasons.pop(id(asyncio.current_task()), None)
                if reason is None or deadline.expired():
                    raise
                raise reason from exc
    except TimeoutError as exc:
        if not deadline.expired():
            return outcome_of(prepared, exc, defaults)
        timeout = JobTimeout(f"the job ran longer than its timeout of {seconds} s and was stopped")
        timeout.__cause__ = exc
        return outcome_of(prepared, timeout, defaults)
    except BaseException as exc:  # noqa: BLE001 - a job's SystemExit must not end the loop
        return outcome_of(prepared, exc, defaults)
    return Outcome("succeeded", time.monotonic() - prepared.started, result=result, tracker=prepared.tracker)


# Why the worker cancelled an asyncio task that runs a job: task id -> the exception
# the job ends with (set by ``cancel_task`` in the loop's thread).
_cancel_reasons: dict[int, BaseException] = {}


def cancel_task(task: asyncio.Task[Any], reason: BaseException) -> None:
    """Cancel a job's task so that it ends with ``reason`` (JobCancelled, WorkerStopped)."""
    _cancel_reasons[id(task)] = reason
    task.cancel()


def cancel_reason(task: asyncio.Task[Any] | None) -> BaseException | None:
    """The reason ``cancel_task`` gave for cancelling ``task`` (forgotten once read)."""
    return _cancel_reasons.pop(id(task), None)


def outcome_of(prepared: Prepared, exc: BaseException, defaults: Defaults) -> Outcome:
    """The outcome of a prepared job whose run raised ``exc``."""
    started, tracker = prepared.started, prepared.tracker
    if isinstance(exc, WorkerStopped):
        # Forced shutdown: give the job back at once; it runs again elsewhere.
        return Outcome(
            "released", time.monotonic() - started, exception=exc, error=clean(_traceback(exc)), tracker=tracker
        )
    if isinstance(exc, Snooze):
        # Not an error: no traceback, and no try spent.
        return Outcome(
            "released",
            time.monotonic() - started,
            exception=exc,
            error=str(exc),
            delay=exc.seconds,
            tracker=tracker,
            given_back=True,
        )
    if isinstance(exc, PERMANENT_ERRORS):
        return _failed(exc, started, _traceback(exc), tracker)
    return _after_error(prepared.job, exc, prepared.envelope, prepared.tries, defaults, started, tracker)


def _new_context(
    job: Job,
    tries: int,
    worker_id: str,
    tracker: Tracker,
    chain: dict[str, Any] | None,
    step: int,
    steps: int,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    cancel_probe: Callable[[], int] | None = None,
    batch_id: int | None = None,
) -> JobContext:
    return JobContext(
        job_id=job.pk,
        name=job.name,
        queue=job.queue,
        attempt=job.attempts,
        tries=tries,
        worker_id=worker_id,
        tracker=tracker,
        chain_id=chain["id"] if chain else None,
        step=step,
        steps=steps,
        given_back=job.given_back,
        args=args,
        kwargs=MappingProxyType(kwargs),
        cancel_probe=cancel_probe,
        batch_id=batch_id,
    )


def _batch_of(job: Job, envelope: dict[str, Any]) -> int | None:
    """The batch of a member, or of a batch callback."""
    if job.batch_id:
        return int(job.batch_id)
    of = envelope.get("batch_of")
    return of if isinstance(of, int) else None


def _call(func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    if inspect.iscoroutinefunction(func):
        # async_to_sync runs the job's sync_to_async calls in this thread,
        # on the worker's own database connection.
        return async_to_sync(func)(*args, **kwargs)
    return func(*args, **kwargs)


def _after_error(
    job: Job,
    exc: BaseException,
    envelope: dict[str, Any],
    tries: int,
    defaults: Defaults,
    started: float,
    tracker: Tracker | None,
) -> Outcome:
    """Release the job for another attempt after its backoff, or fail it once its tries
    are used or its ``retry_until`` has passed."""
    if job.tries_spent >= tries:
        return _failed(exc, started, _traceback(exc), tracker)
    max_exceptions = envelope.get("max_exceptions")
    if isinstance(max_exceptions, int) and job.exceptions + 1 >= max_exceptions:
        return _failed(
            exc,
            started,
            f"{job.name} (job {job.pk}) is not retried: it raised {job.exceptions + 1} exception(s), "
            f"its max_exceptions.\n\n{_traceback(exc)}",
            tracker,
        )
    deadline = _retry_deadline(job, envelope)
    if deadline is not None and database_now(job, started) >= deadline:
        return _failed(
            exc,
            started,
            f"{job.name} (job {job.pk}) is not retried: its retry_until, {deadline.isoformat()}, has passed.\n\n"
            f"{_traceback(exc)}",
            tracker,
        )
    backoff = envelope.get("backoff")
    if backoff is None or not registry.valid_backoff(backoff):
        backoff = defaults.backoff
    delay = registry.backoff_seconds(backoff, job.attempts)
    return Outcome(
        "released",
        time.monotonic() - started,
        exception=exc,
        error=clean(_traceback(exc)),
        delay=delay,
        tracker=tracker,
        counts_exception=True,
    )


def _retry_deadline(job: Job, envelope: dict[str, Any]) -> datetime | None:
    """The job's ``retry_until`` from its envelope; None if it has none, or an unreadable one."""
    stored = envelope.get("retry_until")
    if stored is None:
        return None
    try:
        deadline = datetime.fromisoformat(stored)
    except (TypeError, ValueError):
        # Its tries still bound the job; a bad deadline must not fail it by itself.
        logger.warning("ignoring unreadable retry_until job=%s id=%s value=%r", job.name, job.pk, stored)
        return None
    return deadline if deadline.tzinfo is not None else deadline.replace(tzinfo=UTC)


def database_now(job: Job, started: float) -> datetime:
    """Estimate the database's clock: the claim's time (``reserved_at``, read from the
    database) plus the monotonic time since the run ``started``.

    It runs behind the database's clock by the time the job waited in the worker
    between its claim and its run (a batch's wait, a fraction of a second), never
    ahead: a deadline is never taken as passed before it has. It is this
    process's clock only for a row that was never claimed.
    """
    if job.reserved_at is None:
        return timezone.now()
    return job.reserved_at + timedelta(seconds=time.monotonic() - started)


def _failed(exc: BaseException, started: float, error: str, tracker: Tracker | None) -> Outcome:
    # Cleaned here, at the source: FailedJob.error, the progress row and the logs
    # all take the outcome's text.
    return Outcome("failed", time.monotonic() - started, exception=exc, error=clean(error), tracker=tracker)


def _traceback(exc: BaseException) -> str:
    return "".join(traceback.format_exception(exc))
