"""The plain claim, one shape per database, and the finish-and-claim statement of PostgreSQL.

PostgreSQL: ``UPDATE ... WHERE id IN (SELECT ... FOR UPDATE SKIP LOCKED)``; MariaDB/MySQL:
``SELECT ... FOR UPDATE SKIP LOCKED`` then ``UPDATE``; SQLite: a compare-and-set per row.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Iterable, Sequence
from contextlib import nullcontext
from datetime import datetime
from typing import Any

from django.db import DatabaseError, DataError, IntegrityError, connections, transaction
from django.db.models import Case, F, Value, When

from .. import finished, validation
from ..db import bound_cursor, cached_sql, caused_by_lost_connection, claims_with_skip_locked, oldest_transaction
from ..lifecycle.changes import delete_returning, delete_sql, move_aside
from ..lifecycle.dependencies import REPORT, REPORTED
from ..models import DB_NOW, Job, JobBatch, JobQuerySet, sql_names

logger = logging.getLogger("django_dbqueue")

# Queues whose plain claims on PostgreSQL free the keys of jobs unique "until started" in the
# statement: those a definition with that scope names, and any whose claim returned such a
# job with its key (``claims.plain_claimed`` frees it). Other claims leave the CASE out.
_clearing: set[str] = set()


def clear_unique_keys(queue: str) -> None:
    _clearing.add(queue)


def clears_unique_keys(queue: str) -> bool:
    return queue in _clearing


def claim_plain(using: str, queue: str, limit: int, worker_id: str) -> list[Job]:
    """Claim up to ``limit`` jobs of ``queue`` with the plain claim of the database."""
    if connections[using].vendor == "postgresql":
        return _claim_returning(using, queue, limit, worker_id)
    if claims_with_skip_locked(using):
        return _claim_locked(using, queue, limit, worker_id)
    return _claim_cas(using, queue, limit, worker_id)


def _claim_returning(using: str, queue: str, limit: int, worker_id: str) -> list[Job]:
    """Claim in one statement (PostgreSQL); see ``claim_sql``."""
    walk, bound = shape(queue)
    sql = claim_sql(connections[using], walk=walk, clear=clears_unique_keys(queue))
    params = claim_params(worker_id, queue, limit, walk=walk, bound=bound)
    jobs = from_claim(using, timed_claim(connections[using], queue, walk, sql, params))
    return bounded_rest(using, queue, limit, worker_id, walk, jobs)


def bounded_rest(using: str, queue: str, limit: int, worker_id: str, walk: int, jobs: list[Job]) -> list[Job]:
    """``jobs``, claimed with ``walk``, and if a bounded claim came back short, a full claim's for the rest."""
    noted(queue, jobs, limit, using)
    if walk == FROM_BOUND and len(jobs) < limit:
        jobs += _claim_returning(using, queue, limit - len(jobs), worker_id)
    return jobs


def timed_claim(connection: Any, queue: str, walk: int, sql: str, params: Sequence[Any]) -> list[Any]:
    """Run a claim statement of ``queue`` and return its rows, noting its time (``timed``)."""
    with bound_cursor(connection) as cursor:
        started = time.monotonic()
        cursor.execute(sql, params)
        rows: list[Any] = cursor.fetchall()
        timed(queue, walk, time.monotonic() - started)
    return rows


# The three shapes of the PostgreSQL claim (``claim_sql``'s ``walk``): one ordered scan of the
# queue's waiting index, a walk of it priority by priority, or a scan of one priority from a lower
# bound on ``available_at`` (``FROM_BOUND``, below).
SCAN, WALK, FROM_BOUND = 0, 1, 2
SHAPES = (SCAN, WALK, FROM_BOUND)


# Which of the two PostgreSQL statements (``claim_sql``) a queue's claims use, per process: each
# keeps a moving average of its times, claims take the faster, and every PROBE_EVERY seconds one
# takes the other. A queue starts with the scan and tries the walk once the scan's average passes
# SLOW_CLAIM (where nothing delayed sits in front, the walk loses by its planning).
SLOW_CLAIM = 0.002
PROBE_EVERY = 10.0
# The weight of a claim's time in its statement's average (a probe's: PROBE_WEIGHT).
WEIGHT = 0.2
PROBE_WEIGHT = 0.5


# A claim under a snapshot older than the jobs claimed since (a transaction left open anywhere on
# the server) reads the whole head of the waiting index: every job claimed since has left an entry
# there that cannot be marked dead while that snapshot may see its row, so each claim is slower than
# the last (44 ms after 200,000 claimed, docs/capacity.md). Once a queue's full claims average more
# than BOUNDED_AFTER, and the last claim came back full with one priority, the next claims take only
# that priority from where the last began (``available_at >= bound``): one index descent past the
# dead head. A full claim still runs every FULL_EVERY seconds and whenever a bounded one comes back
# short, so a job behind the bound (reclaimed, released to an earlier time, enqueued with a past
# ``available_at``) or of a higher priority waits at most that long.
BOUNDED_AFTER = 0.005
FULL_EVERY = 1.0
# The bound is kept only while bounded claims are measured faster than HELPS times the full ones:
# claims slowed by the machine rather than by a dead index head (four processes on two cores,
# threads waiting for the interpreter) are as slow bounded, and the bound would only hold back the
# jobs behind it (and the log would blame the claims).
HELPS = 0.5
# Seconds before a bound dropped for not helping is tried again (its measure forgotten): the
# machine's load and the index's state change.
RETRY_BOUND = 60.0


class _Pick:
    """The two full statements' average times for one queue, when to probe next, and the bound."""

    __slots__ = ("bound", "bounded", "full_at", "probe_at", "probing", "retry_at", "scan", "walk")

    def __init__(self) -> None:
        self.scan: float | None = None
        self.walk: float | None = None
        self.bounded: float | None = None  # the bounded claims' average time
        self.retry_at = 0.0  # no bound before then (one was dropped for not helping)
        self.probe_at = time.monotonic() + PROBE_EVERY
        self.probing = False
        # (priority, available_at) the next claims start from, and when the next full claim is due.
        self.bound: tuple[int, datetime] | None = None
        self.full_at = 0.0

    def faster_is_walk(self) -> bool:
        return self.scan is not None and self.walk is not None and self.walk < self.scan

    def slow(self) -> bool:
        """Tell whether the faster full statement averages more than BOUNDED_AFTER."""
        known = [average for average in (self.scan, self.walk) if average is not None]
        return bool(known) and min(known) > BOUNDED_AFTER

    def helps(self) -> bool | None:
        """Whether the bounded claims average less than HELPS times the faster full statement
        (None before one was timed)."""
        known = [average for average in (self.scan, self.walk) if average is not None]
        if self.bounded is None or not known:
            return None
        return self.bounded < HELPS * min(known)


_picks: dict[str, _Pick] = {}


def walks(queue: str) -> bool:
    """Whether the next plain claim of ``queue`` walks it priority by priority."""
    pick = _picks.get(queue)
    if pick is None:
        return False
    if pick.walk is None:
        pick.probing = pick.scan is not None and pick.scan > SLOW_CLAIM
        return pick.probing
    now = time.monotonic()
    pick.probing = now >= pick.probe_at
    if pick.probing:
        pick.probe_at = now + PROBE_EVERY
        return not pick.faster_is_walk()
    return pick.faster_is_walk()


def shape(queue: str) -> tuple[int, tuple[int, datetime] | None]:
    """The shape of the next plain claim of ``queue`` (``SCAN``, ``WALK`` or ``FROM_BOUND``) and its bound."""
    pick = _picks.get(queue)
    if pick is not None and pick.bound is not None:
        now = time.monotonic()
        if now < pick.full_at:
            return FROM_BOUND, pick.bound
        pick.full_at = now + FULL_EVERY
    return (WALK if walks(queue) else SCAN), None


def noted(queue: str, jobs: Sequence[Job], limit: int, using: str | None = None) -> None:
    """Keep or drop the bound of ``queue``'s next claims after one that claimed ``jobs`` (sorted)."""
    pick = _picks.get(queue)
    if pick is None:
        return
    helps = pick.helps()
    if helps is False:
        pick.bound, pick.bounded, pick.retry_at = None, None, time.monotonic() + RETRY_BOUND
        return
    if (
        not jobs
        or len(jobs) < limit
        or jobs[0].priority != jobs[-1].priority
        or not pick.slow()
        or time.monotonic() < pick.retry_at
    ):
        pick.bound = None
        return
    if pick.bound is None:
        pick.full_at = time.monotonic() + FULL_EVERY
    if helps and using is not None:
        _warn_slow(using, queue, pick)
    pick.bound = (jobs[0].priority, jobs[0].available_at)


# A process warns of a queue's slow claims at most once in WARN_EVERY seconds.
WARN_EVERY = 60.0
_warned: dict[str, float] = {}


def _warn_slow(using: str, queue: str, pick: _Pick) -> None:
    """Log that ``queue``'s claims are slow and name the oldest open transaction, the usual cause."""
    now = time.monotonic()
    if now < _warned.get(queue, 0.0):
        return
    _warned[queue] = now + WARN_EVERY
    try:
        oldest = oldest_transaction(using)
    except DatabaseError:  # the jobs are claimed: a failed look must not lose them
        oldest = None
    # One open for less than a second is another claim or a job's write, not a cause.
    cause = (
        f"; a transaction {oldest} keeps the jobs finished since from vacuum" if oldest and oldest.seconds >= 1 else ""
    )
    logger.warning(
        "claims of queue=%s take %.1f ms%s: they start from where the last began until they are fast again",
        queue, min(t for t in (pick.scan, pick.walk) if t is not None) * 1000, cause,
    )  # fmt: skip


def timed(queue: str, walk: int, seconds: float) -> None:
    """Note how long a plain claim of ``queue`` took, with the walk, the one scan or from the bound
    (each shape's average of its own: a bounded claim's cost says nothing of the full statements')."""
    pick = _picks.get(queue)
    if pick is None:
        pick = _picks[queue] = _Pick()
    if walk == FROM_BOUND:
        pick.bounded = seconds if pick.bounded is None else pick.bounded + WEIGHT * (seconds - pick.bounded)
        return
    average = pick.walk if walk else pick.scan
    if average is not None:
        seconds = average + (PROBE_WEIGHT if pick.probing else WEIGHT) * (seconds - average)
    if walk:
        pick.walk = seconds
    else:
        pick.scan = seconds


def claim_params(
    worker_id: str, queue: str, limit: int, *, walk: int = SCAN, bound: tuple[int, datetime] | None = None
) -> list[Any]:
    """The parameters of ``claim_sql``, in order (``bound``: ``FROM_BOUND``'s priority and time)."""
    if walk == WALK:
        return [worker_id, queue, queue, queue, limit, limit]
    if walk == FROM_BOUND:
        assert bound is not None
        return [worker_id, queue, *bound, limit]
    return [worker_id, queue, limit]


def from_claim(using: str, rows: Iterable[Sequence[Any]]) -> list[Job]:
    """Jobs from rows of the claim's RETURNING, in the claim's order (RETURNING has none)."""
    names = [field.attname for field in Job._meta.concrete_fields]
    jobs = [Job.from_db(using, names, row) for row in rows]
    jobs.sort(key=lambda job: (-job.priority, job.available_at, job.pk))
    return jobs


def candidates(using: str, queue: str, limit: int) -> JobQuerySet:
    # The shape the index ``dbqueue_job_claim`` serves, so LIMIT stops at the first rows.
    waiting = Job.objects.db_manager(using).get_queryset().waiting().filter(queue=queue)
    return waiting.order_by("-priority", "available_at", "id").annotate(**DB_NOW)[:limit]


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
        jobs = list(candidates(using, queue, limit).select_for_update(skip_locked=True))
        if not jobs:
            return []
        reserve_locked(using, jobs, worker_id)
    return jobs


def reserve_locked(using: str, jobs: list[Job], worker_id: str) -> None:
    """Reserve rows this transaction has locked."""
    now = jobs[0].db_now
    Job.objects.using(using).filter(pk__in=[job.pk for job in jobs]).update(**_reserve_changes(now, worker_id))
    _mark_reserved(jobs, now, worker_id)


def _claim_cas(using: str, queue: str, limit: int, worker_id: str) -> list[Job]:
    """Claim by compare-and-set (SQLite: writers are serialised, no row locks)."""
    return reserve_each(using, candidates(using, queue, limit), worker_id)


def reserve_each(using: str, rows: Iterable[Job], worker_id: str, *, checked: bool = False) -> list[Job]:
    """Reserve ``rows`` one by one; a row the database refuses to reserve (or, ``checked``, whose
    values are out of bounds) is moved aside and the others go on (each under a savepoint if ``checked``)."""
    claimed = []
    for row in rows:
        error = validation.row_error(row.__dict__) if checked else None
        if error is None:
            try:
                with transaction.atomic(using=using) if checked else nullcontext():
                    if reserve_one(using, row, worker_id):
                        claimed.append(row)
                continue
            except (IntegrityError, DataError) as refused:
                if caused_by_lost_connection(refused, using):
                    raise
                error = f"the database refused to reserve it ({type(refused).__name__})"
        move_aside(row, reason=f"its row cannot be claimed: {error}", using=using)
    return claimed


def reserve_one(using: str, job: Job, worker_id: str) -> bool:
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


def claim_sql(connection: Any, *, walk: int = SCAN, clear: bool = True) -> str:
    """The one-statement claim for PostgreSQL (parameters: ``claim_params``).

    It reads the queue's waiting index in one ordered scan, or, with ``walk=WALK`` (or True),
    priority by priority (a recursive query, one index descent per priority), never reading rows
    delayed to later; ``walk=FROM_BOUND`` scans one priority from a time on. With ``clear`` it frees
    the ``unique_key`` of ``unique_until_start`` rows.
    """
    return _CLAIM_SQL[walk, clear](connection)


def _scan_candidates(n: dict[str, str]) -> str:
    return (
        f"SELECT {n['id']} FROM {n['table']} WHERE {n['queue']} = %s AND {n['waiting']} "
        f"AND {n['available_at']} <= STATEMENT_TIMESTAMP() "
        f"ORDER BY {n['priority']} DESC, {n['available_at']}, {n['id']} LIMIT %s FOR UPDATE SKIP LOCKED"
    )


def _bounded_candidates(n: dict[str, str]) -> str:
    return (
        f"SELECT {n['id']} FROM {n['table']} WHERE {n['queue']} = %s AND {n['waiting']} "
        f"AND {n['priority']} = %s AND {n['available_at']} >= %s AND {n['available_at']} <= STATEMENT_TIMESTAMP() "
        f"ORDER BY {n['available_at']}, {n['id']} LIMIT %s FOR UPDATE SKIP LOCKED"
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


def _claim_update(connection: Any, *, walk: int, clear: bool) -> str:
    """The claim's UPDATE of the rows the scan or the walk selects, returning them."""
    candidates = {SCAN: _scan_candidates, WALK: _walk_candidates, FROM_BOUND: _bounded_candidates}[walk]
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


_CLAIM_SQL = {
    (walk, clear): cached_sql(functools.partial(_claim_update, walk=walk, clear=clear))
    for walk in SHAPES
    for clear in (False, True)
}


def finish_and_claim_sql(
    connection: Any, walk: int, clear: bool, members: bool, nodes: bool = False, kept: bool = False
) -> str:
    """PostgreSQL: ``lifecycle.changes.delete_sql`` and ``claim_sql`` in one statement.

    Each row holds the array of deleted ids, then a claimed row's columns (NULLs when none was
    claimed). With ``members``, each batch's ``pending`` goes down by its members deleted, and
    every row starts with the array of the batches that reached 0. With ``nodes``, it starts with the
    workflow nodes succeeded, then ``dbqueue_release_chunk``'s racing and more. With ``kept`` (neither of the
    others), the history's rows of the jobs deleted are written too (``finished.kept_sql``; its
    parameters after the DELETE's).
    """
    if kept:
        return _FINISH_KEEP_AND_CLAIM_SQL[walk, clear](connection)
    if nodes:
        return _FINISH_AND_RELEASE_SQL[walk, clear](connection)
    return _FINISH_AND_CLAIM_SQL[walk, clear, members](connection)


def _finish_and_claim(
    connection: Any, *, walk: int, clear: bool, members: bool, nodes: bool = False, kept: bool = False
) -> str:
    claim = claim_sql(connection, walk=walk, clear=clear)
    if kept:  # the history of finished jobs: its rows written from the DELETE's
        return (
            f"WITH done AS ({delete_returning(connection, *finished.RETURNED)}), "
            f"kept AS ({finished.kept_sql(connection, 'done')}), claimed AS ({claim}) "
            "SELECT ARRAY(SELECT id FROM done), claimed.* FROM (SELECT 1) AS one LEFT JOIN claimed ON TRUE"
        )
    if nodes:  # workflow nodes: their release (lifecycle.dependencies) rides on the statement
        return (
            f"WITH done AS ({delete_returning(connection, 'node_id')}), {REPORT}, "
            f"claimed AS ({claim}) SELECT ARRAY(SELECT node_id FROM done WHERE node_id IS NOT NULL), "
            f"{REPORTED}, ARRAY(SELECT id FROM done), claimed.* "
            "FROM (SELECT 1) AS one LEFT JOIN claimed ON TRUE"
        )
    if not members:
        return (
            f"WITH done AS ({delete_sql(connection)}), claimed AS ({claim}) "
            "SELECT ARRAY(SELECT id FROM done), claimed.* FROM (SELECT 1) AS one LEFT JOIN claimed ON TRUE"
        )
    qn = connection.ops.quote_name
    meta = JobBatch._meta
    batch, batch_id, pending = (
        qn(meta.db_table), qn(str(meta.get_field("id").column)), qn(str(meta.get_field("pending").column)),
    )  # fmt: skip
    return (
        f"WITH done AS ({delete_returning(connection, 'batch_id')}), "
        f"counted AS (SELECT batch_id, count(*) AS n FROM done WHERE batch_id IS NOT NULL GROUP BY batch_id), "
        f"moved AS (UPDATE {batch} SET {pending} = {batch}.{pending} - counted.n FROM counted "
        f"WHERE {batch}.{batch_id} = counted.batch_id "
        f"RETURNING {batch}.{batch_id} AS id, {batch}.{pending} AS left), "
        f"claimed AS ({claim}) "
        "SELECT ARRAY(SELECT id FROM moved WHERE moved.left = 0), ARRAY(SELECT id FROM done), claimed.* "
        "FROM (SELECT 1) AS one LEFT JOIN claimed ON TRUE"
    )


_FINISH_AND_RELEASE_SQL = {
    (walk, clear): cached_sql(functools.partial(_finish_and_claim, walk=walk, clear=clear, members=False, nodes=True))
    for walk in SHAPES
    for clear in (False, True)
}
_FINISH_KEEP_AND_CLAIM_SQL = {
    (walk, clear): cached_sql(functools.partial(_finish_and_claim, walk=walk, clear=clear, members=False, kept=True))
    for walk in SHAPES
    for clear in (False, True)
}
_FINISH_AND_CLAIM_SQL = {
    (walk, clear, members): cached_sql(functools.partial(_finish_and_claim, walk=walk, clear=clear, members=members))
    for walk in SHAPES
    for clear in (False, True)
    for members in (False, True)
}
