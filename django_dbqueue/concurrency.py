"""Concurrency limits: at most ``concurrency_limit`` running jobs per ``concurrency_key``.

The options and the keys; no models (``registry`` imports this before the app registry is
ready). The claim's side is ``claims.flow``: it counts a key's reserved rows under the lock
of its ``FlowLimit`` row and blocks the waiting rows of a saturated key; ``lifecycle.unblock``
frees them when a reservation of the key ends.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from . import validation
from .validation import Definition

# A key's FlowLimit row.
PREFIX = "concurrency:"
# Largest concurrency_limit (a SmallIntegerField).
MAX_LIMIT = 32767


def options_error(definition: Definition) -> str | None:
    """Why the concurrency options of ``definition`` are wrong, or None."""
    key, limit = definition.concurrency_key, definition.concurrency_limit
    if key is not None and not (callable(key) or (isinstance(key, str) and key)):
        return f"concurrency_key must be a non-empty str or a callable of the job's arguments, not {key!r}"
    if limit is not None:
        if isinstance(limit, bool) or not isinstance(limit, int) or not 1 <= limit <= MAX_LIMIT:
            return f"concurrency_limit must be a whole number from 1 to {MAX_LIMIT}, not {limit!r}"
    return None


def step_values(definition: Definition, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
    """The concurrency columns of one call (none if the job has no limit)."""
    key: str | Callable[..., Any] | None = definition.concurrency_key
    if key is None and definition.concurrency_limit is None:
        return {}
    if key is None:
        key = definition.name  # a limit alone: on all runs of the job
    return {
        "concurrency_key": validation.flow_key(definition.name, "concurrency_key", key, args, kwargs),
        "concurrency_limit": definition.concurrency_limit or 1,
    }


def limit_key(key: str) -> str:
    """The key of ``key``'s FlowLimit row."""
    return validation.shorten_key(PREFIX + key)
