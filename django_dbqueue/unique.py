"""Unique jobs: at most one job row per unique key, enforced by a unique index on ``Job.unique_key``.

A call is keyed by its job name and arguments (or ``unique_key``); its row holds the key until it
ends ("until_finished") or is claimed ("until_started"). ``unique_for`` adds a window: no other job
of the key for that long after an enqueue (``Window``; ``enqueue`` locks its rows). docs/unique.md.
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import json
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

from . import payload, validation
from .validation import Definition

UNTIL_FINISHED = "until_finished"
UNTIL_STARTED = "until_started"
SCOPES = (UNTIL_FINISHED, UNTIL_STARTED)


def scope(definition: Definition) -> str | None:
    """The scope of the job's key: UNTIL_FINISHED, UNTIL_STARTED, or None (not unique)."""
    if definition.unique is True or (definition.unique is False and definition.unique_key is not None):
        return UNTIL_FINISHED
    if definition.unique in SCOPES:
        return str(definition.unique)
    return None


def options_error(definition: Definition) -> str | None:
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


def key_of(definition: Definition, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
    """The stored key of one call: the job's name, then its ``unique_key`` or a hash of its arguments
    bound to the parameters, defaults included (``f(1)`` and ``f(x=1)`` are one call)."""
    given: str | Callable[..., Any] | None = definition.unique_key
    if given is None:
        encoded = payload.encode_arguments(*_bound(definition, args, kwargs))
        text = json.dumps(encoded, sort_keys=True, separators=(",", ":"))
        given = hashlib.sha256(text.encode()).hexdigest()
    key = validation.flow_key(definition.name, "unique_key", given, args, kwargs)
    return validation.shorten_key(f"{definition.name}:{key}")


def _bound(
    definition: Definition, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The call as ``((), {parameter: value})`` with defaults applied; as given if it does
    not fit the function's signature (it will fail when it runs, as any such call)."""
    signature = _signature(definition.func, definition.takes_context)
    if signature is None:
        return args, kwargs
    try:
        bound = signature.bind(*args, **kwargs)
    except TypeError:
        return args, kwargs
    bound.apply_defaults()
    return (), dict(bound.arguments)


@functools.cache
def _signature(func: Callable[..., Any], takes_context: bool) -> inspect.Signature | None:
    """The parameters a caller passes (without the context of a ``takes_context`` job)."""
    try:
        signature = inspect.signature(func)
    except (TypeError, ValueError):
        return None
    if takes_context:
        signature = signature.replace(parameters=list(signature.parameters.values())[1:])
    return signature


def step_values(definition: Definition, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
    """The unique columns of one call (none if the job is not unique)."""
    held = scope(definition)
    if held is None:
        return {}
    values: dict[str, Any] = {"unique_key": key_of(definition, args, kwargs)}
    if held == UNTIL_STARTED:
        values["unique_until_start"] = True
    return values


class Window(NamedTuple):
    """The ``unique_for`` window a call asks for: its key and length."""

    key: str
    seconds: float


def window_of(
    definition: Definition, flow: Mapping[str, Any] | None, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Window | None:
    """The window of one call, or None; the key is the row's unique key if it has one
    (so a ``unique_key`` callable is called once per enqueue)."""
    if definition.unique_for is None:
        return None
    key = (flow or {}).get("unique_key") or key_of(definition, args, kwargs)
    return Window(str(key), float(definition.unique_for))
