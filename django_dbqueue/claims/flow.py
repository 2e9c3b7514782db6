"""The flow claim, for queues whose jobs may use a concurrency key or a rate limit.

One transaction locks the candidates, then the ``FlowLimit`` rows of their keys and buckets
in key order; it reserves what the limits admit, blocks the waiting rows of a saturated key
and moves a row a rate limit holds back to when its bucket has a token (no try spent).
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Iterable, Sequence

from django.db import connections, transaction
from django.db.models import Case, F, Value, When

from .. import rates, validation
from ..concurrency import limit_key
from ..db import claims_with_skip_locked
from ..lifecycle import move_aside, sweep
from ..lifecycle.reactions import running
from ..models import FlowLimit, Job
from .plain import candidates, reserve_locked, reserve_one

# Candidate rows a flow claim reads beyond its limit, for the ones a limit holds back.
FLOW_LOOKAHEAD = 16
# Reads of candidates per flow claim at most (each round blocks or delays what it could not
# take); a claim that runs out of rounds asks its worker to claim again at once.
FLOW_ROUNDS = 32
# Rows changed per statement when blocking the rows of saturated keys.
BLOCK_CHUNK = 500

_hints = threading.local()


def retry_in() -> float | None:
    """Seconds until a job this thread's last claim held back for a rate limit may start; None if none."""
    return getattr(_hints, "seconds", None)


def forget_hint() -> None:
    _hints.seconds = None


def claim_flow(using: str, queue: str, limit: int, worker_id: str) -> list[Job]:
    """Claim up to ``limit`` jobs of ``queue`` within its concurrency and rate limits."""
    with transaction.atomic(using=using):
        _write_first(using)
        queue_rate = rates.queue_rate(queue)
        if queue_rate is not None:
            key = rates.queue_bucket(queue)
            bucket = rates.Bucket(FlowLimit.objects.db_manager(using).lock([key])[key], queue_rate)
            limit = min(limit, bucket.available)
            if limit < 1:
                _hint(bucket.wait())
                return []
        claimed: list[Job] = []
        buckets = rates.Buckets()
        for _ in range(FLOW_ROUNDS):
            taken, held_back = _flow_round(using, queue, limit - len(claimed), worker_id, buckets)
            claimed += taken
            if len(claimed) >= limit or not held_back:
                break
        else:
            _hint(0.0)
        buckets.save()
        _hint(buckets.wait())
        if queue_rate is not None:
            bucket.spend(len(claimed))
    return claimed


def _write_first(using: str) -> None:
    """On SQLite, make the transaction a writer before it reads (as ``BEGIN IMMEDIATE``): one that
    read, then writes, fails at once rather than waits when another writer committed between."""
    connection = connections[using]
    if connection.vendor == "sqlite":
        table = connection.ops.quote_name(FlowLimit._meta.db_table)
        with connection.cursor() as cursor:
            cursor.execute(f"UPDATE {table} SET tokens = tokens WHERE 1 = 0")


def _flow_round(using: str, queue: str, limit: int, worker_id: str, buckets: rates.Buckets) -> tuple[list[Job], int]:
    """Read candidates once; reserve what the limits admit, block or delay the rest; return the
    jobs reserved and how many were held back."""
    selection = candidates(using, queue, limit + FLOW_LOOKAHEAD)
    if claims_with_skip_locked(using):
        selection = selection.select_for_update(skip_locked=True)
    rows = list(selection)
    if not rows:
        return [], 0
    readable = _readable(using, rows)
    moved = len(rows) - len(readable)
    rows = readable
    slots = _lock_slots(using, rows)
    _lock_buckets(using, buckets, rows)
    admitted: list[Job] = []
    saturated: set[str] = set()
    held: list[Job] = []
    for row in rows:
        if len(admitted) == limit:
            break
        key = row.concurrency_key
        if key and slots[key] >= (row.concurrency_limit or 1):
            saturated.add(key)
            continue
        if row.rate_key and not buckets.take(row):
            held.append(row)
            continue
        if key:
            slots[key] += 1
        admitted.append(row)
    if admitted:
        if claims_with_skip_locked(using):
            reserve_locked(using, admitted, worker_id)
        else:
            admitted = [job for job in admitted if reserve_one(using, job, worker_id)]
    # After the reservations: blocking takes the key's rows still waiting.
    block(using, saturated)
    _hold(using, buckets, held)
    # A row moved aside counts as held back: the next round reads the rows after it.
    return admitted, len(saturated) + len(held) + moved


def _readable(using: str, rows: list[Job]) -> list[Job]:
    """The candidates whose flow values the claim can read; the others are moved aside."""
    readable = []
    for row in rows:
        error = validation.row_error({"concurrency_limit": row.concurrency_limit, "rate_limit": row.rate_limit})
        if error is None:
            readable.append(row)
        else:
            move_aside(row, reason=f"the claim cannot read its flow values: {error}", using=using)
    return readable


def _hint(seconds: float | None) -> None:
    if seconds is None:
        return
    current = getattr(_hints, "seconds", None)
    _hints.seconds = seconds if current is None else min(current, seconds)


def _lock_slots(using: str, rows: Sequence[Job]) -> Counter[str]:
    """The reserved rows of each concurrency key of ``rows``, read under the keys' locks."""
    keys = sorted({row.concurrency_key for row in rows if row.concurrency_key})
    if not keys:
        return Counter()
    FlowLimit.objects.db_manager(using).lock([limit_key(key) for key in keys])
    return Counter(running(using, keys))


def block(using: str, keys: Iterable[str]) -> int:
    """Block the waiting rows of saturated ``keys`` (under their locks) that no other claim has
    locked; return how many."""
    keys = sorted(set(keys))
    if not keys:
        return 0
    waiting = Job.objects.db_manager(using).get_queryset().waiting().filter(concurrency_key__in=keys)
    if claims_with_skip_locked(using):
        waiting = waiting.select_for_update(skip_locked=True)
    ids = list(waiting.values_list("pk", flat=True))
    for start in range(0, len(ids), BLOCK_CHUNK):
        Job.objects.using(using).filter(pk__in=ids[start : start + BLOCK_CHUNK]).update(blocked=True)
    return len(ids)


def _lock_buckets(using: str, buckets: rates.Buckets, rows: Sequence[Job]) -> None:
    """Lock the buckets of ``rows`` that this claim has not locked yet, in key order."""
    needed = buckets.needed(rows)
    if needed:
        locked = FlowLimit.objects.db_manager(using).lock([rates.bucket_key(key) for key in needed])
        for key, text in needed.items():
            buckets.add(key, locked[rates.bucket_key(key)], text)


def _hold(using: str, buckets: rates.Buckets, rows: Sequence[Job]) -> None:
    """Move rows their bucket holds back to when it has a token for each, in one UPDATE."""
    if not rows:
        return
    times = buckets.hold_times(rows)
    Job.objects.using(using).filter(pk__in=list(times), reserved_at__isnull=True).update(
        available_at=Case(*(When(pk=pk, then=Value(at)) for pk, at in times.items()), default=F("available_at"))
    )


# Seconds between two sweeps by the idle workers of one process.
SWEEP_INTERVAL = 10.0
_last_sweep = 0.0


def sweep_now_and_then(using: str) -> int:
    """``lifecycle.sweep`` at most every SWEEP_INTERVAL seconds per process; return how many rows it unblocked."""
    global _last_sweep
    now = time.monotonic()
    if now - _last_sweep < SWEEP_INTERVAL:
        return 0
    _last_sweep = now
    return sweep(using)
