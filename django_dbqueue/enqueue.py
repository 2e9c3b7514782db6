"""Enqueue: store calls as job rows, one or many, and return their handles.

``JobCall.enqueue`` reaches this module lazily (as Django's ``Task.enqueue`` finds its backend).
A call becomes a row in ``rows``, inserted by ``insert``; a unique job whose key is held stores
nothing, and its handle is the holder's. A ``unique_for`` window is a ``UniqueWindow`` row locked
by the enqueue's transaction, moved on when a job is enqueued, pruned once expired (docs/unique.md).
"""

from __future__ import annotations

import itertools
import logging
import random
import time
from collections.abc import Callable, Collection, Iterable, Iterator, Sequence
from contextlib import nullcontext
from datetime import UTC, datetime, timedelta
from typing import Any, Literal, NamedTuple, cast, overload

from django.core.exceptions import ImproperlyConfigured
from django.db import DatabaseError, OperationalError, connections, transaction

from . import conf, db, signals, tracing, workflows
from .handles import JobHandle
from .insert import (
    Held,
    Row,
    Stream,
    analyze_if_large,
    first_holds,
    insert_batch,
    insert_many,
    insert_one,
    insert_row,
    insert_rows,
    is_deadlock,
)
from .models import Job, UniqueWindow
from .registry import Handle, JobCall, JobDefinition
from .rows import NewJob, Plain, prepare
from .unique import Window

logger = logging.getLogger("django_dbqueue")

Prepared = tuple[NewJob, Window | None]

# Runs of an enqueue of unique jobs in its own transaction that the database ends to break a
# deadlock, each after a short random pause so the enqueues that met do not meet again.
DEADLOCK_ATTEMPTS = 5
DEADLOCK_PAUSE = 0.05

# Immediate mode (``DBQUEUE["IMMEDIATE"]``, for tests): called by ``store_all`` with the queues of
# the jobs it stored, it runs them once their enqueue commits. ``django_dbqueue.testing`` sets it
# (it runs a worker, which this module must not import); fast paths step aside for ``store_all``.
_run_stored: Callable[[set[str]], None] | None = None


def run_stored_with(runner: Callable[[set[str]], None]) -> None:
    """Make ``runner`` run the jobs ``store_all`` stores while ``DBQUEUE["IMMEDIATE"]`` is on."""
    global _run_stored
    _run_stored = runner


def immediate() -> bool:
    """Tell whether immediate mode is on (every enqueue then goes through ``store_all``)."""
    return bool(conf.get("IMMEDIATE"))


def enqueue_call(call: JobCall, *, depends_on: Sequence[Any] = ()) -> Handle:
    """``JobCall.enqueue``: store the call (and what follows it) and return its handle."""
    if depends_on:
        return workflows.enqueue_after(depends_on, call)
    plain = None
    if not call.callbacks and call.failure_callback is None and not (tracing.enabled and tracing.carries()):
        plain = None if immediate() else Plain.cached(call.definition)
    if plain is None:
        return store(*prepare(call))
    # Nothing for store_all to lock, skip or run again; on PostgreSQL the Job is built only if asked for.
    new = plain.new_job(call.args, call.kwargs)
    row = insert_row(new, db.alias())
    if row is None or signals.job_enqueued.has_listeners(JobDefinition):
        return handles_of([insert_one(new) if row is None else row.job()])[0]
    logger.debug("enqueued job=%s id=%s queue=%s", new.name, row.pk, new.queue)
    return JobHandle.from_row(row)


def store(new: NewJob, window: Window | None = None) -> Handle:
    """Store one prepared job as ``JobCall.enqueue`` does (a chain's first step)."""
    return handles_of(store_all([(new, window)], one=True))[0]


@overload
def enqueue_many(
    calls: Iterable[JobCall], *, batch_size: int = 1000, handles: Literal[True] = True
) -> list[Handle]: ...


@overload
def enqueue_many(calls: Iterable[JobCall], *, batch_size: int = 1000, handles: Literal[False]) -> int: ...


def enqueue_many(calls: Iterable[JobCall], *, batch_size: int = 1000, handles: bool = True) -> list[Handle] | int:
    """Store many calls, ``batch_size`` rows per statement, in one transaction; return their handles.

    Any iterable is read a batch at a time, each checked and sent before the next is read (a list
    is checked whole first); ``handles=False`` returns the count. A call that
    cannot be stored raises with ``exc.position`` and "call N of enqueue_many" (docs/enqueue.md).
    """
    if batch_size < 1:
        raise ValueError("batch_size must be at least 1")
    using = db.alias()
    connection = connections[using]
    kept: list[Handle] = []
    stored = 0
    # Rows counted, not read back: not for handles, job_enqueued's receivers, or the immediate mode.
    counting = not handles and not signals.job_enqueued.has_listeners(JobDefinition) and not immediate()
    ready = None
    if isinstance(calls, Sequence):
        # Checked whole before anything is sent, and stored as one enqueue (run again after a deadlock).
        ready = prepare_all(calls, 0)
        if any(window or new.unique_key for new, window in ready):
            outcomes = store_all(ready, batch_size=batch_size)
            return handles_of(outcomes) if handles else _announce(outcomes)
    chunks: Iterator[Sequence[Any]] = itertools.batched(calls if ready is None else ready, batch_size)
    first = next(chunks, None)
    if first is None:
        return [] if handles else 0
    second = next(chunks, None)
    # Several batches are one transaction: the caller's if open, else our own (one batch needs none).
    own = second is not None and not connection.in_atomic_block

    def deliver(outcomes: Sequence[Job | Held]) -> None:
        nonlocal stored
        if handles:
            kept.extend(handles_of(outcomes))
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
        transaction.atomic(using=using, savepoint=False) if own else nullcontext(),
        Stream(connection, using) if in_transaction and not immediate() else nullcontext() as stream,
    ):
        calls_read = 0
        for chunk in itertools.chain((first,), () if second is None else (second,), chunks):
            prepared = prepare_all(chunk, calls_read) if ready is None else chunk
            calls_read += len(chunk)
            plain = not any(window or new.unique_key for new, window in prepared)
            if counting and plain and connection.vendor != "postgresql":
                stored += insert_rows(connection, [new for new, _ in prepared])
            elif stream is not None and stream.usable and plain:
                # Read back once the next is sent: the server inserts this batch while the next is prepared.
                deliver_rows(stream.send([new for new, _ in prepared]))
            elif stream is None and plain and connection.vendor == "postgresql" and not immediate():
                # The one batch outside a transaction: one statement, a transaction of its own.
                deliver_rows(insert_batch(connection, using, [new for new, _ in prepared]))
            else:
                if stream is not None:
                    deliver_rows(stream.flush())
                deliver(store_all(prepared, batch_size=batch_size, analyze=False))
        if stream is not None:
            deliver_rows(stream.flush())
    analyze_if_large(using, calls_read)
    return kept if handles else stored


def prepare_all(calls: Sequence[JobCall], first: int) -> list[Prepared]:
    """``rows.prepare`` of each call (of a plain one, only its arguments are encoded); an error
    names the call's position (``first`` + its index)."""
    prepared: list[Prepared] = []
    trace = tracing.enabled and tracing.carries()
    checked: set[tuple[str, str]] = set()
    for call in calls:
        try:
            plain = None
            if not trace and not call.callbacks and call.failure_callback is None:
                plain = Plain.cached(call.definition)
            if plain is None:
                prepared.append(prepare(call, trace=trace, checked=checked))
            else:
                prepared.append((plain.new_job(call.args, call.kwargs), None))
        except Exception as exc:
            position = first + len(prepared)
            if exc.args and isinstance(exc.args[0], str):
                exc.args = (f"call {position + 1:,} of enqueue_many (index {position}): {exc.args[0]}", *exc.args[1:])
            exc.position = position  # type: ignore[attr-defined]
            raise
    return prepared


def store_all(
    prepared: Sequence[Prepared], *, batch_size: int = 1000, one: bool = False, analyze: bool = True
) -> list[Job | Held]:
    """Insert the new jobs; those whose key or window is held come back ``Held``. Unique jobs outside
    a transaction are stored in one of their own, run again after a deadlock (inside the caller's,
    the error reaches it: the database ended its whole transaction)."""
    outcomes = _store_retried(prepared, batch_size, one, analyze)
    if immediate():
        if _run_stored is None:
            raise ImproperlyConfigured(
                "DBQUEUE['IMMEDIATE'] is on, but nothing runs the jobs: django_dbqueue.testing was not "
                "imported (import it in the tests' conftest.py or a test module, or use its pytest plugin)"
            )
        queues = {new.queue for (new, _), stored in zip(prepared, outcomes, strict=True) if isinstance(stored, Job)}
        if queues:
            _run_stored(queues)
    return outcomes


def _store_retried(prepared: Sequence[Prepared], batch_size: int, one: bool, analyze: bool) -> list[Job | Held]:
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


def _store_once(prepared: Sequence[Prepared], batch_size: int, one: bool, analyze: bool = True) -> list[Job | Held]:
    """``store_all`` once; a transaction that locks the window rows first leaves out a job whose window
    is open, and opens the windows of the jobs inserted."""

    def insert_all(news: Sequence[NewJob]) -> list[Job | Held]:
        return [insert_one(news[0])] if one else insert_many(news, batch_size=batch_size, analyze=analyze)

    if not any(window for _, window in prepared):
        return insert_all([new for new, _ in prepared])
    with transaction.atomic(using=db.alias(), savepoint=False):
        locked = lock_windows({window.key for _, window in prepared if window})
        keys = [window.key if window else None for _, window in prepared]
        results: list[Job | Held | None] = [None] * len(prepared)
        todo: list[int] = []
        seen: set[str | None] = set()
        for index, key in enumerate(keys):
            if key is not None and key in locked.open:
                results[index] = Held(key, locked.open[key])
            elif key is None or key not in seen:
                todo.append(index)
                seen.add(key)
        stored = insert_all([prepared[index][0] for index in todo]) if todo else []
        for index, outcome in zip(todo, stored, strict=True):
            results[index] = outcome
        outcomes = first_holds(keys, results)  # a later call of a window shares the first one's fate
        opened = [(w, job.pk) for (_, w), job in zip(prepared, outcomes, strict=True) if w and isinstance(job, Job)]
        open_windows(opened, locked.now)
    return outcomes


def handles_of(outcomes: Sequence[Job | Held]) -> list[Handle]:
    """The handles of stored jobs and of those left out; ``job_enqueued`` for the stored ones only."""
    _announce(outcomes)
    held = [outcome for outcome in outcomes if isinstance(outcome, Held)]
    if not held:
        jobs = cast("list[Job]", outcomes)
        if len(jobs) == 1:
            logger.debug("enqueued job=%s id=%s queue=%s", jobs[0].name, jobs[0].pk, jobs[0].queue)
        return [JobHandle.from_job(job) for job in jobs]
    duplicates = iter(JobHandle.not_enqueued([outcome.job_id for outcome in held]))
    handles: list[Handle] = []
    for outcome in outcomes:
        if isinstance(outcome, Held):
            handles.append(next(duplicates))
            logger.debug("not enqueued, unique key held key=%s by_id=%s", outcome.key, outcome.job_id)
        else:
            handles.append(JobHandle.from_job(outcome))
    return handles


def _announce(outcomes: Sequence[Job | Held]) -> int:
    """Send ``job_enqueued`` for each stored job (not for those left out); return how many were stored."""
    stored = [outcome for outcome in outcomes if not isinstance(outcome, Held)]
    if signals.job_enqueued.has_listeners(JobDefinition):
        for job in stored:
            signals.job_enqueued.send_robust(sender=JobDefinition, job=job)
    return len(stored)


# -- unique windows (``unique_for``) -------------------------------------------

# The time a window row is created with: already over, so the transaction that
# created it takes it over like any expired one.
_EXPIRED = datetime(2000, 1, 1, tzinfo=UTC)


class LockedWindows(NamedTuple):
    """Window rows locked by the current transaction: the open ones, with the job each
    was opened for, and the database's clock when they were read."""

    open: dict[str, int | None]
    now: datetime


def lock_windows(keys: Collection[str]) -> LockedWindows:
    """Lock the window rows of ``keys`` until the transaction ends (creating missing ones, expired),
    in key order, so enqueues that lock several never wait in a circle. On MariaDB/MySQL ``ON
    DUPLICATE KEY UPDATE`` takes the exclusive lock at once (``INSERT IGNORE``'s shared one deadlocks)."""
    using = db.alias()
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
            .annotate(clock=db.DbNow())
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
    if not opened:
        return
    using = db.alias()
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
        logger.warning("prune of unique windows failed: %s", db.error_text(exc))
        return
    if count:
        logger.debug("pruned unique_windows=%s", count)


def prune_windows(limit: int = 1000) -> int:
    """Delete up to ``limit`` expired window rows that no enqueue holds (``SKIP LOCKED``); return how many."""

    using = db.alias()
    manager = UniqueWindow.objects.db_manager(using)
    with transaction.atomic(using=using):
        expired = manager.filter(expires_at__lt=db.DbNow()).order_by("pk")
        if db.claims_with_skip_locked(using):
            expired = expired.select_for_update(skip_locked=True)
        ids = list(expired.values_list("pk", flat=True)[:limit])
        if not ids:
            return 0
        deleted, _ = manager.filter(pk__in=ids, expires_at__lt=db.DbNow()).delete()
    return deleted
