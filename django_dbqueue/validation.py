"""Bounds and names the queue accepts, shared by enqueue, the commands and the system checks.

The bounds are the columns' own, so a value that passes is never cut or refused by the database.
"""

from __future__ import annotations

import hashlib
import re
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
