"""Concurrency limits: at most ``concurrency_limit`` running jobs per ``concurrency_key``.

A job row carries its key and its limit. A claim that meets rows with keys
locks each key's ``FlowLimit`` row (in key order), counts the key's reserved
rows, and takes a row only while that count is under the limit; so two
claims of one key, on any workers and hosts, take turns, and the count they
read is exact. When a key is saturated, the claim *blocks* the key's waiting
rows (``blocked = true``): claims no longer read them (the waiting index on
PostgreSQL leaves them out).

The module is imported by ``registry`` (options, keys) before the app registry
is ready, so its claim side imports the models where it uses them. A transaction that ends a reservation of a keyed
job (success, failure, release, reclaim) locks the key's row too and unblocks
as many of its rows as there are free slots, so a slot never stays free while
a row waits blocked; idle workers also sweep blocked keys now and then
(``sweep``), in case a limit was raised in code.

A reserved row holds its slot until its reservation ends: a worker killed
with ``kill -9`` holds it until the row is reclaimed (at once by a
``--concurrency`` supervisor, else ``retry_after`` after the reservation's
last heartbeat).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any

from django.db import transaction
from django.db.models import Count, F, Window
from django.db.models.functions import RowNumber

from . import validation
from .db import DbNow, claims_with_skip_locked

if TYPE_CHECKING:
    from .models import Job
    from .registry import JobDefinition

# A key's FlowLimit row.
PREFIX = "concurrency:"
# Largest concurrency_limit (a SmallIntegerField).
MAX_LIMIT = 32767
# Rows changed per statement when blocking the rows of saturated keys.
CHUNK = 500


def options_error(definition: JobDefinition[..., Any]) -> str | None:
    """Why the concurrency options of ``definition`` are wrong, or None."""
    key, limit = definition.concurrency_key, definition.concurrency_limit
    if key is not None and not (callable(key) or (isinstance(key, str) and key)):
        return f"concurrency_key must be a non-empty str or a callable of the job's arguments, not {key!r}"
    if limit is not None:
        if isinstance(limit, bool) or not isinstance(limit, int) or not 1 <= limit <= MAX_LIMIT:
            return f"concurrency_limit must be a whole number from 1 to {MAX_LIMIT}, not {limit!r}"
    return None


def step_values(definition: JobDefinition[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
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


class Slots:
    """The running count of each key of some candidate rows, read under the keys' locks."""

    def __init__(self, running: dict[str, int]) -> None:
        self.running = running

    @classmethod
    def lock(cls, using: str, rows: Sequence[Job]) -> Slots:
        from .models import FlowLimit

        keys = sorted({row.concurrency_key for row in rows if row.concurrency_key})
        if not keys:
            return cls({})
        FlowLimit.objects.db_manager(using).lock([limit_key(key) for key in keys])
        return cls(_running(using, keys))

    def free(self, row: Job) -> bool:
        assert row.concurrency_key
        return self.running.get(row.concurrency_key, 0) < (row.concurrency_limit or 1)

    def take(self, row: Job) -> None:
        assert row.concurrency_key
        self.running[row.concurrency_key] = self.running.get(row.concurrency_key, 0) + 1


def _running(using: str, keys: Sequence[str]) -> dict[str, int]:
    from .models import Job

    rows = (
        Job.objects.using(using)
        .filter(concurrency_key__in=keys, reserved_at__isnull=False)
        .order_by()
        .values_list("concurrency_key")
        .annotate(n=Count("id"))
    )
    return {key: n for key, n in rows}


def block(using: str, keys: Iterable[str]) -> int:
    """Block the waiting rows of saturated ``keys`` (called under their locks); return how many.

    Rows another claim has locked are skipped: that claim decides for them.
    """
    from .models import Job

    keys = sorted(set(keys))
    if not keys:
        return 0
    waiting = Job.objects.using(using).filter(
        concurrency_key__in=keys, reserved_at__isnull=True, blocked=False, available_at__lte=DbNow()
    )
    if claims_with_skip_locked(using):
        waiting = waiting.select_for_update(skip_locked=True)
    ids = list(waiting.values_list("pk", flat=True))
    for start in range(0, len(ids), CHUNK):
        Job.objects.using(using).filter(pk__in=ids[start : start + CHUNK]).update(blocked=True)
    return len(ids)


def unblock(using: str, keys: Iterable[str]) -> int:
    """Unblock as many rows of each key as it has free slots; return how many.

    Called in the transaction that ends reservations of these keys, after the
    change: the lock on each key's row makes it wait for a claim that is
    blocking the key's rows, so the rows that claim blocks are seen here.
    """
    from .models import FlowLimit, Job

    keys = sorted({key for key in keys if key})
    if not keys:
        return 0
    with transaction.atomic(using=using):
        FlowLimit.objects.db_manager(using).lock([limit_key(key) for key in keys])
        running = _running(using, keys)
        blocked = Job.objects.using(using).filter(concurrency_key__in=keys, blocked=True)
        limits = dict(blocked.order_by().values_list("concurrency_key", "concurrency_limit").distinct())
        free = {key: (limit or 1) - running.get(key, 0) for key, limit in limits.items() if key}
        free = {key: count for key, count in free.items() if count > 0}
        if not free:
            return 0
        # The first rows of each key with room, in claim order: ranked per key.
        order = [F("priority").desc(), F("available_at").asc(), F("id").asc()]
        ranked = (
            blocked.filter(concurrency_key__in=list(free))
            .annotate(rank=Window(RowNumber(), partition_by=F("concurrency_key"), order_by=order))
            .filter(rank__lte=max(free.values()))
            .values_list("pk", "concurrency_key", "rank")
        )
        ids = [pk for pk, key, rank in ranked if key and rank <= free[key]]
        unblocked = Job.objects.using(using).filter(pk__in=ids, blocked=True).update(blocked=False)
    return unblocked


def sweep(using: str) -> int:
    """Unblock the rows of every blocked key that has free slots (idle workers, now and then)."""
    from .models import Job

    keys = (
        Job.objects.using(using)
        .filter(concurrency_key__isnull=False, blocked=True)
        .order_by()
        .values_list("concurrency_key", flat=True)
        .distinct()
    )
    return unblock(using, [key for key in keys if key])


# Seconds between two sweeps by the idle workers of one process.
SWEEP_INTERVAL = 10.0
_last_sweep = 0.0


def sweep_now_and_then(using: str) -> int:
    """``sweep`` at most every SWEEP_INTERVAL seconds per process; return how many rows it unblocked."""
    global _last_sweep
    now = time.monotonic()
    if now - _last_sweep < SWEEP_INTERVAL:
        return 0
    _last_sweep = now
    return sweep(using)
