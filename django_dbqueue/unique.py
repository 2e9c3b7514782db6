"""Unique jobs: at most one job row per unique key, enforced by a unique index.

``@job(unique=True)`` keys a call by its job name and arguments (or by
``unique_key``); the row holds the key while it waits, is delayed or runs
("until_finished", the default), or only until a worker claims it
("until_started": the claim statement sets the key to NULL). The key is freed
when the row is deleted (success) or moves to ``FailedJob``. The index is
unique on ``Job.unique_key`` (partial, NULLs left out, on PostgreSQL and
SQLite), so two enqueues of one key in two transactions cannot both commit;
``bulk.insert`` leaves out a job whose key is held (``bulk.Held``).

``@job(unique_for=seconds)`` adds a window: once a job of the key is enqueued,
no other is for that long, whatever became of the first. A window is a
``UniqueWindow`` row, unique on its key, locked by the enqueue's transaction
(``lock_windows``) and moved on when a job is enqueued (``open_windows``); an
expired row is taken over, and expired rows nobody takes over are pruned now
and then (``prune_windows``). See docs/unique.md.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import inspect
import json
import logging
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any, NamedTuple

from django.db import DatabaseError, connections, transaction

from . import payload, validation
from .db import DbNow, alias, claims_with_skip_locked, error_text

if TYPE_CHECKING:
    from .registry import JobDefinition

logger = logging.getLogger("django_dbqueue")

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
    """The stored key of one call: the job's name, then its ``unique_key`` or a hash of its arguments.

    The arguments are first bound to the function's parameters, defaults
    included, so ``f(1)``, ``f(x=1)`` and ``f(1, y=<y's default>)`` are one call.
    """
    given: str | Callable[..., Any] | None = definition.unique_key
    if given is None:
        encoded = payload.encode_arguments(*_bound(definition, args, kwargs))
        text = json.dumps(encoded, sort_keys=True, separators=(",", ":"))
        given = hashlib.sha256(text.encode()).hexdigest()
    key = validation.flow_key(definition.name, "unique_key", given, args, kwargs)
    return validation.shorten_key(f"{definition.name}:{key}")


def _bound(
    definition: JobDefinition[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
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


def step_values(definition: JobDefinition[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
    """The unique columns of one call (none if the job is not unique)."""
    held = scope(definition)
    if held is None:
        return {}
    values: dict[str, Any] = {"unique_key": key_of(definition, args, kwargs)}
    if held == UNTIL_STARTED:
        values["unique_until_start"] = True
    return values


# -- windows (``unique_for``) --------------------------------------------------


class Window(NamedTuple):
    """The ``unique_for`` window a call asks for: its key and length."""

    key: str
    seconds: float


def window_of(
    definition: JobDefinition[..., Any], flow: Mapping[str, Any] | None, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Window | None:
    """The window of one call, or None; the key is the row's unique key if it has one
    (so a ``unique_key`` callable is called once per enqueue)."""
    if definition.unique_for is None:
        return None
    key = (flow or {}).get("unique_key") or key_of(definition, args, kwargs)
    return Window(str(key), float(definition.unique_for))


# The time a window row is created with: already over, so the transaction that
# created it takes it over like any expired one.
_EXPIRED = datetime(2000, 1, 1, tzinfo=UTC)


@dataclasses.dataclass(frozen=True)
class LockedWindows:
    """Window rows locked by the current transaction: the open ones, with the job each
    was opened for, and the database's clock when they were read."""

    open: dict[str, int | None]
    now: datetime


def lock_windows(keys: Collection[str]) -> LockedWindows:
    """Lock the window rows of ``keys`` until the transaction ends (creating missing
    ones, expired), in key order, so enqueues that lock several never wait in a circle.

    Call it inside ``transaction.atomic``. On MariaDB/MySQL the rows are created
    with ``ON DUPLICATE KEY UPDATE``, which takes an existing row's exclusive lock
    at once: ``INSERT IGNORE`` takes a shared one, and two enqueues that then
    both ask for the exclusive lock deadlock.
    """
    from .models import UniqueWindow  # imported late: ``@job`` works before the app registry is ready

    using = alias()
    manager = UniqueWindow.objects.db_manager(using)
    found: dict[str, tuple[int | None, datetime, datetime]] = {}
    missing = sorted(set(keys))
    # A prune may delete an expired row between its creation (a conflict, here) and the
    # lock: create and lock again the keys not found. A locked row is never pruned.
    for _ in range(3):
        rows = [UniqueWindow(key=key, expires_at=_EXPIRED) for key in missing]
        if connections[using].vendor == "mysql":
            manager.bulk_create(rows, update_conflicts=True, update_fields=["key"])
        else:
            manager.bulk_create(rows, ignore_conflicts=True)
        locked = (
            manager.filter(key__in=missing)
            .order_by("key")
            .select_for_update()
            .annotate(clock=DbNow())
            .values_list("key", "job_id", "expires_at", "clock")
        )
        found.update((key, (job_id, expires_at, clock)) for key, job_id, expires_at, clock in locked)
        missing = [key for key in missing if key not in found]
        if not missing:
            break
    else:
        raise RuntimeError(f"the unique window of {missing[0]!r} could not be locked")
    now = max(clock for _, _, clock in found.values())
    return LockedWindows({key: job_id for key, (job_id, expires_at, _) in found.items() if expires_at > now}, now)


def open_windows(opened: Sequence[tuple[Window, int | None]], now: datetime) -> None:
    """Open the windows of jobs just enqueued, from ``now`` (the clock ``lock_windows`` read)."""
    from .models import UniqueWindow

    if not opened:
        return
    using = alias()
    connection = connections[using]
    meta = UniqueWindow._meta
    quote = connection.ops.quote_name
    fields = {field.name: field for field in meta.concrete_fields}
    job_id, expires_at, key = (quote(str(fields[name].column)) for name in ("job_id", "expires_at", "key"))
    # One statement sent for every window (executemany), with the times as values.
    sql = f"UPDATE {quote(meta.db_table)} SET {job_id} = %s, {expires_at} = %s WHERE {key} = %s"
    prepare = fields["expires_at"].get_db_prep_save
    params = [[pk, prepare(now + timedelta(seconds=window.seconds), connection), window.key] for window, pk in opened]
    with connection.cursor() as cursor:
        cursor.executemany(sql, params)
    _prune_later(using)


# Seconds between two prunes of expired windows by one process that opens windows.
PRUNE_INTERVAL = 60.0
_last_prune = -PRUNE_INTERVAL


def _prune_later(using: str) -> None:
    """Prune expired windows once the current transaction commits, at most every ``PRUNE_INTERVAL``."""
    global _last_prune
    if time.monotonic() - _last_prune < PRUNE_INTERVAL:
        return
    _last_prune = time.monotonic()
    transaction.on_commit(_prune_quietly, using=using)


def _prune_quietly() -> None:
    try:
        count = prune_windows()
    except DatabaseError as exc:
        # Expired rows do no harm: the next enqueue of their key takes them over.
        logger.warning("prune of unique windows failed: %s", error_text(exc))
        return
    if count:
        logger.debug("pruned unique_windows=%s", count)


def prune_windows(limit: int = 1000) -> int:
    """Delete up to ``limit`` expired window rows that no enqueue holds; return how many.

    Rows locked by an enqueue are skipped (``SKIP LOCKED``), so a prune never waits
    for one, nor deadlocks with one.
    """
    from .models import UniqueWindow

    using = alias()
    manager = UniqueWindow.objects.db_manager(using)
    with transaction.atomic(using=using):
        expired = manager.filter(expires_at__lt=DbNow()).order_by("pk")
        if claims_with_skip_locked(using):
            expired = expired.select_for_update(skip_locked=True)
        ids = list(expired.values_list("pk", flat=True)[:limit])
        if not ids:
            return 0
        deleted, _ = manager.filter(pk__in=ids, expires_at__lt=DbNow()).delete()
    return deleted
