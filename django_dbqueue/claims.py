"""The claim: the one place that picks the next jobs of a queue and marks them reserved.

A claim takes waiting rows (``reserved_at IS NULL``, ``available_at`` passed,
not ``blocked``) of a queue that is not paused (see ``paused``), in the queue's order (priority,
then ``available_at``, then id), and reserves them: ``attempts + 1``,
``reserved_at`` and ``reserved_by`` set, and a unique key held only until the
start (``unique_until_start``) freed. Two ways, chosen per queue:

- The plain claim, for queues whose jobs use no concurrency key and no rate
  limit: one ``UPDATE ... WHERE id IN (SELECT ... FOR UPDATE SKIP LOCKED)``
  on PostgreSQL; ``SELECT ... FOR UPDATE SKIP LOCKED`` then ``UPDATE`` on
  MariaDB/MySQL; a compare-and-set per row on SQLite.
- The flow claim (``_claim_flow``), for queues that may hold such jobs: one
  transaction that locks the candidate rows, then the ``FlowLimit`` rows of
  their concurrency keys and rate buckets in key order; it reserves what the
  limits admit, blocks the waiting rows of a saturated key
  (``concurrency.block``) and moves a row held back by a rate limit to the
  time its bucket has a token (``rates.hold``). Nothing it holds back spends a
  try.

A queue uses the flow claim once a job definition with a concurrency key or a
rate limit is registered for it, or ``DBQUEUE["RATE_LIMITS"]`` names it; and,
should the plain claim ever reserve such a job (one moved to another queue
with ``using(queue=...)``), from then on: that job is given back unrun.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from django.db import DatabaseError, DataError, IntegrityError, connections, transaction
from django.db.models import Case, F, Value, When

from . import concurrency, rates, validation
from .db import DbNow, bound_cursor, caused_by_lost_connection, claims_with_skip_locked
from .models import FlowLimit, Job, JobQuerySet, PausedQueue, sql_names

logger = logging.getLogger("django_dbqueue")

# Annotation that reads the database's clock into ``Job.db_now`` (a dict, so the
# type checker keeps the attribute declared on the model).
_DB_NOW = {"db_now": DbNow()}

# Candidate rows a flow claim reads beyond its limit, for the ones a limit holds back.
FLOW_LOOKAHEAD = 16
# Reads of candidates per flow claim at most; each round blocks or delays what it
# could not take, so the next round reads other rows. A claim that runs out of
# rounds while still holding rows back asks its worker to claim again at once.
FLOW_ROUNDS = 32

# Queues whose claims take the flow path (see the module's docstring).
_flow_queues: set[str] = set()
_hints = threading.local()


def use_flow_claim(queue: str) -> None:
    """Claim ``queue`` with the flow claim from now on, in this process."""
    _flow_queues.add(queue)


def uses_flow_claim(queue: str) -> bool:
    return queue in _flow_queues or rates.queue_rate(queue) is not None


def retry_in() -> float | None:
    """Seconds until a job this thread's last claim held back for a rate limit may
    start (so an idle worker looks again then, not after its ``--sleep``); None if none."""
    return getattr(_hints, "seconds", None)


def claim(using: str, queues: Sequence[str], limit: int, worker_id: str) -> list[Job]:
    """Claim up to ``limit`` jobs from the first queue of ``queues`` that has any and is not paused."""
    _hints.seconds = None
    skipped = paused(using)
    for queue in queues:
        if queue in skipped:
            continue
        try:
            jobs = claim_queue(using, queue, limit, worker_id)
        except (IntegrityError, DataError) as exc:
            if caused_by_lost_connection(exc, using):
                raise
            # The database refused to reserve a row (one written past its checks):
            # those rows are moved aside and the others claimed one by one.
            jobs = _claim_past_refusals(using, queue, limit, worker_id, exc)
        except DatabaseError:
            raise
        except Exception:
            # Not the database's refusal: something the claim could not read. The
            # rows it can read are failed one by one (``_unreadable``); anything
            # else ends this claim of the queue, never the worker.
            logger.exception("claim failed queue=%s worker_id=%s; the other queues are claimed", queue, worker_id)
            continue
        if jobs:
            return jobs
    return []


# A claim skips the queues paused when this process last read them, and reads
# them again once that read is PAUSE_CHECK seconds old: so no claim that starts
# PAUSE_CHECK seconds after a pause committed takes a job of the queue, on any
# worker. Testing for the pause in every claim statement instead cost a no-op
# drain 7 % (the planning of a subquery on PausedQueue, measured on PostgreSQL).
PAUSE_CHECK = 0.5
_paused: dict[str, tuple[float, frozenset[str]]] = {}
_paused_lock = threading.Lock()
# Bumped by forget_paused: a read that started before it is not kept.
_paused_generation = 0


def paused(using: str) -> frozenset[str]:
    """The paused queues of database ``using``, as read at most ``PAUSE_CHECK`` seconds ago."""
    now = time.monotonic()
    read = _paused.get(using)
    if read is None or now - read[0] >= PAUSE_CHECK:
        generation = _paused_generation
        # The clock is read before the query, so the read is never older than it says.
        read = (now, frozenset(PausedQueue.objects.using(using).values_list("queue", flat=True)))
        with _paused_lock:
            if generation == _paused_generation:
                _paused[using] = read
    return read[1]


def forget_paused(queues: Iterable[str] | None = None) -> None:
    """Read the paused queues again at this process's next claim: after a pause or
    resume made here, or, given ``queues`` (PostgreSQL notifications: a resume sends
    one), if one of them was paused when last read."""
    global _paused_generation
    with _paused_lock:
        if queues is not None:
            named = set(queues)
            if not any(named & read for _, read in _paused.values()):
                return
        _paused_generation += 1
        _paused.clear()


def claim_queue(using: str, queue: str, limit: int, worker_id: str) -> list[Job]:
    """Claim up to ``limit`` jobs of ``queue``, paused or not (``claim`` skips paused queues)."""
    if uses_flow_claim(queue):
        return _claim_flow(using, queue, limit, worker_id)
    if connections[using].vendor == "postgresql":
        jobs = _claim_returning(using, queue, limit, worker_id)
    elif claims_with_skip_locked(using):
        jobs = _claim_locked(using, queue, limit, worker_id)
    else:
        jobs = _claim_cas(using, queue, limit, worker_id)
    return plain_claimed(using, queue, jobs)


def plain_claimed(using: str, queue: str, jobs: list[Job]) -> list[Job]:
    """The jobs a plain claim of ``queue`` may run: one that uses a concurrency key or a
    rate limit is given back unrun, and ``queue`` takes the flow claim from now on.
    A job whose unique key was held only until its start (a statement that did not
    clear it, see ``clears_unique_keys``) has it freed now, before it runs."""
    started = [job.pk for job in jobs if job.unique_until_start and job.unique_key is not None]
    if started:
        Job.objects.get_queryset().using(using).filter(pk__in=started, unique_until_start=True).update(unique_key=None)
        for job in jobs:
            if job.pk in started:
                job.unique_key = None
        if queue not in _clearing:
            clear_unique_keys(queue)
            logger.info("queue=%s holds jobs unique until started: claims free their keys from now on", queue)
    flowed = [job for job in jobs if job.concurrency_key or job.rate_key]
    if not flowed:
        return jobs
    use_flow_claim(queue)
    logger.info("queue=%s holds jobs with concurrency keys or rate limits: claimed with limits from now on", queue)
    for job in flowed:
        Job.objects.release(job, give_back=True)
    return [job for job in jobs if not (job.concurrency_key or job.rate_key)]


# Queues whose plain claims on PostgreSQL free the unique keys of jobs unique
# "until started" in the claim statement: queues that a definition with that
# scope names (the worker says so at start), and any queue whose claim returned
# such a job with its key (``plain_claimed`` frees it then, a statement later).
# Other queues' claims leave the CASE out: it cost a no-op drain about 2 %.
_clearing: set[str] = set()


def clear_unique_keys(queue: str) -> None:
    _clearing.add(queue)


def clears_unique_keys(queue: str) -> bool:
    return queue in _clearing


# -- the plain claim -------------------------------------------------------


def _claim_returning(using: str, queue: str, limit: int, worker_id: str) -> list[Job]:
    """Claim in one statement (PostgreSQL); see ``claim_sql``."""
    connection = connections[using]
    walk = walks(queue)
    sql = claim_sql(connection, walk=walk, clear=clears_unique_keys(queue))
    with bound_cursor(connection) as cursor:
        started = time.monotonic()
        cursor.execute(sql, claim_params(worker_id, queue, limit, walk=walk))
        rows = cursor.fetchall()
        timed(queue, walk, time.monotonic() - started)
        return from_claim(using, rows)


# Which of the two PostgreSQL statements (see ``claim_sql``) a queue's plain
# claims use, measured per queue in this process: each statement keeps a moving
# average of its claims' times (round trip included), claims take the faster,
# and every PROBE_EVERY seconds one claim takes the other to keep its average
# current. A queue starts with the one scan and first tries the walk once the
# scan's average passes SLOW_CLAIM. Where the scan is cheap (nothing delayed in
# front) the walk loses by its planning, about 0.2 ms a claim; where 100,000
# delayed rows sit in front, the scan takes 4.7 ms and the walk 1.0 ms.
SLOW_CLAIM = 0.002
PROBE_EVERY = 10.0
# The weight of a claim's time in its statement's average (a probe's: PROBE_WEIGHT).
WEIGHT = 0.2
PROBE_WEIGHT = 0.5


class _Pick:
    """The two statements' average times for one queue, and when to probe next."""

    __slots__ = ("probe_at", "probing", "scan", "walk")

    def __init__(self) -> None:
        self.scan: float | None = None
        self.walk: float | None = None
        self.probe_at = time.monotonic() + PROBE_EVERY
        self.probing = False

    def faster_is_walk(self) -> bool:
        return self.scan is not None and self.walk is not None and self.walk < self.scan


_picks: dict[str, _Pick] = {}


def walks(queue: str) -> bool:
    """Whether the next plain claim of ``queue`` reads it priority by priority, in this process."""
    pick = _picks.get(queue)
    if pick is None:
        return False
    if pick.walk is None:
        # Never walked yet: try the walk once the scan is slow on average.
        pick.probing = pick.scan is not None and pick.scan > SLOW_CLAIM
        return pick.probing
    now = time.monotonic()
    pick.probing = now >= pick.probe_at
    if pick.probing:
        pick.probe_at = now + PROBE_EVERY
        return not pick.faster_is_walk()
    return pick.faster_is_walk()


def timed(queue: str, walk: bool, seconds: float) -> None:
    """Note how long a plain claim of ``queue`` took, with the walk or the one scan."""
    pick = _picks.get(queue)
    if pick is None:
        pick = _picks[queue] = _Pick()
    average = pick.walk if walk else pick.scan
    if average is not None:
        seconds = average + (PROBE_WEIGHT if pick.probing else WEIGHT) * (seconds - average)
    if walk:
        pick.walk = seconds
    else:
        pick.scan = seconds


def claim_params(worker_id: str, queue: str, limit: int, *, walk: bool = False) -> list[Any]:
    """The parameters of ``claim_sql``, in order."""
    if walk:
        return [worker_id, queue, queue, queue, limit, limit]
    return [worker_id, queue, limit]


def from_claim(using: str, rows: Iterable[Sequence[Any]]) -> list[Job]:
    """Jobs from rows of the claim's RETURNING, in the claim's order (RETURNING has none)."""
    names = [field.attname for field in Job._meta.concrete_fields]
    jobs = [Job.from_db(using, names, row) for row in rows]
    jobs.sort(key=lambda job: (-job.priority, job.available_at, job.pk))
    return jobs


def _waiting(using: str, queue: str) -> JobQuerySet:
    """Rows of ``queue`` a claim may take now."""
    return (
        Job.objects.get_queryset()
        .using(using)
        .filter(queue=queue, reserved_at__isnull=True, blocked=False, available_at__lte=DbNow())
    )


def _candidates(using: str, queue: str, limit: int) -> JobQuerySet:
    # The shape the index ``dbqueue_job_claim`` serves: equality on queue,
    # then the ORDER BY in index order, so LIMIT stops at the first rows.
    return _waiting(using, queue).order_by("-priority", "available_at", "id").annotate(**_DB_NOW)[:limit]


# The claim's changes to a row, for the ORM paths (``claim_sql`` writes the same).
def _reserve_changes(now: Any, worker_id: str) -> dict[str, Any]:
    return {
        "attempts": F("attempts") + 1,
        "reserved_at": now,
        "reserved_by": worker_id,
        "unique_key": Case(When(unique_until_start=True, then=Value(None)), default=F("unique_key")),
    }


def _mark_reserved(jobs: Iterable[Job], now: Any, worker_id: str) -> None:
    for job in jobs:
        job.attempts += 1
        job.reserved_at = now
        job.reserved_by = worker_id
        if job.unique_until_start:
            job.unique_key = None


def _claim_locked(using: str, queue: str, limit: int, worker_id: str) -> list[Job]:
    """Claim with ``SELECT ... FOR UPDATE SKIP LOCKED`` (MariaDB, MySQL)."""
    with transaction.atomic(using=using):
        jobs = list(_candidates(using, queue, limit).select_for_update(skip_locked=True))
        if not jobs:
            return []
        _reserve(using, jobs, worker_id)
    return jobs


def _reserve(using: str, jobs: list[Job], worker_id: str) -> None:
    """Reserve rows this transaction has locked."""
    now = jobs[0].db_now
    Job.objects.using(using).filter(pk__in=[job.pk for job in jobs]).update(**_reserve_changes(now, worker_id))
    _mark_reserved(jobs, now, worker_id)


def _claim_cas(using: str, queue: str, limit: int, worker_id: str) -> list[Job]:
    """Claim by compare-and-set (SQLite: writers are serialised, no row locks)."""
    claimed = []
    for job in _candidates(using, queue, limit):
        try:
            reserved = _reserve_one(using, job, worker_id)
        except (IntegrityError, DataError) as refused:
            # Each row is its own statement here: the rows reserved before stay
            # reserved, so this one is moved aside and the claim goes on.
            Job.objects.db_manager(using).move_aside(
                job, reason=f"its row cannot be claimed: the database refused to reserve it ({type(refused).__name__})"
            )
            continue
        if reserved:
            claimed.append(job)
    return claimed


def _reserve_one(using: str, job: Job, worker_id: str) -> bool:
    updated = (
        Job.objects.get_queryset()
        .using(using)
        .held(job)
        .filter(reserved_at__isnull=True)
        .update(**_reserve_changes(job.db_now, worker_id))
    )
    if updated:
        _mark_reserved([job], job.db_now, worker_id)
    return bool(updated)


def claim_sql(connection: Any, *, walk: bool = False, clear: bool = True) -> str:
    """The one-statement claim for PostgreSQL (parameters: ``claim_params``).

    It reads the queue's waiting index in one ordered scan, or, with ``walk``,
    priority by priority: a recursive query walks the distinct priorities of the
    queue's waiting rows from the top (one index descent each), and for each
    reads rows ``available_at <= now`` in index order, so rows delayed to later
    (many at a high priority, say) are never read, where the one scan steps over
    all of them. The walk stops as soon as ``LIMIT`` rows are found. Planning the
    walk costs about 0.2 ms a claim, a tenth of a no-op job's cost, so a queue
    takes whichever of the two its claims measured faster (see ``walks``). Every
    identifier comes from the model's meta, every value is a parameter.

    With ``clear`` it sets the ``unique_key`` of ``unique_until_start`` rows to
    NULL; without, ``plain_claimed`` does that after it (see ``clears_unique_keys``).
    """
    key = (connection.vendor, walk, clear)
    text = _CLAIM_SQL.get(key)
    if text is None:
        text = _CLAIM_SQL[key] = _claim_update(connection, _walk_candidates if walk else _scan_candidates, clear)
    return text


# ``claim_sql`` per vendor, walk and clear.
_CLAIM_SQL: dict[tuple[str, bool, bool], str] = {}


def _scan_candidates(n: dict[str, str]) -> str:
    return (
        f"SELECT {n['id']} FROM {n['table']} WHERE {n['queue']} = %s AND {n['waiting']} "
        f"AND {n['available_at']} <= STATEMENT_TIMESTAMP() "
        f"ORDER BY {n['priority']} DESC, {n['available_at']}, {n['id']} LIMIT %s FOR UPDATE SKIP LOCKED"
    )


def _walk_candidates(n: dict[str, str]) -> str:
    top = f"SELECT {n['priority']} FROM {n['table']} WHERE {n['queue']} = %s AND {n['waiting']}"
    return (
        "WITH RECURSIVE levels (level) AS ("
        f"({top} ORDER BY {n['priority']} DESC LIMIT 1) "
        f"UNION ALL SELECT ({top} AND {n['priority']} < levels.level ORDER BY {n['priority']} DESC LIMIT 1) "
        "FROM levels WHERE levels.level IS NOT NULL) "
        f"SELECT rows.{n['id']} FROM levels CROSS JOIN LATERAL (SELECT {n['id']} FROM {n['table']} "
        f"WHERE {n['queue']} = %s AND {n['priority']} = levels.level AND {n['waiting']} "
        f"AND {n['available_at']} <= STATEMENT_TIMESTAMP() "
        f"ORDER BY {n['available_at']}, {n['id']} LIMIT %s FOR UPDATE SKIP LOCKED) AS rows "
        "WHERE levels.level IS NOT NULL LIMIT %s"
    )


def _claim_update(connection: Any, candidates: Callable[[dict[str, str]], str], clear: bool) -> str:
    """The claim's UPDATE of the rows ``candidates`` selects (given the quoted names), returning them."""
    fields: tuple[str, ...] = ("id", "queue", "priority", "available_at", "reserved_at", "reserved_by", "attempts")
    fields += ("blocked", "unique_key", "unique_until_start")
    table, *columns = sql_names(connection, *fields)
    n = dict(zip(fields, columns, strict=True), table=table)
    n["waiting"] = f"{n['reserved_at']} IS NULL AND NOT {n['blocked']}"
    returning = ", ".join(sql_names(connection, *(field.name for field in Job._meta.concrete_fields))[1:])
    unique = (
        f", {n['unique_key']} = CASE WHEN {n['unique_until_start']} THEN NULL ELSE {n['unique_key']} END"
        if clear
        else ""
    )
    return (
        f"UPDATE {table} SET {n['attempts']} = {n['attempts']} + 1, {n['reserved_at']} = STATEMENT_TIMESTAMP(), "
        f"{n['reserved_by']} = %s{unique} WHERE {n['id']} IN ({candidates(n)}) RETURNING {returning}"
    )


# -- the flow claim --------------------------------------------------------


def _claim_flow(using: str, queue: str, limit: int, worker_id: str) -> list[Job]:
    """Claim up to ``limit`` jobs of ``queue`` within its concurrency and rate limits."""
    with transaction.atomic(using=using):
        _write_first(using)
        queue_rate = rates.queue_rate(queue)
        if queue_rate is not None:
            bucket = rates.Bucket.lock(using, rates.queue_bucket(queue), queue_rate)
            limit = min(limit, bucket.available)
            if limit < 1:
                _hint(bucket.wait())
                return []
        claimed: list[Job] = []
        buckets = rates.Buckets(using)
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
    """On SQLite, make the transaction a writer before it reads (as ``BEGIN IMMEDIATE``
    would): a transaction that read and then writes fails at once, rather than
    waits, when another writer committed in between."""
    connection = connections[using]
    if connection.vendor == "sqlite":
        table = connection.ops.quote_name(FlowLimit._meta.db_table)
        with connection.cursor() as cursor:
            cursor.execute(f"UPDATE {table} SET tokens = tokens WHERE 1 = 0")


def _flow_round(using: str, queue: str, limit: int, worker_id: str, buckets: rates.Buckets) -> tuple[list[Job], int]:
    """Read candidates once; reserve what the limits admit, block or delay what
    they do not; return the jobs reserved and how many were held back."""
    candidates = _candidates(using, queue, limit + FLOW_LOOKAHEAD)
    if claims_with_skip_locked(using):
        candidates = candidates.select_for_update(skip_locked=True)
    rows = list(candidates)
    if not rows:
        return [], 0
    readable = _readable(using, rows)
    moved = len(rows) - len(readable)
    rows = readable
    slots = concurrency.Slots.lock(using, [row for row in rows if row.concurrency_key])
    buckets.lock(rows)
    admitted: list[Job] = []
    saturated: set[str] = set()
    held: list[Job] = []
    for row in rows:
        if len(admitted) == limit:
            break
        if row.concurrency_key and not slots.free(row):
            saturated.add(row.concurrency_key)
            continue
        if row.rate_key and not buckets.take(row):
            held.append(row)
            continue
        if row.concurrency_key:
            slots.take(row)
        admitted.append(row)
    if admitted:
        if claims_with_skip_locked(using):
            _reserve(using, admitted, worker_id)
        else:
            admitted = [job for job in admitted if _reserve_one(using, job, worker_id)]
    # After the reservations: blocking takes the key's rows still waiting.
    concurrency.block(using, saturated)
    buckets.hold(held)
    # A row moved aside counts as held back: the next round reads the rows after it.
    return admitted, len(saturated) + len(held) + moved


def _claim_past_refusals(using: str, queue: str, limit: int, worker_id: str, exc: DatabaseError) -> list[Job]:
    """Claim the next rows of ``queue`` one by one, each under a savepoint, after the
    claim statement was refused: a row the database refuses to reserve, or whose
    values are out of bounds, is moved aside with the refusal as its error."""
    claimed: list[Job] = []
    for row in _candidates(using, queue, limit):
        error = validation.row_error(row.__dict__)
        if error is None:
            try:
                with transaction.atomic(using=using):
                    if _reserve_one(using, row, worker_id):
                        claimed.append(row)
                continue
            except (IntegrityError, DataError) as refused:
                if caused_by_lost_connection(refused, using):
                    raise
                error = f"the database refused to reserve it ({type(refused).__name__})"
        Job.objects.db_manager(using).move_aside(row, reason=f"its row cannot be claimed: {error}")
    logger.warning(
        "claim refused queue=%s worker_id=%s error=%s; claimed=%s one by one",
        queue,
        worker_id,
        type(exc).__name__,
        len(claimed),
    )
    return plain_claimed(using, queue, claimed) if not uses_flow_claim(queue) else claimed


def _readable(using: str, rows: list[Job]) -> list[Job]:
    """The candidate rows whose flow values the claim can read; each other one is
    moved to ``FailedJob`` unrun with its error (a rate limit or a concurrency
    limit written past the checks), and the queue goes on."""
    readable = []
    for row in rows:
        error = validation.row_error({"concurrency_limit": row.concurrency_limit, "rate_limit": row.rate_limit})
        if error is None:
            readable.append(row)
        else:
            Job.objects.db_manager(using).move_aside(row, reason=f"the claim cannot read its flow values: {error}")
    return readable


def _hint(seconds: float | None) -> None:
    if seconds is None:
        return
    current = getattr(_hints, "seconds", None)
    _hints.seconds = seconds if current is None else min(current, seconds)
