"""Bounds and names the queue accepts, shared by enqueue, the commands and the system checks, and
the check that a call's arguments fit its job's parameters.

The bounds are the columns' own, so a value that passes is never cut or refused by the database.
"""

from __future__ import annotations

import contextlib
import difflib
import hashlib
import inspect
import re
import sys
from collections.abc import Callable
from typing import Any, Protocol

# Letters, digits and ``_ . : -``: a stray space in a command line is an error, not a new queue.
QUEUE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.:\-]*$")
# The ``queue`` columns are varchar(100).
QUEUE_NAME_MAX_LENGTH = 100
# ``max_tries`` is a SmallIntegerField.
MAX_TRIES = 32767
# ``retry_after`` and ``timeout`` are IntegerFields (seconds; 2**31 - 1 on every database).
MAX_SECONDS = 2**31 - 1
# The largest id a BigAutoField holds: a bigger one is a typo, refused before the database sees it.
MAX_ID = 2**63 - 1
# ``priority``: Django's Tasks framework's range.
MIN_PRIORITY, MAX_PRIORITY = -100, 100


def queue_name_error(name: Any) -> str | None:
    """Why ``name`` cannot be a queue name, or None if it can."""
    if not isinstance(name, str):
        return f"a queue name must be a str, not {type(name).__name__}"
    if not name:
        return "a queue name cannot be empty"
    if len(name) > QUEUE_NAME_MAX_LENGTH:
        return f"the queue name {name[:20]!r}... is {len(name)} characters long; at most {QUEUE_NAME_MAX_LENGTH}"
    if not QUEUE_NAME.match(name):
        return f"the queue name {name!r} may hold only letters, digits and _ . : - (and start with a letter or digit)"
    return None


def check_queue_name(name: Any) -> str:
    """Return ``name`` if it is a valid queue name; raise ValueError saying why not."""
    error = queue_name_error(name)
    if error is not None:
        raise ValueError(error)
    return str(name)


# Flow-control keys are varchar(255); a longer one is stored as its start and a hash of the whole.
KEY_MAX_LENGTH = 255


def flow_key(
    job_name: str, option: str, value: str | Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> str:
    """The key ``option`` gives a call of ``job_name``: ``value`` itself, or what it returns when
    called with the call's arguments. Raise ValueError saying which option failed and why."""
    if callable(value):
        try:
            value = value(*args, **kwargs)
        except Exception as exc:
            raise ValueError(f"Cannot enqueue {job_name}: its {option} raised {type(exc).__name__}: {exc}") from exc
    if isinstance(value, bool) or not isinstance(value, str | int):
        raise ValueError(f"Cannot enqueue {job_name}: its {option} must be a str or an int, not {type(value).__name__}")
    key = str(value)
    if not key:
        raise ValueError(f"Cannot enqueue {job_name}: its {option} is empty")
    return shorten_key(key)


def shorten_key(key: str) -> str:
    """``key`` if it fits a key column, else its start and the SHA-256 of the whole."""
    if len(key) <= KEY_MAX_LENGTH:
        return key
    digest = hashlib.sha256(key.encode()).hexdigest()
    return f"{key[: KEY_MAX_LENGTH - len(digest) - 1]}#{digest}"


# The numbered columns' (lowest, highest or None), as the CHECK ``dbqueue_job_bounds`` holds them
# (migration 0014) and every row builder checks first: the worker relies on each (a negative
# timeout would end its process, a retry_after below 1 reclaim a running job, ...).
ROW_BOUNDS: dict[str, tuple[int, int | None]] = {
    "priority": (MIN_PRIORITY, MAX_PRIORITY),
    "attempts": (0, None),
    "given_back": (0, None),
    "cancel": (0, 2),
    "exceptions": (0, None),
    "max_tries": (0, None),
    "retry_after": (1, None),
    "timeout": (0, None),
    "concurrency_limit": (1, None),
}
# The columns of ROW_BOUNDS that may be NULL (the worker's default applies).
NULLABLE_BOUNDS = frozenset({"max_tries", "timeout", "concurrency_limit"})
# The highest value each kind of column can hold (the database refuses more).
_TYPE_MAX = {"priority": 32767, "cancel": 32767, "max_tries": MAX_TRIES, "concurrency_limit": MAX_TRIES}


# The text columns of a job row a stored step fills, and their longest value (Job's max_length).
TEXT_BOUNDS = {"name": 200, "unique_key": KEY_MAX_LENGTH, "concurrency_key": KEY_MAX_LENGTH, "rate_key": KEY_MAX_LENGTH}


def _size(text: Any) -> str:
    return f"{len(text)} characters" if isinstance(text, str) else f"a {type(text).__name__}"


def row_error(values: Any) -> str | None:
    """Why a job row with these column values (a mapping; missing columns unchecked) cannot be stored, or None."""
    for column, (low, high) in ROW_BOUNDS.items():
        if column not in values:
            continue
        value = values[column]
        if value is None and column in NULLABLE_BOUNDS:
            continue
        top = high if high is not None else _TYPE_MAX.get(column, MAX_SECONDS)
        if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= top:
            return f"{column} must be a whole number from {low} to {top}, not {value!r}"
    if "queue" in values:
        error = queue_name_error(values["queue"])
        if error is not None:
            return error
    for column, longest in TEXT_BOUNDS.items():
        if column not in values or (values[column] is None and column != "name"):
            continue
        text, shortest = values[column], 1 if column == "name" else 0
        if not isinstance(text, str) or not shortest <= len(text) <= longest:
            return f"{column} must be a str of {shortest} to {longest} characters, not {_size(text)}"
    rate = values.get("rate_limit")
    if rate is not None:
        try:
            rate_parts(rate)
        except ValueError as exc:
            return str(exc)
    return None


# A stored rate limit (``Job.rate_limit``): ``count/seconds/burst`` (rates.Rate.text).
_RATE_TEXT = re.compile(r"^([1-9][0-9]*)/([0-9]+(?:\.[0-9]+)?(?:e[+-]?[0-9]+)?)/([1-9][0-9]*)$")


def rate_parts(text: Any) -> tuple[int, float, int]:
    """The ``(count, seconds, burst)`` of a stored rate limit; raise ValueError saying why it cannot be read."""
    match = _RATE_TEXT.match(text) if isinstance(text, str) else None
    seconds = float(match[2]) if match else 0.0
    if match is None or not 0 < seconds < float(MAX_SECONDS):
        raise ValueError(
            f"rate_limit must be stored as 'count/seconds/burst' with each above 0 (such as '100/60/10'), not {text!r}"
        )
    return int(match[1]), seconds, int(match[3])


class Definition(Protocol):
    """What the option modules (unique, concurrency, rates) read of a ``registry.JobDefinition``."""

    @property
    def name(self) -> str: ...
    @property
    def func(self) -> Callable[..., Any]: ...
    @property
    def takes_context(self) -> bool: ...
    @property
    def unique(self) -> bool | str: ...
    @property
    def unique_key(self) -> str | Callable[..., Any] | None: ...
    @property
    def unique_for(self) -> float | None: ...
    @property
    def concurrency_key(self) -> str | Callable[..., Any] | None: ...
    @property
    def concurrency_limit(self) -> int | None: ...
    @property
    def rate_limit(self) -> str | None: ...
    @property
    def rate_key(self) -> str | Callable[..., Any] | None: ...
    @property
    def rate_burst(self) -> int | None: ...


# -- a call's arguments against its function's parameters -------------------------


class CallShape:
    """What a function's parameters accept, read once from its ``inspect.Signature``, so that an
    enqueue checks its arguments with a few comparisons (``Signature.bind`` costs microseconds)."""

    __slots__ = (
        "index",
        "keywords",
        "least",
        "most",
        "positional_only",
        "required",
        "required_keywords",
        "signature",
        "var_kwargs",
    )

    def __init__(self, signature: inspect.Signature) -> None:
        kind = inspect.Parameter
        params = list(signature.parameters.values())
        positional = [p for p in params if p.kind in (kind.POSITIONAL_ONLY, kind.POSITIONAL_OR_KEYWORD)]
        self.signature = signature
        self.index = {p.name: i for i, p in enumerate(positional)}
        self.positional_only = frozenset(p.name for p in positional if p.kind is kind.POSITIONAL_ONLY)
        # A Signature keeps the positional parameters with defaults after those without.
        self.required = tuple(p.name for p in positional if p.default is kind.empty)
        self.required_keywords = tuple(
            p.name for p in params if p.kind is kind.KEYWORD_ONLY and p.default is kind.empty
        )
        self.keywords = frozenset(p.name for p in params if p.kind in (kind.POSITIONAL_OR_KEYWORD, kind.KEYWORD_ONLY))
        # The fewest and the most positional arguments a call without keywords may pass (-1: keywords are needed).
        self.least = -1 if self.required_keywords else len(self.required)
        self.most = sys.maxsize if any(p.kind is kind.VAR_POSITIONAL for p in params) else len(positional)
        self.var_kwargs = any(p.kind is kind.VAR_KEYWORD for p in params)

    def error(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str | None:
        """Why calling with ``args`` and ``kwargs`` would raise TypeError, or None if it would not."""
        given = len(args)
        if not kwargs and 0 <= self.least <= given <= self.most:
            return None  # the common call: enough positional arguments, no keywords
        problem = self._problem(given, kwargs)
        return None if problem is None else f"{problem}; its parameters are {self.described()}"

    def _problem(self, given: int, kwargs: dict[str, Any]) -> str | None:
        if given > self.most:
            return f"too many positional arguments: {given} given, it takes {self.most or 'none'}"
        for key in kwargs:
            if key in self.keywords:
                if self.index.get(key, given) < given:
                    return f"multiple values for the argument {key!r}, by position and by keyword"
            elif key in self.positional_only:
                if not self.var_kwargs:
                    return f"the argument {key!r} is positional-only, but was passed by keyword"
            elif not self.var_kwargs:
                close = difflib.get_close_matches(key, sorted(self.keywords), n=1)
                return f"an unexpected keyword argument {key!r}" + (f" (did you mean {close[0]!r}?)" if close else "")
        missing = [name for name in self.required[given:] if name in self.positional_only or name not in kwargs]
        missing += [name for name in self.required_keywords if name not in kwargs]
        if not missing:
            return None
        names = " and ".join(", ".join(map(repr, missing)).rsplit(", ", 1))
        return f"missing the required argument{'s' if len(missing) > 1 else ''} {names}"

    def described(self) -> str:
        """The parameters as declared, without annotations: ``(order_id, *, resend=False)``."""
        empty = inspect.Parameter.empty
        return str(inspect.Signature([p.replace(annotation=empty) for p in self.signature.parameters.values()]))


# Per (function, takes_context): its shape, or None if it has no signature to read (some builtins).
_shapes: dict[tuple[Callable[..., Any], bool], CallShape | None] = {}
_UNREAD = object()


def call_shape(func: Callable[..., Any], takes_context: bool = False) -> CallShape | None:
    """The parameters a caller passes to ``func`` (without the context a ``takes_context`` job takes first)."""
    key = (func, takes_context)
    try:
        shape = _shapes.get(key, _UNREAD)
    except TypeError:  # an unhashable callable: read each time
        shape = _UNREAD
    if shape is not _UNREAD:
        return shape  # type: ignore[return-value]
    try:
        signature = inspect.signature(func)
    except (TypeError, ValueError):
        shape = None
    else:
        params = list(signature.parameters.values())
        first = params[0].kind if params else None
        if takes_context and first in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD):
            signature = signature.replace(parameters=params[1:])
        shape = CallShape(signature)
    with contextlib.suppress(TypeError):  # an unhashable callable is read again next time
        _shapes[key] = shape
    return shape


def call_error(
    func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], *, takes_context: bool = False
) -> str | None:
    """Why ``func`` (a ``takes_context`` job's, without its context) cannot take these arguments, or None."""
    shape = call_shape(func, takes_context)
    return None if shape is None else shape.error(args, kwargs)


def check_call(
    name: str, func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], *, takes_context: bool = False
) -> None:
    """Raise TypeError naming job ``name`` and the parameter if ``func`` cannot take these arguments."""
    shape = call_shape(func, takes_context)
    error = None if shape is None else shape.error(args, kwargs)
    if error is not None:
        raise TypeError(f"Cannot enqueue {name}: {error}")
