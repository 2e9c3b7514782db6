"""Bounds and names the queue accepts, shared by enqueue, the commands and the system checks.

The bounds are the columns' own, so a value that passes is never cut or refused
by the database later.
"""

from __future__ import annotations

import re
from typing import Any

# A queue name: letters, digits and ``_ . : -``, starting with a letter or digit;
# no spaces, so a stray space or a typo in a command line is an error, not a new queue.
QUEUE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.:\-]*$")
# The ``queue`` columns are varchar(100).
QUEUE_NAME_MAX_LENGTH = 100
# ``max_tries`` is a PositiveSmallIntegerField.
MAX_TRIES = 32767
# ``retry_after`` and ``timeout`` are PositiveIntegerFields (seconds; 2**31 - 1 on every database).
MAX_SECONDS = 2**31 - 1
# ``priority`` has a check constraint.
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
