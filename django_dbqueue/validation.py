"""Bounds and names the queue accepts, shared by enqueue, the commands and the system checks.

The bounds are the columns' own, so a value that passes is never cut or refused
by the database later.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Callable
from typing import Any

# A queue name: letters, digits and ``_ . : -``, starting with a letter or digit;
# no spaces, so a stray space or a typo in a command line is an error, not a new queue.
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


# Flow-control keys (unique, concurrency, rate) are varchar(255); a longer one is
# stored as its start and a hash of the whole.
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
