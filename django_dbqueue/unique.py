"""Unique jobs: at most one job row per unique key, enforced by a unique index.

``@job(unique=True)`` keys a call by its job name and arguments (or by
``unique_key``); the row holds the key while it waits, is delayed or runs
("until_finished", the default), or only until a worker claims it
("until_started": the claim statement sets the key to NULL). The key is freed
when the row is deleted (success) or moves to ``FailedJob``. The index is
unique on ``Job.unique_key`` (partial, NULLs left out, on PostgreSQL and
SQLite), so two enqueues of one key in two transactions cannot both commit.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from . import payload, validation

if TYPE_CHECKING:
    from .registry import JobDefinition

UNTIL_FINISHED = "until_finished"
UNTIL_STARTED = "until_started"
SCOPES = (UNTIL_FINISHED, UNTIL_STARTED)


def scope(definition: JobDefinition[..., Any]) -> str | None:
    """The scope of the job's key: UNTIL_FINISHED, UNTIL_STARTED, or None (not unique)."""
    if definition.unique is True or (definition.unique is False and definition.unique_key is not None):
        return UNTIL_FINISHED
    if definition.unique in SCOPES:
        return str(definition.unique)
    return None


def options_error(definition: JobDefinition[..., Any]) -> str | None:
    """Why the unique options of ``definition`` are wrong, or None."""
    if not (isinstance(definition.unique, bool) or definition.unique in SCOPES):
        return f"unique must be True, False, {UNTIL_FINISHED!r} or {UNTIL_STARTED!r}, not {definition.unique!r}"
    key = definition.unique_key
    if key is not None and not (callable(key) or (isinstance(key, str) and key)):
        return f"unique_key must be a non-empty str or a callable of the job's arguments, not {key!r}"
    window = definition.unique_for
    if window is not None and (
        isinstance(window, bool) or not isinstance(window, int | float) or not 0 < window <= validation.MAX_SECONDS
    ):
        return f"unique_for must be seconds from 0 (excluded) to {validation.MAX_SECONDS}, not {window!r}"
    return None


def key_of(definition: JobDefinition[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
    """The stored key of one call: the job's name, then its ``unique_key`` or a hash of its arguments."""
    given: str | Callable[..., Any] | None = definition.unique_key
    if given is None:
        encoded = payload.encode_arguments(args, kwargs)
        text = json.dumps(encoded, sort_keys=True, separators=(",", ":"))
        given = hashlib.sha256(text.encode()).hexdigest()
    key = validation.flow_key(definition.name, "unique_key", given, args, kwargs)
    return validation.shorten_key(f"{definition.name}:{key}")


def step_values(definition: JobDefinition[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
    """The unique columns of one call (none if the job is not unique)."""
    held = scope(definition)
    if held is None:
        return {}
    values: dict[str, Any] = {"unique_key": key_of(definition, args, kwargs)}
    if held == UNTIL_STARTED:
        values["unique_until_start"] = True
    return values
