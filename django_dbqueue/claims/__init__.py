"""The claim: the one home of every statement that picks the next jobs of a queue and reserves them.

A claim reserves waiting rows of a queue that is not paused, in the queue's order. The
plain claim (``plain``, one statement per database) serves queues whose jobs use no
concurrency key and no rate limit; the flow claim (``flow``) the others: once a definition
with a limit is registered for the queue, ``DBQUEUE["RATE_LIMITS"]`` names it, or the
plain claim met such a job (which it gives back unrun).
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from contextlib import nullcontext

from django.db import DatabaseError, DataError, IntegrityError, connections, transaction

from .. import finished, rates
from ..db import caused_by_lost_connection
from ..lifecycle import delete_many, finished_by_members, move_unreadable, reclaim_expired, release
from ..lifecycle.dependencies import released
from ..lifecycle.reactions import SUCCEEDED, concerned
from ..models import Job, PausedQueue
from ..workers import reclaim_dead
from . import flow, plain
from .flow import FLOW_LOOKAHEAD, retry_in
from .plain import clear_unique_keys, clears_unique_keys

# Handed on: what the worker and the tests use of the claim's parts.
__all__ = ["FLOW_LOOKAHEAD", "clear_unique_keys", "clears_unique_keys", "retry_in"]

logger = logging.getLogger("django_dbqueue")

_flow_queues: set[str] = set()


def use_flow_claim(queue: str) -> None:
    """Claim ``queue`` with the flow claim from now on, in this process."""
    _flow_queues.add(queue)


def uses_flow_claim(queue: str) -> bool:
    return queue in _flow_queues or rates.queue_rate(queue) is not None


def reserve(queues: Sequence[str], *, worker_id: str = "", using: str | None = None) -> Job | None:
    """Claim the next available job of the first non-empty queue, or return None."""
    jobs = reserve_many(queues, limit=1, worker_id=worker_id, using=using)
    return jobs[0] if jobs else None


def reserve_many(
    queues: Sequence[str],
    *,
    limit: int,
    worker_id: str = "",
    default_tries: int | None = None,
    before_reclaim: Callable[[], None] | None = None,
    using: str | None = None,
) -> list[Job]:
    """Claim up to ``limit`` jobs from the first non-empty queue in ``queues``. When nothing is
    available, reclaim expired reservations (after ``before_reclaim``) and try once more, so only
    an idle worker pays for the reclaim."""
    if limit < 1:
        raise ValueError("limit must be at least 1")
    using = Job.objects.db_manager(using).get_queryset().db
    return _claim_or_reclaim(using, queues, queues, limit, worker_id, default_tries, before_reclaim)


def _claim_or_reclaim(
    using: str,
    first: Sequence[str],
    queues: Sequence[str],
    limit: int,
    worker_id: str,
    default_tries: int | None,
    before_reclaim: Callable[[], None] | None,
) -> list[Job]:
    """Claim from ``first``; if nothing, reclaim what was lost and claim ``queues`` once more."""
    jobs = claim(using, first, limit, worker_id)
    if jobs:
        return jobs
    if before_reclaim is not None:
        before_reclaim()
    reclaimed = reclaim_expired(default_tries=default_tries)
    # Jobs of workers that stopped beating, before their retry_after (workers.py).
    reclaimed += reclaim_dead(default_tries=default_tries)
    if flow.sweep_now_and_then(using) or reclaimed:
        return claim(using, queues, limit, worker_id)
    return []


def finish_and_reserve(
    done: Sequence[Job],
    queues: Sequence[str],
    *,
    limit: int,
    worker_id: str = "",
    default_tries: int | None = None,
    before_reclaim: Callable[[], None] | None = None,
) -> tuple[set[int], list[Job]]:
    """``lifecycle.delete_many(done)``, then ``reserve_many``; return the ids deleted and the jobs
    claimed. On PostgreSQL the DELETE and the claim of the first queue are one statement."""
    more = functools.partial(
        reserve_many, queues, limit=limit, worker_id=worker_id, default_tries=default_tries,
        before_reclaim=before_reclaim,
    )  # fmt: skip
    if not done:
        return set(), more()
    using = Job.objects.get_queryset().db
    connection = connections[using]
    if (
        connection.vendor != "postgresql"
        or not queues
        or queues[0] in paused(using)
        or uses_flow_claim(queues[0])
        # The statement moves batch counters, releases workflow nodes or keeps the history (one of
        # them); other reactions need delete_many.
        or (reactions := concerned(SUCCEEDED, done)) - {"batch_id", "node_id", "id"}
    ):
        return delete_many(done), more()
    walk, bound = plain.shape(queues[0])
    members = "batch_id" in reactions
    nodes = "node_id" in reactions
    kept = "id" in reactions
    if members + nodes + kept > 1:
        return delete_many(done), more()
    # Batch members: their counters move in the statement, in a transaction that enqueues the callbacks.
    with transaction.atomic(using=using) if members else nullcontext():
        sql = plain.finish_and_claim_sql(connection, walk, clears_unique_keys(queues[0]), members, nodes, kept)
        params = [
            [job.pk for job in done],
            [job.attempts for job in done],
            *(finished.kept_params(done) if kept else ()),
            *plain.claim_params(worker_id, queues[0], limit, walk=walk, bound=bound),
        ]
        rows = plain.timed_claim(connection, queues[0], walk, sql, params)
        if members and rows[0][0]:
            finished_by_members(using, rows[0][0])
    ended = rows[0][0] if members else None
    if nodes:
        # Workflow nodes: their children were released in the statement; again if one may have raced.
        released(using, rows[0][0], rows[0][1], rows[0][2])
        ended = rows[0][0]
        rows = [row[3:] for row in rows]
    rows = [row[1:] for row in rows] if members else rows
    deleted = set(rows[0][0])
    claimed = plain.from_claim(using, [row[1:] for row in rows if row[1] is not None])
    jobs = plain_claimed(using, queues[0], plain.bounded_rest(using, queues[0], limit, worker_id, walk, claimed))
    if not jobs:
        # The first queue is empty: the others (all if a batch finished: its callbacks came after).
        others = queues if ended else queues[1:]
        jobs = _claim_or_reclaim(using, others, queues, limit, worker_id, default_tries, before_reclaim)
    return deleted, jobs


def claim(using: str, queues: Sequence[str], limit: int, worker_id: str) -> list[Job]:
    """Claim up to ``limit`` jobs from the first queue of ``queues`` that has any and is not paused."""
    flow.forget_hint()
    skipped = paused(using)
    for queue in queues:
        if queue in skipped:
            continue
        try:
            jobs = claim_queue(using, queue, limit, worker_id)
        except (IntegrityError, DataError) as exc:
            if caused_by_lost_connection(exc, using):
                raise
            # The database refused to reserve a row written past its checks: claim one by one.
            jobs = _claim_past_refusals(using, queue, limit, worker_id, exc)
        except DatabaseError:
            raise
        except Exception:
            # Not the database's refusal: a value the claim could not read. The rows
            # that hold one are moved aside and the queue claimed again; an error
            # that stays ends this claim of the queue, never the worker.
            logger.exception("claim failed queue=%s worker_id=%s; unreadable rows are moved aside", queue, worker_id)
            jobs = _claim_past_unreadable(using, queue, limit, worker_id)
        if jobs:
            return jobs
    return []


# Claims skip the queues paused when this process last read them, read again once PAUSE_CHECK
# seconds old (cheaper than a subquery on PausedQueue in every claim: docs/performance.md).
PAUSE_CHECK = 0.5
_paused: dict[str, tuple[float, frozenset[str]]] = {}
_paused_lock = threading.Lock()
# Bumped by forget_paused: a read that started before it is not kept.
_paused_generation = 0


def holds_nothing(queues: Sequence[str], using: str) -> bool:
    """Tell whether ``queues`` hold no job, but those of a paused queue that nobody holds (no
    worker claims them until it is resumed): ``queue_work --until-done``; False on a database error."""
    rows = Job.objects.using(using).filter(queue__in=queues)
    try:
        if stopped := paused(using):
            rows = rows.exclude(reserved_at__isnull=True, queue__in=stopped)
        return not rows.exists()
    except DatabaseError:
        return False  # the next claim reports it


def paused(using: str) -> frozenset[str]:
    """The paused queues of database ``using``, as read at most ``PAUSE_CHECK`` seconds ago."""
    now = time.monotonic()
    read = _paused.get(using)
    if read is None or now - read[0] >= PAUSE_CHECK:
        generation = _paused_generation
        read = (now, frozenset(PausedQueue.objects.using(using).values_list("queue", flat=True)))
        with _paused_lock:
            if generation == _paused_generation:
                _paused[using] = read
    return read[1]


def forget_paused(queues: Iterable[str] | None = None) -> None:
    """Read the paused queues again at the next claim (given ``queues``, a resume's
    notifications: only if one of them was paused when last read)."""
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
        return flow.claim_flow(using, queue, limit, worker_id)
    return plain_claimed(using, queue, plain.claim_plain(using, queue, limit, worker_id))


def plain_claimed(using: str, queue: str, jobs: list[Job]) -> list[Job]:
    """The jobs a plain claim of ``queue`` may run: one with a concurrency key or a rate limit is
    given back unrun (the queue takes the flow claim from now on); a unique key held until the
    start that the statement did not clear is freed."""
    started = [job.pk for job in jobs if job.unique_until_start and job.unique_key is not None]
    if started:
        Job.objects.get_queryset().using(using).filter(pk__in=started, unique_until_start=True).update(unique_key=None)
        for job in jobs:
            if job.pk in started:
                job.unique_key = None
        if not clears_unique_keys(queue):
            clear_unique_keys(queue)
            logger.info("queue=%s holds jobs unique until started: claims free their keys from now on", queue)
    flowed = [job for job in jobs if job.concurrency_key or job.rate_key]
    if not flowed:
        return jobs
    use_flow_claim(queue)
    logger.info("queue=%s holds jobs with concurrency keys or rate limits: claimed with limits from now on", queue)
    for job in flowed:
        release(job, give_back=True)
    return [job for job in jobs if not (job.concurrency_key or job.rate_key)]


def _claim_past_unreadable(using: str, queue: str, limit: int, worker_id: str) -> list[Job]:
    """Move aside the next rows of ``queue`` whose values cannot be read as a ``Job``,
    then claim the queue once more (nothing if none moved, or if it fails again)."""
    rows = Job.objects.db_manager(using).get_queryset()
    moved = False
    for pk in plain.candidates(using, queue, max(limit, FLOW_LOOKAHEAD)).values_list("pk", flat=True):
        try:
            rows.filter(pk=pk).first()
        except DatabaseError:
            raise
        except Exception as exc:  # noqa: BLE001 (whatever reading the row raised: the row's fault)
            reason = f"its values cannot be read ({type(exc).__name__})"
            moved = move_unreadable(pk, reason=reason, using=using) or moved
    if not moved:
        return []
    try:
        return claim_queue(using, queue, limit, worker_id)
    except DatabaseError:
        raise
    except Exception:
        logger.exception("claim failed again queue=%s worker_id=%s; the other queues are claimed", queue, worker_id)
        return []


def _claim_past_refusals(using: str, queue: str, limit: int, worker_id: str, exc: DatabaseError) -> list[Job]:
    """Claim the next rows of ``queue`` one by one after the claim statement was refused."""
    claimed = plain.reserve_each(using, plain.candidates(using, queue, limit), worker_id, checked=True)
    logger.warning(
        "claim refused queue=%s worker_id=%s error=%s; claimed=%s one by one",
        queue, worker_id, type(exc).__name__, len(claimed),
    )  # fmt: skip
    return plain_claimed(using, queue, claimed) if not uses_flow_claim(queue) else claimed
