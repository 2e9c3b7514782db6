"""Job definitions: the ``@job`` decorator, its options and the name registry.

A definition knows nothing of tables: ``JobCall.enqueue`` hands the call to ``enqueue``, the one
lazy import upward (as Django's ``Task.enqueue`` finds its backend), so ``from django_dbqueue
import job`` works before the app registry is ready. ``Handle`` types what an enqueue returns.
"""

from __future__ import annotations

import dataclasses
import math
import random
import typing
from collections.abc import Callable, Sequence
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any, Concatenate, Generic, Literal, ParamSpec, TypedDict, TypeVar, Unpack, overload

from asgiref.sync import sync_to_async
from django.core.exceptions import ImproperlyConfigured
from django.utils import timezone

from . import concurrency, conf, rates, unique, validation
from .exceptions import JobCancelled, JobNotRegistered, Snooze, WorkerStopped
from .states import JobStatus

if TYPE_CHECKING:
    from .models import Job

P = ParamSpec("P")
R = TypeVar("R")


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _seconds(value: Any) -> bool:
    """A number of seconds the columns and the database's date arithmetic can hold."""
    return (
        isinstance(value, (int, float))
        and not isinstance(value, bool)
        and 0 <= value <= validation.MAX_SECONDS  # False for NaN, too
    )


@dataclasses.dataclass(frozen=True)
class Exponential:
    """A backoff that grows by ``factor`` after each failed attempt, from ``base`` seconds up to
    ``max``; each delay is drawn at random from its last ``jitter`` share (1: from 0 to the delay,
    Celery's full jitter; 0: exactly the delay), so jobs that failed together do not retry together."""

    base: float = 1
    factor: float = 2
    max: float = 600
    jitter: float = 1.0

    def __post_init__(self) -> None:
        if isinstance(self.jitter, bool):
            object.__setattr__(self, "jitter", float(self.jitter))
        error = self._error()
        if error is not None:
            raise ValueError(f"Exponential backoff: {error}")

    def _error(self) -> str | None:
        for option in ("base", "max"):
            value = getattr(self, option)
            if not _seconds(value) or value == 0:
                return f"{option} must be seconds above 0 and at most {validation.MAX_SECONDS}, not {value!r}"
        if self.max < self.base:
            return f"max ({self.max!r}) must be at least base ({self.base!r})"
        if not (_number(self.factor) and 1 <= self.factor <= 100):
            return f"factor must be a number from 1 to 100, not {self.factor!r}"
        if not (_number(self.jitter) and 0 <= self.jitter <= 1):
            return f"jitter must be True, False or a share from 0 to 1, not {self.jitter!r}"
        return None

    def seconds(self, attempt: int, rand: Callable[[], float] | None = None) -> float:
        """Seconds to wait after failed attempt ``attempt`` (1-based); ``rand`` draws the jitter (from 0 to 1)."""
        exponent = max(attempt - 1, 0)
        # factor ** exponent overflows a float long before the attempts column does.
        if exponent * math.log(self.factor) >= math.log(self.max / self.base):
            delay = float(self.max)
        else:
            delay = self.base * self.factor**exponent
        if not self.jitter:
            return delay
        return delay - delay * self.jitter * (rand or random.random)()

    def to_json(self) -> dict[str, float]:
        """The fields, as an envelope stores them (``stored_backoff`` reads them back)."""
        return {"base": self.base, "factor": self.factor, "max": self.max, "jitter": self.jitter}


EXPONENTIAL = Exponential()

# Seconds, one per attempt (the last repeats), or a growing delay ("exponential": Exponential()).
Backoff = int | float | Sequence[int | float] | Exponential | Literal["exponential"]
# Exception classes: one, or a tuple of them.
Exceptions = type[BaseException] | tuple[type[BaseException], ...]
# When a job stops being retried: an aware datetime, a time from enqueue, or a callable returning one.
RetryUntil = datetime | timedelta | Callable[[], datetime | timedelta]

_registry: dict[str, JobDefinition[..., Any]] = {}


class JobOptions(TypedDict, total=False):
    """The options of ``@job`` and ``JobDefinition.using`` (``JobDefinition``'s fields carry the defaults)."""

    queue: str | None
    tries: int | None
    retry_after: int | None
    timeout: int | None
    backoff: Backoff | None
    # Folded into an exponential backoff (``backoff="exponential"`` or an ``Exponential``).
    backoff_max: float | None
    backoff_jitter: bool | float | None
    priority: int
    delay: float | timedelta
    retry_until: RetryUntil | None
    middleware: Sequence[Callable[..., Any] | str]
    results: bool | None
    max_exceptions: int | None
    unique: bool | str
    unique_key: str | Callable[..., Any] | None
    unique_for: float | None
    concurrency_key: str | Callable[..., Any] | None
    concurrency_limit: int | None
    rate_limit: str | None
    rate_key: str | Callable[..., Any] | None
    rate_burst: int | None


class DefinitionOptions(JobOptions, total=False):
    """The options of ``@job``: ``JobOptions`` and those that live in the definition only (not in
    the job's row, so ``using`` cannot change them for one enqueue)."""

    retry_on: Exceptions | None
    fail_on: Exceptions | None


@dataclasses.dataclass(frozen=True)
class JobDefinition(Generic[P, R]):
    """A function registered as a job, with its options (None: the worker's defaults, then ``DBQUEUE``)."""

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
    middleware: Sequence[Callable[..., Any] | str] = ()
    # Keep the return value and the errors of each attempt (see handles); None: DBQUEUE["RESULTS"].
    results: bool | None = None
    # Fail once this many attempts raised, whatever tries remain (tries count lost reservations too).
    max_exceptions: int | None = None
    # Flow control (docs/flow.md): unique keys ("until_finished" or "until_started"), unique_for
    # windows (seconds), concurrency and rate limits; a key is a str or a callable of the arguments.
    unique: bool | str = False
    unique_key: str | Callable[..., Any] | None = None
    unique_for: float | None = None
    concurrency_key: str | Callable[..., Any] | None = None
    concurrency_limit: int | None = None
    rate_limit: str | None = None
    rate_key: str | Callable[..., Any] | None = None
    rate_burst: int | None = None
    # Retry only the exceptions that are instances of these (None: every exception); those of
    # ``fail_on`` fail at once. Read by the worker from the registered definition (docs/howto/retries.md).
    retry_on: tuple[type[BaseException], ...] | None = None
    fail_on: tuple[type[BaseException], ...] = ()
    # Folded into ``backoff`` (an ``Exponential``), not kept.
    backoff_max: dataclasses.InitVar[float | None] = None
    backoff_jitter: dataclasses.InitVar[bool | float | None] = None

    def __post_init__(self, backoff_max: float | None, backoff_jitter: bool | float | None) -> None:
        # A tuple, so the definition stays hashable and the list passed in can change freely.
        object.__setattr__(self, "middleware", tuple(self.middleware))
        if isinstance(self.delay, timedelta):
            object.__setattr__(self, "delay", self.delay.total_seconds())
        for option in ("retry_on", "fail_on"):
            value = getattr(self, option)
            if isinstance(value, type):
                object.__setattr__(self, option, (value,))
            elif isinstance(value, list):
                object.__setattr__(self, option, tuple(value))
        if self.fail_on is None:
            object.__setattr__(self, "fail_on", ())
        object.__setattr__(self, "backoff", _exponential(self.name, self.backoff, backoff_max, backoff_jitter))
        _validate_options(self)

    def __call__(self, *args: Any, **kwargs: Any) -> R:
        """Call the function directly, in this process (a context job takes its context first)."""
        return self.func(*args, **kwargs)

    def using(self, **changes: Unpack[JobOptions]) -> JobDefinition[P, R]:
        """Return a copy with some options changed (None: unchanged; ``unique=False`` drops every unique option)."""
        for option in ("retry_on", "fail_on"):
            if option in changes:
                raise TypeError(
                    f"{self.name}.using({option}=...): {option} is not stored with a job, so it cannot change "
                    "for one enqueue; the worker reads it from the registered definition, @job(...)"
                )
        values: dict[str, Any] = {key: value for key, value in changes.items() if value is not None}
        if changes.get("unique") is False:
            values.setdefault("unique_key", None)
            values.setdefault("unique_for", None)
        return dataclasses.replace(self, **values)

    def bind(self, *args: P.args, **kwargs: P.kwargs) -> JobCall:
        """Return this job with its arguments, ready for ``enqueue_many`` or a chain; raise TypeError,
        naming the parameter, if the function cannot take them."""
        validation.check_call(self.name, self.func, args, kwargs, takes_context=self.takes_context)
        return JobCall(self, args, kwargs)

    def not_retried(self, exc: BaseException) -> str | None:
        """Why a run that raised ``exc`` is not retried by ``retry_on`` or ``fail_on``, or None."""
        if self.fail_on and isinstance(exc, self.fail_on):
            return f"{_class_name(type(exc))} is in its fail_on"
        if self.retry_on is not None and not isinstance(exc, self.retry_on):
            return f"{_class_name(type(exc))} is not in its retry_on ({', '.join(map(_class_name, self.retry_on))})"
        return None

    def enqueue(self, *args: P.args, **kwargs: P.kwargs) -> Handle:
        """Store a call of this job and return its handle; it runs once the surrounding transaction commits."""
        return self.bind(*args, **kwargs).enqueue()

    async def aenqueue(self, *args: P.args, **kwargs: P.kwargs) -> Handle:
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

    def enqueue(self, *, depends_on: Sequence[Any] = ()) -> Handle:
        """Store this call (and what follows it); a unique job whose key is held stores nothing (docs/unique.md).
        ``depends_on``: handles (or ids) of jobs that must succeed first (``workflows.enqueue_after``)."""
        # The one upward call: enqueueing needs the models, which ``@job`` must not import.
        from .enqueue import enqueue_call

        return enqueue_call(self, depends_on=depends_on)

    async def aenqueue(self) -> Handle:
        handle: Handle = await sync_to_async(self.enqueue)()
        return handle


class Handle(typing.Protocol):
    """What an enqueue returns, for type checkers: the API of ``handles.JobHandle``."""

    id: int
    name: str
    queue: str
    status: JobStatus
    job_id: int | None
    errors: list[dict[str, Any]]
    finished_at: Any
    enqueued: bool

    @property
    def job(self) -> Job | None: ...
    @property
    def pk(self) -> int: ...
    @property
    def finished(self) -> bool: ...
    @property
    def result(self) -> Any: ...
    def refresh(self) -> None: ...
    async def arefresh(self) -> None: ...
    def cancel(self, *, hard: bool = False, reason: str = "") -> bool: ...
    async def acancel(self, *, hard: bool = False, reason: str = "") -> bool: ...


def backoff_seconds(backoff: Backoff, attempt: int) -> float:
    """Seconds to wait after failed attempt ``attempt`` (1-based)."""
    if isinstance(backoff, (int, float)):
        return float(backoff)
    if isinstance(backoff, Exponential):
        return backoff.seconds(attempt)
    if backoff == "exponential":
        return EXPONENTIAL.seconds(attempt)
    if not backoff:
        return 0.0
    return float(backoff[min(attempt, len(backoff)) - 1])


def backoff_json(backoff: Any) -> Any:
    """A backoff as the envelope stores it (an ``Exponential`` as a dict of its fields); stored ones as they are."""
    if backoff is None or isinstance(backoff, (int, float, str, dict)):
        return backoff
    if isinstance(backoff, Exponential):
        return backoff.to_json()
    return list(backoff)


def stored_backoff(value: Any) -> Backoff | None:
    """The backoff an envelope stores, or None if it has none or one this code cannot read."""
    if isinstance(value, dict):
        try:
            return Exponential(**value)
        except (TypeError, ValueError):
            return None
    return value if value is not None and valid_backoff(value) else None


def _exponential(name: str, backoff: Any, most: float | None, jitter: bool | float | None) -> Any:
    """``backoff`` with ``"exponential"`` made an ``Exponential``, and ``backoff_max``/``backoff_jitter`` folded in."""
    if backoff == "exponential":
        backoff = EXPONENTIAL
    if most is None and jitter is None:
        return backoff
    if not isinstance(backoff, Exponential):
        raise ImproperlyConfigured(
            f"job {name!r}: backoff_max and backoff_jitter shape backoff='exponential' (or an Exponential), "
            f"not the backoff {backoff!r}; a number or a list of seconds is its own cap"
        )
    changes = {"max": most, "jitter": jitter}
    try:
        return dataclasses.replace(backoff, **{key: value for key, value in changes.items() if value is not None})
    except ValueError as exc:
        raise ImproperlyConfigured(f"job {name!r}: {exc}") from None


# The whole-number options: their bounds and how the error names them.
_WHOLE = (
    ("max_exceptions", 1, validation.MAX_TRIES, "an integer from {} to {}"),
    ("tries", 1, validation.MAX_TRIES, "a whole number from {} to {}"),
    ("retry_after", 1, validation.MAX_SECONDS, "a whole number of seconds from {} to {}"),
    ("timeout", 1, validation.MAX_SECONDS, "a whole number of seconds from {} to {}"),
    ("priority", validation.MIN_PRIORITY, validation.MAX_PRIORITY, "a whole number from {} to {}"),
)


def _validate_options(definition: JobDefinition[..., Any]) -> None:
    where = f"job {definition.name!r}"
    for option, low, high, what in _WHOLE:
        value = getattr(definition, option)
        if (value is not None or option == "priority") and not (_whole(value) and low <= value <= high):
            raise ImproperlyConfigured(f"{where}: {option} must be {what.format(low, high)}, not {value!r}")
    if definition.results is not None and not isinstance(definition.results, bool):
        raise ImproperlyConfigured(f"{where}: results must be True, False or None, not {definition.results!r}")
    if definition.queue is not None:
        error = validation.queue_name_error(definition.queue)
        if error is not None:
            raise ImproperlyConfigured(f"{where}: {error}")
    if definition.backoff is not None and not valid_backoff(definition.backoff):
        raise ImproperlyConfigured(
            f"{where}: backoff must be seconds (a number from 0 to {validation.MAX_SECONDS}), a list of them, "
            f"'exponential' or an Exponential, not {definition.backoff!r}"
        )
    for option in ("retry_on", "fail_on"):
        error = _exceptions_error(option, getattr(definition, option))
        if error is not None:
            raise ImproperlyConfigured(f"{where}: {error}")
    if not _seconds(definition.delay):
        raise ImproperlyConfigured(
            f"{where}: delay must be seconds from 0 to {validation.MAX_SECONDS} or a timedelta, "
            f"not {definition.delay!r}"
        )
    retry_until = definition.retry_until
    for error in (
        None if retry_until is None else _retry_until_error(retry_until, callable_ok=True),
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
    """Return ``retry_until`` as an ISO timestamp in UTC (a callable called, a timedelta from this process's now)."""
    value = retry_until() if callable(retry_until) else retry_until
    error = _retry_until_error(value, callable_ok=False)
    if error is not None:
        raise TypeError(f"Cannot enqueue {name}: {error}")
    if isinstance(value, timedelta):
        value = timezone.now() + value
    return value.astimezone(UTC).isoformat()


# Exceptions the worker handles before retry_on and fail_on are asked: naming them would do nothing.
_NOT_FAILURES = (Snooze, JobCancelled, WorkerStopped)


def _exceptions_error(option: str, value: Any) -> str | None:
    """Why ``value`` cannot be a retry_on or fail_on (a tuple of exception classes), or None if it can."""
    if value is None:
        return None
    if not isinstance(value, tuple) or (option == "retry_on" and not value):
        example = "(ConnectionError, TimeoutError)"
        return f"{option} must be an exception class or a tuple of them, such as {example}, not {value!r}"
    for item in value:
        if not (isinstance(item, type) and issubclass(item, BaseException)):
            return f"{option} must hold exception classes, such as ConnectionError, not {item!r}"
        if issubclass(item, _NOT_FAILURES):
            return (
                f"{option} cannot hold {item.__name__}: the worker handles it before {option} is asked "
                "(a snooze is never a failure, a cancelled job is never retried, a stopped worker gives the job back)"
            )
    return None


def _class_name(cls: type) -> str:
    return cls.__qualname__ if cls.__module__ == "builtins" else f"{cls.__module__}.{cls.__qualname__}"


def _dotted(value: Any) -> bool:
    return isinstance(value, str) and "." in value and all(part.isidentifier() for part in value.split("."))


def _whole(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def valid_backoff(backoff: Any) -> bool:
    """Tell whether ``backoff`` is seconds (0 to ``MAX_SECONDS``), a list of them, ``"exponential"``
    or an ``Exponential``."""
    if isinstance(backoff, (list, tuple)):
        return all(_seconds(item) for item in backoff)
    return isinstance(backoff, Exponential) or backoff == "exponential" or _seconds(backoff)


@overload
def job(func: Callable[P, R], /) -> JobDefinition[P, R]: ...


@overload
def job(
    *, takes_context: Literal[True], name: str | None = None, **options: Unpack[DefinitionOptions]
) -> Callable[[Callable[Concatenate[Any, P], R]], JobDefinition[P, R]]: ...  # Any: a context.JobContext


@overload
def job(
    *, takes_context: Literal[False] = False, name: str | None = None, **options: Unpack[DefinitionOptions]
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
