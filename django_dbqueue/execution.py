"""Run one reserved job and decide its outcome. Writes nothing to the queue."""

from __future__ import annotations

import asyncio
import dataclasses
import faulthandler
import functools
import inspect
import logging
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from datetime import UTC, datetime, timedelta
from types import MappingProxyType
from typing import Any, Protocol

from asgiref.sync import async_to_sync
from django.db import DatabaseError
from django.utils import timezone

from . import handles, middleware, payload, registry, rows, tracing, validation, workflows
from .context import JobContext
from .errors import clean
from .exceptions import PERMANENT_ERRORS, JobCancelled, JobTimeout, PayloadError, Snooze, WorkerStopped
from .models import Job
from .progress import Tracker
from .registry import Backoff, JobDefinition
from .rows import chain_of
from .running import running
from .states import RunStatus

logger = logging.getLogger("django_dbqueue")

Status = RunStatus  # states.RunStatus: how one run ended


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
    # The run marked durable steps (steps.py): their rows go with the job's when it succeeds.
    stepped: bool = False

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


class Timer(Protocol):
    """What watches a run's time: ``inline.JobTimer``, or a pool's thread."""

    def limit(self, prepared: Prepared, seconds: int | None) -> AbstractContextManager[None]: ...


def timeout_error(seconds: int | None) -> JobTimeout:
    return JobTimeout(f"the job ran longer than its timeout of {seconds} s and was stopped")


def past_timeout(job: Job, seconds: int | None, grace: float) -> JobTimeout:
    """Log that ``job`` ran past its timeout and is asked to stop; the reason it is asked with."""
    logger.warning(
        "job=%s id=%s ran past its timeout of %ss: asked to stop; its process ends in %ss unless it does",
        job.name,
        job.pk,
        seconds,
        grace,
    )
    return timeout_error(seconds)


@contextmanager
def ends_as_asked(asked: Callable[[], BaseException | None]) -> Iterator[None]:
    """A job that stopped itself (``check_cancelled``) when asked ends with the reason asked for."""
    try:
        yield
    except JobCancelled as exc:
        reason = asked()
        if reason is not None and not isinstance(reason, JobCancelled):
            raise reason from exc
        raise


def hard_stop_later(seconds: float) -> None:
    """End the process after ``seconds`` unless cancelled, printing where it was stuck."""
    for stream in (sys.stderr, sys.__stderr__):
        try:
            faulthandler.dump_traceback_later(seconds, exit=True, file=stream)  # type: ignore[arg-type]
            return
        except (AttributeError, ValueError, OSError):  # no file descriptor (a test's capture)
            continue
    logger.warning("no file descriptor for faulthandler: a job stuck in C code cannot be ended after its timeout")


def check_signature(definition: JobDefinition[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """Raise ``PayloadError`` if the stored arguments (a context job's without its context) no longer fit."""
    error = validation.call_error(definition.func, args, kwargs, takes_context=definition.takes_context)
    if error is not None:
        # Enqueue checks each call (JobDefinition.bind): this row was stored by older code, or by hand.
        raise PayloadError(
            f"the stored arguments no longer match {definition.name}(): {error}. The function's "
            "signature changed after the job was enqueued; keep the old parameters (with "
            "defaults) until old jobs are drained, or forget this failed job."
        )


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
    """A claimed job turned into a call, ready to run."""

    job: Job
    definition: JobDefinition[..., Any]
    envelope: dict[str, Any]
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    tries: int
    started: float
    tracker: Tracker
    context: JobContext | None
    # What ``make_context`` builds a context of, when used.
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
            job, chain = self.job, self.chain
            batch_of = self.envelope.get("batch_of")  # the batch of a batch callback
            self.context = JobContext(
                job_id=job.pk,
                name=job.name,
                queue=job.queue,
                attempt=job.attempts,
                tries=self.tries,
                worker_id=self.worker_id,
                tracker=self.tracker,
                chain_id=chain["id"] if chain else None,
                chain_step=self.step,
                chain_steps=self.steps,
                given_back=job.given_back,
                args=self.args,
                kwargs=MappingProxyType(self.kwargs),
                cancel_probe=self.cancel_probe,
                batch_id=int(job.batch_id) if job.batch_id else batch_of if isinstance(batch_of, int) else None,
            )
        return self.context


def prepare_run(
    job: Job, *, worker_id: str, defaults: Defaults, cancel_probe: Callable[[], int] | None = None
) -> Prepared | Outcome:
    """Turn ``job`` into a call, or the outcome if it cannot run. May query (model arguments)."""
    started = time.monotonic()
    tracker = None
    envelope: dict[str, Any] = {}
    tries = job.tries_allowed(defaults.tries)
    try:
        definition = registry.get(job.name)
        envelope = payload.decode(job.payload)
        args, kwargs = payload.arguments(envelope, definition.func)
        if workflows.PARENTS_KEY in envelope:  # a workflow node passed its parents' results
            kwargs.update(workflows.passed_results(envelope))
        chain, step, steps = chain_position(envelope)
        tracker = Tracker(job.pk, chain)
        prepared = Prepared(job, definition, envelope, args, kwargs, tries, started, tracker, None, worker_id, chain)
        prepared.step, prepared.steps, prepared.cancel_probe = step, steps, cancel_probe
        check_signature(definition, args, kwargs)
        # Built only when used: a measurable share of a bare run (docs/performance.md).
        if definition.takes_context:
            prepared.args = (prepared.make_context(), *args)
    except PERMANENT_ERRORS as exc:
        outcome = _failed(exc, started, f"{job.name} (job {job.pk}) cannot run: {exc}", tracker)
    except DatabaseError as exc:
        # Fetching a model argument met the database's trouble, not the row's: retry.
        outcome = _after_error(job, exc, envelope, tries, defaults, started, tracker)
    except Exception as exc:  # noqa: BLE001 - any other fault of a stored row must not end the worker
        # A value no check foresaw (a pk of the wrong type, JSON too deep): retrying cannot help.
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


def run_prepared(prepared: Prepared, defaults: Defaults, timer: Timer) -> Outcome:
    """Call a prepared job in this thread, inside its middleware and under ``timer``."""
    if not tracing.enabled:
        return _run_prepared(prepared, defaults, timer)
    run = tracing.start_run(prepared)
    outcome = None
    try:
        outcome = _run_prepared(prepared, defaults, timer)
    finally:
        tracing.end_run(run, prepared.job, outcome)
    return outcome


def _run_prepared(prepared: Prepared, defaults: Defaults, timer: Timer) -> Outcome:
    definition = prepared.definition
    token = running.set((prepared.job.pk, definition.name))
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
    finally:
        running.reset(token)
    return succeeded(prepared, result)


async def arun_prepared(prepared: Prepared, defaults: Defaults) -> Outcome:
    """Await a prepared ``async def`` job on the running loop, inside its async middleware and
    ``asyncio.timeout`` (the caller checked ``middleware.for_loop`` first)."""
    if not tracing.enabled:
        return await _arun_prepared(prepared, defaults)
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
    # Each async job runs in an asyncio task of its own, in a copy of the context: set, never reset.
    running.set((prepared.job.pk, definition.name))
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
                # By the worker (a hard cancel, a forced stop): say why.
                reason = _cancel_reasons.pop(id(asyncio.current_task()), None)
                if reason is None or deadline.expired():
                    raise
                raise reason from exc
    except TimeoutError as exc:
        if not deadline.expired():
            return outcome_of(prepared, exc, defaults)
        timeout = timeout_error(seconds)
        timeout.__cause__ = exc
        return outcome_of(prepared, timeout, defaults)
    except BaseException as exc:  # noqa: BLE001 - a job's SystemExit must not end the loop
        return outcome_of(prepared, exc, defaults)
    return succeeded(prepared, result)


def succeeded(prepared: Prepared, result: Any) -> Outcome:
    """The outcome of a prepared job that returned ``result``."""
    refused = refused_result(prepared, result)
    if refused is not None:
        return refused
    context = prepared.context
    return Outcome(
        "succeeded",
        time.monotonic() - prepared.started,
        result=result,
        tracker=prepared.tracker,
        stepped=context is not None and context.durable.used,
    )


def refused_result(prepared: Prepared, result: Any) -> Outcome | None:
    """The failed outcome of a run whose ``result`` is too large to keep (``results``) or cannot be
    passed on (a piped chain's step), else None. A job that returns None, or any but a piped
    chain's step, pays a comparison or two."""
    job = prepared.job
    refused = rows.pipe_refusal(job, result) if rows.pipes(prepared.chain) else None
    if refused is None and result is not None and handles.keeps_result(job.name, job.payload):
        refused = handles.result_refusal(job, result)
    if refused is None:
        return None
    # For good: running it again would redo its work to return the same value.
    return _failed(refused, prepared.started, f"{job.name} (job {job.pk}) ran, but failed: {refused}", prepared.tracker)


# Task id -> the exception a job's task cancelled by the worker ends with (in the loop's thread).
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
        # Forced shutdown: back at once, to run elsewhere.
        return Outcome(
            "released", time.monotonic() - started, exception=exc, error=clean(_traceback(exc)), tracker=tracker
        )
    if isinstance(exc, Snooze):
        # Not an error: no traceback, no try spent.
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
    definition = prepared.definition
    if definition.fail_on or definition.retry_on is not None:
        refused = definition.not_retried(exc)
        if refused is not None:
            job = prepared.job
            return _failed(
                exc, started, f"{job.name} (job {job.pk}) is not retried: {refused}.\n\n{_traceback(exc)}", tracker
            )
    return _after_error(prepared.job, exc, prepared.envelope, prepared.tries, defaults, started, tracker)


def _call(func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    if inspect.iscoroutinefunction(func):
        # Its sync_to_async calls run in this thread, on the worker's connection.
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
    """Release the job for another try after its backoff, or fail it (tries used, ``retry_until`` passed)."""
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
    backoff = registry.stored_backoff(envelope.get("backoff"))
    if backoff is None:
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
    """The job's ``retry_until``; None if it has none or an unreadable one."""
    stored = envelope.get("retry_until")
    if stored is None:
        return None
    try:
        deadline = datetime.fromisoformat(stored)
    except (TypeError, ValueError):
        # Its tries still bound the job: a bad deadline must not fail it.
        logger.warning("ignoring unreadable retry_until job=%s id=%s value=%r", job.name, job.pk, stored)
        return None
    return deadline if deadline.tzinfo is not None else deadline.replace(tzinfo=UTC)


def database_now(job: Job, started: float) -> datetime:
    """The database's clock, estimated: ``reserved_at`` (the claim's, by the database) plus the
    time since the run ``started``; behind by the job's wait in the worker, never ahead."""
    if job.reserved_at is None:
        return timezone.now()
    return job.reserved_at + timedelta(seconds=time.monotonic() - started)


def _failed(exc: BaseException, started: float, error: str, tracker: Tracker | None) -> Outcome:
    # Cleaned at the source: FailedJob.error, the progress row and the logs take this text.
    return Outcome("failed", time.monotonic() - started, exception=exc, error=clean(error), tracker=tracker)


def _traceback(exc: BaseException) -> str:
    return "".join(traceback.format_exception(exc))
