"""Job definitions: the ``@job`` decorator, the name registry and enqueueing."""

from __future__ import annotations

import dataclasses
import itertools
import logging
import random
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from datetime import UTC, datetime, timedelta
from types import MappingProxyType
from typing import (
    TYPE_CHECKING,
    Any,
    Concatenate,
    Generic,
    Literal,
    NamedTuple,
    NoReturn,
    ParamSpec,
    TypeVar,
    cast,
    overload,
)

from django.core.exceptions import ImproperlyConfigured
from django.db import transaction
from django.utils import timezone

from . import concurrency, conf, db, payload, rates, signals, unique, validation
from .exceptions import JobCancelled, JobNotRegistered, Snooze

if TYPE_CHECKING:
    from .batches import BatchHandle
    from .bulk import Held, NewJob
    from .handles import JobHandle
    from .middleware import MiddlewareEntry
    from .models import Job
    from .progress import Tracker

logger = logging.getLogger("django_dbqueue")

P = ParamSpec("P")
R = TypeVar("R")

Backoff = int | float | Sequence[int | float]
# When a job stops being retried: an aware datetime, a time from enqueue, or a
# callable that returns either when the job is enqueued.
RetryUntil = datetime | timedelta | Callable[[], datetime | timedelta]

_registry: dict[str, JobDefinition[..., Any]] = {}


@dataclasses.dataclass(frozen=True, slots=True)
class JobContext:
    """What a job defined with ``takes_context=True`` receives as its first argument,
    and what every middleware receives."""

    job_id: int
    name: str
    queue: str
    # Reservations of the job so far, this one included: every run, snoozed ones too.
    attempt: int
    tries: int
    worker_id: str = ""
    # For a chain step: the chain's id, this step's number (from 1) and the step count.
    chain_id: str | None = None
    step: int = 1
    steps: int = 1
    tracker: Tracker | None = dataclasses.field(default=None, repr=False, compare=False)
    # Earlier reservations that spent no try (snoozes, lost connections).
    given_back: int = 0
    # The call's arguments (without the context), for middleware; read-only.
    args: tuple[Any, ...] = dataclasses.field(default=(), repr=False, compare=False)
    kwargs: Mapping[str, Any] = dataclasses.field(default=MappingProxyType({}), repr=False, compare=False)
    # The level of a cancel request the worker has seen for this run (0: none).
    cancel_probe: Callable[[], int] | None = dataclasses.field(default=None, repr=False, compare=False)
    # The batch this job is a member of, or whose callback it is (batches.py).
    batch_id: int | None = None

    @property
    def batch(self) -> BatchHandle | None:
        """The job's batch, read now (``batch.is_cancelled``, ``batch.add(...)``); None outside a batch."""
        if self.batch_id is None:
            return None
        from .batches import get_batch

        return get_batch(self.batch_id)

    @property
    def cancel_requested(self) -> bool:
        """Tell whether the job was asked to stop: cancelled (``JobHandle.cancel``,
        ``queue_cancel``, the admin), past its timeout, or its worker stopped twice.

        The worker learns of a cancel request within about a second of it (a run
        shorter than that is never asked). Nothing is raised into a job from outside:
        a job that looks here (or calls ``check_cancelled``) stops where it chose to;
        one that runs on ``TIMEOUT_GRACE`` seconds after a timeout or a hard cancel
        ends its worker process.
        """
        return bool(self.cancel_probe is not None and self.cancel_probe())

    def check_cancelled(self) -> None:
        """Raise ``JobCancelled`` if the job was asked to stop; call it where stopping is safe."""
        if self.cancel_requested:
            raise JobCancelled(f"{self.name} (job {self.job_id}) was cancelled while it ran")

    @property
    def is_last_attempt(self) -> bool:
        """Tell whether a failure of this run uses the job's last try."""
        return self.attempt - self.given_back >= self.tries

    def snooze(self, seconds: float | timedelta) -> NoReturn:
        """Stop this run and run the job again after ``seconds``, without spending a try."""
        raise Snooze(seconds)

    @property
    def progress_key(self) -> str:
        """Where progress is stored: ``chain:<id>`` for a chain step, else the job's id."""
        return f"chain:{self.chain_id}" if self.chain_id else str(self.job_id)

    def progress(self, percent: float, stage: str = "") -> None:
        """Report progress (0-100, clamped) and a short stage; never rolled back, and raises
        only ``JobCancelled``, once the job was asked to stop."""
        self.check_cancelled()
        if self.tracker is not None:
            self.tracker.report(percent, stage)


@dataclasses.dataclass(frozen=True)
class JobDefinition(Generic[P, R]):
    """A function registered as a job, with its options.

    ``None`` options fall back to the worker's command-line defaults, then to
    ``DBQUEUE`` settings.
    """

    func: Callable[..., R]
    name: str
    queue: str | None = None
    tries: int | None = None
    retry_after: int | None = None
    timeout: int | None = None
    backoff: Backoff | None = None
    priority: int = 0
    delay: float = 0
    takes_context: bool = False
    retry_until: RetryUntil | None = None
    # Wrapped around each run, inside DBQUEUE["MIDDLEWARE"]: callables or dotted paths.
    middleware: Sequence[MiddlewareEntry] = ()
    # Keep the return value and the errors of each attempt (see handles); None: DBQUEUE["RESULTS"].
    results: bool | None = None
    # Fail once this many attempts ended in an exception, whatever tries remain (tries
    # also count reservations lost with their worker); None: no such limit.
    max_exceptions: int | None = None
    # Flow control (docs/flow.md). Unique jobs: ``unique`` True (or "until_finished")
    # holds the key while the job waits or runs, "until_started" until a worker
    # claims it; ``unique_key``: a str or a callable of the arguments (default:
    # the arguments themselves); ``unique_for``: seconds after an enqueue in which
    # no other enqueue of the key is stored.
    unique: bool | str = False
    unique_key: str | Callable[..., Any] | None = None
    unique_for: float | None = None
    # At most ``concurrency_limit`` (default 1) jobs with the same key run at once;
    # a str or a callable of the arguments (default: the job's name).
    concurrency_key: str | Callable[..., Any] | None = None
    concurrency_limit: int | None = None
    # At most N starts per period ("100/m"), shared by the jobs with the same
    # ``rate_key`` (a str or a callable of the arguments; default: the job's name).
    rate_limit: str | None = None
    rate_key: str | Callable[..., Any] | None = None
    rate_burst: int | None = None

    def __post_init__(self) -> None:
        # A tuple, so the definition stays hashable and the list passed in can change freely.
        object.__setattr__(self, "middleware", tuple(self.middleware))
        _validate_options(self)

    def __call__(self, *args: Any, **kwargs: Any) -> R:
        """Call the function directly, in this process (a context job takes its context first)."""
        return self.func(*args, **kwargs)

    def using(
        self,
        *,
        queue: str | None = None,
        delay: float | timedelta | None = None,
        priority: int | None = None,
        tries: int | None = None,
        retry_after: int | None = None,
        timeout: int | None = None,
        backoff: Backoff | None = None,
        retry_until: RetryUntil | None = None,
        max_exceptions: int | None = None,
        unique: bool | str | None = None,
        unique_key: str | Callable[..., Any] | None = None,
        unique_for: float | None = None,
    ) -> JobDefinition[P, R]:
        """Return a copy with some options changed, for the next enqueue.

        ``unique=False`` makes the copy not unique at all (no ``unique_key``, no
        ``unique_for``, unless given here too).
        """
        changes: dict[str, Any] = {
            key: value
            for key, value in {
                "queue": queue,
                "priority": priority,
                "tries": tries,
                "retry_after": retry_after,
                "timeout": timeout,
                "backoff": backoff,
                "retry_until": retry_until,
                "max_exceptions": max_exceptions,
                "unique": unique,
                "unique_key": unique_key,
                "unique_for": unique_for,
            }.items()
            if value is not None
        }
        if unique is False:
            changes.setdefault("unique_key", None)
            changes.setdefault("unique_for", None)
        if delay is not None:
            changes["delay"] = delay.total_seconds() if isinstance(delay, timedelta) else delay
        return dataclasses.replace(self, **changes)

    def bind(self, *args: P.args, **kwargs: P.kwargs) -> JobCall:
        """Return this job with its arguments, ready for ``enqueue_many`` or a chain."""
        return JobCall(self, args, kwargs)

    def enqueue(self, *args: P.args, **kwargs: P.kwargs) -> JobHandle:
        """Store a call of this job and return its handle; it runs once the surrounding transaction commits."""
        return self.bind(*args, **kwargs).enqueue()

    async def aenqueue(self, *args: P.args, **kwargs: P.kwargs) -> JobHandle:
        """``enqueue`` from async code (through ``sync_to_async``, on Django's thread for the ORM)."""
        return await self.bind(*args, **kwargs).aenqueue()

    @property
    def uses_limits(self) -> bool:
        """Whether its jobs carry a concurrency key or a rate limit (claimed by the flow claim)."""
        return self.concurrency_key is not None or self.concurrency_limit is not None or self.rate_limit is not None

    @property
    def effective_queue(self) -> str:
        return self.queue or str(conf.get("QUEUE"))


@dataclasses.dataclass(frozen=True)
class JobCall:
    """A job definition with the arguments of one call, and what follows it."""

    definition: JobDefinition[..., Any]
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    callbacks: tuple[JobCall, ...] = ()
    failure_callback: JobCall | None = None

    def then(self, *calls: JobCall) -> JobCall:
        """Return this call with jobs to enqueue once it succeeds."""
        return dataclasses.replace(self, callbacks=(*self.callbacks, *calls))

    def on_failure(self, call: JobCall) -> JobCall:
        """Return this call with a job to enqueue if it fails for good."""
        return dataclasses.replace(self, failure_callback=call)

    def to_step(self) -> dict[str, Any]:
        """Return this call as JSON data: name, options and encoded arguments."""
        definition = self.definition
        try:
            # With the function: a model instance its annotations do not declare is
            # refused here, not when a worker fetches it (payload.declared_models).
            args = payload.encode_arguments(self.args, self.kwargs, definition.func)
        except TypeError as exc:
            raise TypeError(f"Cannot enqueue {definition.name}: {exc}") from None
        step: dict[str, Any] = {
            "name": definition.name,
            "queue": definition.effective_queue,
            "priority": definition.priority,
            "tries": definition.tries,
            "retry_after": definition.retry_after or int(conf.get("RETRY_AFTER")),
            "timeout": definition.timeout,
            "delay": definition.delay,
            "backoff": _backoff_json(definition.backoff),
            **args,
        }
        if definition.retry_until is not None:
            step["retry_until"] = retry_deadline(definition.name, definition.retry_until)
        if definition.max_exceptions is not None:
            step["max_exceptions"] = definition.max_exceptions
        flow = {
            **unique.step_values(definition, self.args, self.kwargs),
            **concurrency.step_values(definition, self.args, self.kwargs),
            **rates.step_values(definition, self.args, self.kwargs),
        }
        if flow:
            step["flow"] = flow
        return step

    def to_new_job(self) -> NewJob:
        """Return the row values of this call; raise TypeError for a bad argument."""
        return self._prepared()[0]

    def _prepared(
        self, *, trace: bool = True, checked: set[tuple[str, str]] | None = None
    ) -> tuple[NewJob, unique.Window | None]:
        """The row values of this call and its ``unique_for`` window; every key callable
        is called here, once, before anything is stored (``trace``, ``checked``: see ``chains.new_job``)."""
        from .chains import new_job

        step = self.to_step()
        new = new_job(
            step,
            then=[call.to_step() for call in self.callbacks],
            on_failure=self.failure_callback.to_step() if self.failure_callback else None,
            trace=trace,
            checked=checked,
        )
        return new, unique.window_of(self.definition, step.get("flow"), self.args, self.kwargs)

    def to_row(self) -> Job:
        """Return an unsaved ``Job`` row for this call; raise TypeError for a bad argument."""
        return self.to_new_job().to_job()

    def enqueue(self) -> JobHandle:
        """Store this call (and what follows it); see ``JobDefinition.enqueue``.

        A unique job whose key is held stores nothing: the handle is the holder's,
        with ``enqueued`` False (docs/unique.md).
        """
        from . import tracing
        from .bulk import insert_one, insert_row
        from .handles import JobHandle

        plain = None
        if not self.callbacks and self.failure_callback is None and not (tracing.enabled and tracing.carries()):
            plain = _Plain.cached(self.definition)
        if plain is None:
            return _handles(_store([self._prepared()], one=True))[0]
        # No key, no window: nothing for _store to lock, skip or run again; and on
        # PostgreSQL the handle builds the row's model instance only if asked for.
        new = plain.new_job(self.args, self.kwargs)
        row = insert_row(new, db.alias())
        if row is None or signals.job_enqueued.has_listeners(JobDefinition):
            return _handles([insert_one(new) if row is None else row.job()])[0]
        logger.debug("enqueued job=%s id=%s queue=%s", new.name, row.pk, new.queue)
        return JobHandle.from_row(row)

    async def aenqueue(self) -> JobHandle:
        from asgiref.sync import sync_to_async

        handle: JobHandle = await sync_to_async(self.enqueue)()
        return handle


def store(new: NewJob, window: unique.Window | None = None) -> JobHandle:
    """Store one prepared job as ``JobCall.enqueue`` does (a chain's first step): a
    unique job whose key is held stores nothing, and the handle is the holder's."""
    return _handles(_store([(new, window)], one=True))[0]


@overload
def enqueue_many(
    calls: Iterable[JobCall], *, batch_size: int = 1000, handles: Literal[True] = True
) -> list[JobHandle]: ...


@overload
def enqueue_many(calls: Iterable[JobCall], *, batch_size: int = 1000, handles: Literal[False]) -> int: ...


def enqueue_many(calls: Iterable[JobCall], *, batch_size: int = 1000, handles: bool = True) -> list[JobHandle] | int:
    """Store many calls, ``batch_size`` rows per statement, in one transaction; return their handles.

    ``calls`` may be any iterable, a generator of millions included: it is read
    ``batch_size`` calls at a time, each batch checked and sent before the next
    is read, so memory holds one batch (and the handles: with ``handles=False``
    none are kept, the number of jobs stored is returned, and on PostgreSQL the
    rows go through ``COPY``). A list or tuple, already in memory, is checked
    whole before anything is sent. docs/enqueue.md has the figures.

    A call that cannot be stored (an argument that is not JSON, an unknown
    queue, a payload too large, a key callable that raises) raises its error
    with its position: ``exc.position`` is its index in ``calls`` and the
    message starts with "call N of enqueue_many". Without a transaction around
    it, enqueue_many is one transaction of its own, so nothing is stored; inside
    ``transaction.atomic()`` the batches sent before stay in the transaction,
    and the caller decides: let the error out of the block (all undone) or catch
    it and commit what was sent.

    On PostgreSQL, SQLite and MariaDB the handles carry their ids (plain MySQL
    returns none). One handle per call, in order: a unique job whose key is held
    (by a job stored before, or by an earlier call of ``calls``) stores nothing,
    and its handle is the holder's, with ``enqueued`` False.
    """
    if batch_size < 1:
        raise ValueError("batch_size must be at least 1")
    from django.db import connections

    from .bulk import Row, Stream, analyze_if_large, insert_rows, rows_usable
    from .handles import JobHandle

    using = db.alias()
    connection = connections[using]
    kept: list[JobHandle] = []
    stored = 0
    # Rows inserted without being read back (COPY on PostgreSQL): not for handles,
    # nor for job_enqueued's receivers, which get each row.
    copying = not handles and rows_usable(connection) and not signals.job_enqueued.has_listeners(JobDefinition)
    if isinstance(calls, Sequence):
        # Already in memory: checked whole before anything is sent, and stored as one
        # enqueue (run again after a deadlock when it is a transaction of its own).
        return _enqueue_sequence(calls, batch_size, handles, copying)
    chunks = itertools.batched(calls, batch_size)
    first = next(chunks, None)
    if first is None:
        return [] if handles else 0
    second = next(chunks, None)
    # Several batches are one transaction: the caller's if open (an error between
    # batches leaves the choice to it), else one of our own. A single batch needs
    # none: ``_store`` runs an enqueue of unique jobs that met a deadlock again.
    own = second is not None and not connection.in_atomic_block

    def deliver(outcomes: Sequence[Job | Held]) -> None:
        nonlocal stored
        if handles:
            kept.extend(_handles(outcomes))
        else:
            stored += _announce(outcomes)

    def deliver_rows(rows: list[Row]) -> None:
        nonlocal stored
        if signals.job_enqueued.has_listeners(JobDefinition):
            deliver([row.job() for row in rows])
        elif handles:
            kept.extend([JobHandle.from_row(row) for row in rows])
        else:
            stored += len(rows)

    in_transaction = own or connection.in_atomic_block
    with (
        transaction.atomic(using=using, savepoint=False) if own else _nothing(),
        Stream(connection, using) if in_transaction else _nothing() as stream,
    ):
        calls_read = 0
        for chunk in itertools.chain((first,), () if second is None else (second,), chunks):
            prepared = _prepare_all(chunk, calls_read)
            calls_read += len(chunk)
            plain = not any(window or new.unique_key for new, window in prepared)
            if copying and plain:
                stored += insert_rows(connection, [new for new, _ in prepared])
            elif stream is not None and stream.usable and plain:
                # Sent now, read back once the next batch is sent: the server inserts
                # this one while the next is prepared.
                deliver_rows(stream.send([new for new, _ in prepared]))
            else:
                if stream is not None:
                    deliver_rows(stream.flush())
                deliver(_store(prepared, batch_size=batch_size, analyze=False))
        if stream is not None:
            deliver_rows(stream.flush())
    analyze_if_large(using, calls_read)
    return kept if handles else stored


def _enqueue_sequence(calls: Sequence[JobCall], batch_size: int, handles: bool, copying: bool) -> list[JobHandle] | int:
    """``enqueue_many`` of a list: every call prepared, then stored."""
    from django.db import connections

    from .bulk import analyze_if_large, insert_rows

    prepared = _prepare_all(calls, 0)
    if not prepared:
        return [] if handles else 0
    if copying and not any(window or new.unique_key for new, window in prepared):
        using = db.alias()
        connection = connections[using]
        own = len(prepared) > batch_size and not connection.in_atomic_block
        with transaction.atomic(using=using, savepoint=False) if own else _nothing():
            for start in range(0, len(prepared), batch_size):
                insert_rows(connection, [new for new, _ in prepared[start : start + batch_size]])
        analyze_if_large(using, len(prepared))
        return len(prepared)
    outcomes = _store(prepared, batch_size=batch_size)
    return _handles(outcomes) if handles else _announce(outcomes)


def _prepare_all(calls: Sequence[JobCall], first: int) -> list[tuple[NewJob, unique.Window | None]]:
    """``JobCall._prepared`` of each call; an error names the call's position (``first`` + its index).

    A call with nothing to work out but its arguments (``_Plain``: no unique key,
    no limit, no deadline, nothing chained, no trace to carry) takes the values
    its definition shares from the first such call of the batch, and only its
    arguments are encoded: the same row in about half the time (docs/enqueue.md;
    ``tests/test_enqueue_stream.py`` compares the two).
    """
    from . import tracing

    prepared: list[tuple[NewJob, unique.Window | None]] = []
    trace = tracing.enabled and tracing.carries()
    checked: set[tuple[str, str]] = set()
    plains: dict[int, _Plain | None] = {}
    for call in calls:
        try:
            definition = call.definition
            plain = None
            if not trace and not call.callbacks and call.failure_callback is None:
                key = id(definition)
                if key in plains:
                    plain = plains[key]
                else:
                    plain = plains[key] = _Plain.of(definition)
            if plain is None:
                prepared.append(call._prepared(trace=trace, checked=checked))
            else:
                prepared.append((plain.new_job(call.args, call.kwargs), None))
        except Exception as exc:
            position = first + len(prepared)
            if exc.args and isinstance(exc.args[0], str):
                exc.args = (f"call {position + 1:,} of enqueue_many (index {position}): {exc.args[0]}", *exc.args[1:])
            exc.position = position  # type: ignore[attr-defined]
            raise
    return prepared


class _Plain(NamedTuple):
    """What the rows of one job definition's plain calls share: all but the payload."""

    queue: str
    name: str
    priority: int
    max_tries: int | None
    retry_after: int
    timeout: int | None
    delay: float
    # Envelope keys after the arguments, in ``chains.new_job``'s order.
    options: dict[str, Any]
    # The job's function, whose annotations say which models its arguments may be.
    func: Callable[..., Any]

    @classmethod
    def of(cls, definition: JobDefinition[..., Any]) -> _Plain | None:
        """The shared values, or None if a call of ``definition`` needs more than its arguments."""
        if (
            unique.scope(definition) is not None
            or definition.unique_for is not None
            or definition.uses_limits
            or definition.retry_until is not None
        ):
            return None
        from .chains import check_queue

        queue = definition.effective_queue
        check_queue(definition.name, queue)
        options: dict[str, Any] = {}
        backoff = _backoff_json(definition.backoff)
        if backoff:
            options["backoff"] = backoff
        if definition.max_exceptions is not None:
            options["max_exceptions"] = definition.max_exceptions
        return cls(
            queue=queue,
            name=definition.name,
            priority=int(definition.priority or 0),
            max_tries=definition.tries,
            retry_after=int(definition.retry_after or conf.get("RETRY_AFTER")),
            timeout=definition.timeout,
            delay=float(definition.delay or 0),
            options=options,
            func=definition.func,
        )

    @classmethod
    def cached(cls, definition: JobDefinition[..., Any]) -> _Plain | None:
        """``of``, kept on the definition while the settings stay the same (one enqueue at a time)."""
        settings = conf.get_settings()
        kept = definition.__dict__.get("_plain")
        if kept is not None and kept[0] is settings:
            plain: _Plain | None = kept[1]
            return plain
        plain = cls.of(definition)
        # Not a field: invisible to equality, repr and dataclasses.replace (``using`` makes a new one).
        object.__setattr__(definition, "_plain", (settings, plain))
        return plain

    def new_job(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> NewJob:
        from .bulk import NewJob

        try:
            encoded = payload.encode_arguments(args, kwargs, self.func)
        except TypeError as exc:
            raise TypeError(f"Cannot enqueue {self.name}: {exc}") from None
        text = payload.dumps({"v": payload.VERSION, **encoded, **self.options})
        payload.check_size(self.name, text)
        return NewJob(
            self.queue, self.name, text, self.priority, self.max_tries, self.retry_after, self.timeout, self.delay
        )


@contextmanager
def _nothing() -> Iterator[Any]:
    yield None


# Times an enqueue of unique jobs that is a transaction of its own is run, when
# the database ends it to break a deadlock; each time after a short random pause,
# so the enqueues that met do not meet again.
DEADLOCK_ATTEMPTS = 5
DEADLOCK_PAUSE = 0.05


def _store(
    prepared: Sequence[tuple[NewJob, unique.Window | None]],
    *,
    batch_size: int = 1000,
    one: bool = False,
    analyze: bool = True,
) -> list[Job | Held]:
    """Insert the new jobs; those whose key or window is held come back ``Held``.

    Unique jobs enqueued outside a transaction are stored in one of their own,
    run again if the database ends it to break a deadlock (concurrent batches
    that share several keys; on MariaDB also the gap locks of the unique index).
    Inside the caller's transaction, a deadlock error reaches the caller, whose
    whole transaction the database ended.
    """
    from django.db import OperationalError, connections

    from .bulk import is_deadlock

    connection = connections[db.alias()]
    if connection.in_atomic_block or not any(window or new.unique_key for new, window in prepared):
        return _store_once(prepared, batch_size, one, analyze)
    for attempt in range(1, DEADLOCK_ATTEMPTS + 1):
        try:
            return _store_once(prepared, batch_size, one, analyze)
        except OperationalError as exc:
            if attempt == DEADLOCK_ATTEMPTS or not is_deadlock(exc, connection):
                raise
            logger.info("enqueue ran again after a deadlock attempt=%s error=%s", attempt, db.error_text(exc))
            time.sleep(random.uniform(0, DEADLOCK_PAUSE * attempt))
    raise AssertionError("unreachable")


def _store_once(
    prepared: Sequence[tuple[NewJob, unique.Window | None]], batch_size: int, one: bool, analyze: bool = True
) -> list[Job | Held]:
    """``_store`` once. Jobs with a ``unique_for`` window are stored in a transaction
    (the caller's, if open) that locks their window rows first: a job whose window
    is open is left out, and the windows of the jobs inserted open from now."""
    from .bulk import Held, insert, insert_one
    from .models import Job

    def insert_all(news: Sequence[NewJob]) -> list[Job | Held]:
        return [insert_one(news[0])] if one else insert(news, batch_size=batch_size, analyze=analyze)

    if not any(window for _, window in prepared):
        return insert_all([new for new, _ in prepared])
    with transaction.atomic(using=db.alias(), savepoint=False):
        locked = unique.lock_windows({window.key for _, window in prepared if window})
        results: list[Job | Held | None] = [None] * len(prepared)
        first: dict[str, int] = {}
        todo: list[int] = []
        for index, (_, window) in enumerate(prepared):
            if window is None:
                todo.append(index)
            elif window.key in locked.open:
                results[index] = Held(window.key, locked.open[window.key])
            elif window.key not in first:
                first[window.key] = index
                todo.append(index)
        stored = insert_all([prepared[index][0] for index in todo]) if todo else []
        for index, stored_outcome in zip(todo, stored, strict=True):
            results[index] = stored_outcome
        opened = []
        for index, (_, window) in enumerate(prepared):
            if window is None:
                continue
            outcome = results[index]
            if outcome is None:  # a later call of a window opened by an earlier one
                earlier = results[first[window.key]]
                assert earlier is not None
                results[index] = Held(window.key, earlier.pk if isinstance(earlier, Job) else earlier.job_id)
            elif isinstance(outcome, Job) and first.get(window.key) == index:
                opened.append((window, outcome.pk))
        unique.open_windows(opened, locked.now)
    return [outcome for outcome in results if outcome is not None]


def _handles(outcomes: Sequence[Job | Held]) -> list[JobHandle]:
    """The handles of stored jobs and of those left out; ``job_enqueued`` for the stored ones only."""
    from .bulk import Held
    from .handles import JobHandle

    _announce(outcomes)
    held = [outcome for outcome in outcomes if isinstance(outcome, Held)]
    if not held:
        # Nothing left out (every enqueue of jobs that are not unique): no more work than before.
        jobs = cast("list[Job]", outcomes)
        if len(jobs) == 1:
            logger.debug("enqueued job=%s id=%s queue=%s", jobs[0].name, jobs[0].pk, jobs[0].queue)
        return [JobHandle.from_job(job) for job in jobs]
    duplicates = iter(JobHandle.not_enqueued([outcome.job_id for outcome in held]))
    handles = []
    for outcome in outcomes:
        if isinstance(outcome, Held):
            handles.append(next(duplicates))
            logger.debug("not enqueued, unique key held key=%s by_id=%s", outcome.key, outcome.job_id)
            continue
        handles.append(JobHandle.from_job(outcome))
    return handles


def _announce(outcomes: Sequence[Job | Held]) -> int:
    """Send ``job_enqueued`` for each stored job (not for those left out); return how many were stored."""
    from .bulk import Held

    stored = [outcome for outcome in outcomes if not isinstance(outcome, Held)]
    if signals.job_enqueued.has_listeners(JobDefinition):
        for job in stored:
            signals.job_enqueued.send_robust(sender=JobDefinition, job=job)
    return len(stored)


def _load_database_times(jobs: list[Job]) -> None:
    """Replace the database-clock expressions on saved rows by their stored values.

    Django 6 reads them back in the INSERT's RETURNING clause; Django 5.2 and
    backends without RETURNING leave the expression on the instance.
    """
    from .models import Job

    pending = {job.pk: job for job in jobs if job.pk is not None and hasattr(job.created_at, "resolve_expression")}
    if not pending:
        return
    stored = Job.objects.filter(pk__in=list(pending)).values_list("pk", "available_at", "created_at")
    for pk, available_at, created_at in stored:
        pending[pk].available_at, pending[pk].created_at = available_at, created_at


def backoff_seconds(backoff: Backoff, attempt: int) -> float:
    """Seconds to wait after failed attempt ``attempt`` (1-based)."""
    if isinstance(backoff, (int, float)):
        return float(backoff)
    if not backoff:
        return 0.0
    return float(backoff[min(attempt, len(backoff)) - 1])


def _backoff_json(backoff: Backoff | None) -> Any:
    if backoff is None or isinstance(backoff, (int, float)):
        return backoff
    return list(backoff)


def _validate_options(definition: JobDefinition[..., Any]) -> None:
    where = f"job {definition.name!r}"
    if definition.max_exceptions is not None and (
        isinstance(definition.max_exceptions, bool)
        or not isinstance(definition.max_exceptions, int)
        or not 1 <= definition.max_exceptions <= validation.MAX_TRIES
    ):
        raise ImproperlyConfigured(
            f"{where}: max_exceptions must be an integer from 1 to {validation.MAX_TRIES}, "
            f"not {definition.max_exceptions!r}"
        )
    if definition.results is not None and not isinstance(definition.results, bool):
        raise ImproperlyConfigured(f"{where}: results must be True, False or None, not {definition.results!r}")
    if definition.queue is not None:
        error = validation.queue_name_error(definition.queue)
        if error is not None:
            raise ImproperlyConfigured(f"{where}: {error}")
    tries = definition.tries
    if tries is not None and not (_whole(tries) and 1 <= tries <= validation.MAX_TRIES):
        raise ImproperlyConfigured(
            f"{where}: tries must be a whole number from 1 to {validation.MAX_TRIES}, not {tries!r}"
        )
    for option in ("retry_after", "timeout"):
        value = getattr(definition, option)
        if value is not None and not (_whole(value) and 1 <= value <= validation.MAX_SECONDS):
            raise ImproperlyConfigured(
                f"{where}: {option} must be a whole number of seconds from 1 to {validation.MAX_SECONDS}, not {value!r}"
            )
    if definition.backoff is not None and not valid_backoff(definition.backoff):
        raise ImproperlyConfigured(
            f"{where}: backoff must be seconds (a number from 0 to {validation.MAX_SECONDS}) or a list of them, "
            f"not {definition.backoff!r}"
        )
    priority = definition.priority
    if not (_whole(priority) and validation.MIN_PRIORITY <= priority <= validation.MAX_PRIORITY):
        raise ImproperlyConfigured(
            f"{where}: priority must be a whole number from {validation.MIN_PRIORITY} to "
            f"{validation.MAX_PRIORITY}, not {priority!r}"
        )
    if not _seconds(definition.delay):
        raise ImproperlyConfigured(
            f"{where}: delay must be seconds from 0 to {validation.MAX_SECONDS} or a timedelta, "
            f"not {definition.delay!r}"
        )

    if definition.retry_until is not None:
        error = _retry_until_error(definition.retry_until, callable_ok=True)
        if error is not None:
            raise ImproperlyConfigured(f"{where}: {error}")
    for error in (
        unique.options_error(definition),
        concurrency.options_error(definition),
        rates.options_error(definition),
    ):
        if error is not None:
            raise ImproperlyConfigured(f"{where}: {error}")
    for entry in definition.middleware:
        if not (callable(entry) or _dotted(entry)):
            raise ImproperlyConfigured(
                f"{where}: each middleware must be a callable or the dotted path of one, not {entry!r}"
            )


def _retry_until_error(value: Any, *, callable_ok: bool) -> str | None:
    """Why ``value`` cannot be a retry_until, or None if it can."""
    if isinstance(value, datetime):
        if timezone.is_naive(value):
            return f"retry_until must be a timezone-aware datetime, not the naive {value.isoformat()!r}"
        return None
    if isinstance(value, timedelta):
        if not 0 <= value.total_seconds() <= validation.MAX_SECONDS:
            return f"retry_until as a timedelta must be from 0 to {validation.MAX_SECONDS} seconds, not {value!r}"
        return None
    if callable_ok and callable(value):
        return None
    expected = "an aware datetime, a timedelta" + (", or a callable returning one" if callable_ok else "")
    return f"retry_until must be {expected}, not {type(value).__name__} {value!r}"


def retry_deadline(name: str, retry_until: RetryUntil) -> str:
    """Return ``retry_until`` as an ISO timestamp in UTC, a timedelta counted from now.

    Now is this process's clock (the enqueuing one); a callable is called here.
    """
    value = retry_until() if callable(retry_until) else retry_until
    error = _retry_until_error(value, callable_ok=False)
    if error is not None:
        raise TypeError(f"Cannot enqueue {name}: {error}")
    if isinstance(value, timedelta):
        value = timezone.now() + value
    return value.astimezone(UTC).isoformat()


def _dotted(value: Any) -> bool:
    return isinstance(value, str) and "." in value and all(part.isidentifier() for part in value.split("."))


def _whole(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _seconds(value: Any) -> bool:
    """A number of seconds the columns and the database's date arithmetic can hold."""
    return (
        isinstance(value, (int, float))
        and not isinstance(value, bool)
        and 0 <= value <= validation.MAX_SECONDS  # False for NaN, too
    )


def valid_backoff(backoff: Any) -> bool:
    """Tell whether ``backoff`` is seconds (0 to ``MAX_SECONDS``) or a list of them."""
    if isinstance(backoff, (list, tuple)):
        return all(_seconds(item) for item in backoff)
    return _seconds(backoff)


@overload
def job(func: Callable[P, R], /) -> JobDefinition[P, R]: ...


@overload
def job(
    *,
    takes_context: Literal[True],
    name: str | None = None,
    queue: str | None = None,
    tries: int | None = None,
    retry_after: int | None = None,
    timeout: int | None = None,
    backoff: Backoff | None = None,
    priority: int = 0,
    delay: float = 0,
    retry_until: RetryUntil | None = None,
    middleware: Sequence[MiddlewareEntry] = (),
    results: bool | None = None,
    max_exceptions: int | None = None,
    unique: bool | str = False,
    unique_key: str | Callable[..., Any] | None = None,
    unique_for: float | None = None,
    concurrency_key: str | Callable[..., Any] | None = None,
    concurrency_limit: int | None = None,
    rate_limit: str | None = None,
    rate_key: str | Callable[..., Any] | None = None,
    rate_burst: int | None = None,
) -> Callable[[Callable[Concatenate[JobContext, P], R]], JobDefinition[P, R]]: ...


@overload
def job(
    *,
    takes_context: Literal[False] = False,
    name: str | None = None,
    queue: str | None = None,
    tries: int | None = None,
    retry_after: int | None = None,
    timeout: int | None = None,
    backoff: Backoff | None = None,
    priority: int = 0,
    delay: float = 0,
    retry_until: RetryUntil | None = None,
    middleware: Sequence[MiddlewareEntry] = (),
    results: bool | None = None,
    max_exceptions: int | None = None,
    unique: bool | str = False,
    unique_key: str | Callable[..., Any] | None = None,
    unique_for: float | None = None,
    concurrency_key: str | Callable[..., Any] | None = None,
    concurrency_limit: int | None = None,
    rate_limit: str | None = None,
    rate_key: str | Callable[..., Any] | None = None,
    rate_burst: int | None = None,
) -> Callable[[Callable[P, R]], JobDefinition[P, R]]: ...


def job(func: Callable[..., Any] | None = None, /, **options: Any) -> Any:
    """Register a function as a job, with ``@job`` or ``@job(queue="emails", tries=5)``."""

    def register_func(func: Callable[..., Any]) -> JobDefinition[..., Any]:
        name = options.pop("name", None) or f"{func.__module__}.{func.__qualname__}"
        definition: JobDefinition[..., Any] = JobDefinition(func=func, name=name, **options)
        register(definition)
        return definition

    if func is not None:
        if options:
            raise TypeError("use @job or @job(option=...), not both")
        return register_func(func)
    return register_func


def register(definition: JobDefinition[..., Any]) -> None:
    """Add a definition to the registry; a name belongs to one function."""
    existing = _registry.get(definition.name)
    if existing is not None and _qualified(existing.func) != _qualified(definition.func):
        raise ImproperlyConfigured(
            f"The job name {definition.name!r} is used by {_qualified(existing.func)} and "
            f"{_qualified(definition.func)}; give one of them another name with @job(name=...)"
        )
    _registry[definition.name] = definition


def unregister(name: str) -> None:
    _registry.pop(name, None)


def get(name: str) -> JobDefinition[..., Any]:
    """Return the definition registered under ``name``."""
    try:
        return _registry[name]
    except KeyError:
        raise JobNotRegistered(
            f"No job is registered under the name {name!r}. Is the app that defines it in "
            "INSTALLED_APPS, and is the function decorated with @job in the app's jobs.py "
            "(or in a module that is imported at startup)? Workers must run the same code "
            "as the processes that enqueue."
        ) from None


def all_definitions() -> dict[str, JobDefinition[..., Any]]:
    return dict(_registry)


def find(name: str) -> JobDefinition[..., Any] | None:
    """The definition registered under ``name``, or None (no copy of the registry: the worker asks per job)."""
    return _registry.get(name)


def _qualified(func: Callable[..., Any]) -> str:
    return f"{func.__module__}.{func.__qualname__}"
