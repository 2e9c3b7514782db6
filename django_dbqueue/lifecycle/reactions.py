"""What features do when job rows end: ``REACTIONS``, the one subscription point of the lifecycle.

Each pairs a job column with a function run in the transaction that ended (or brought back)
rows carrying it: free concurrency slots, move batch counters and enqueue their callbacks,
release or cancel the workflow nodes after a node (``dependencies``).
Rows that carry none of the columns pay nothing more than the change itself.
"""

from __future__ import annotations

import functools
import json
import logging
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from django.db import transaction
from django.db.models import Count, Exists, F, OuterRef, Window
from django.db.models.functions import RowNumber

from .. import finished, insert
from ..concurrency import limit_key
from ..db import DbNow, alias, error_text, notify_ids, notify_queues
from ..exceptions import PayloadError
from ..models import FlowLimit, Job, JobBatch, WorkflowEdge
from ..rows import new_job
from ..signals import batch_finished
from ..states import Ended
from . import dependencies

logger = logging.getLogger("django_dbqueue")

# How rows ended, as the reactions are told (``states.Ended``).
SUCCEEDED, FAILED, RELEASED, CANCELLED, RETRIED_BACK, LEFT = (
    Ended.SUCCEEDED, Ended.FAILED, Ended.RELEASED, Ended.CANCELLED, Ended.RETRIED, Ended.LEFT,
)  # fmt: skip


Reaction = Callable[[str, Mapping[str, Sequence[Any]], list[Job]], None]


def _free_slots(using: str, ended: Mapping[str, Sequence[Any]], follow: list[Job]) -> None:
    """Reservations of concurrency keys ended: unblock the rows waiting for their slots."""
    unblock(using, [row.concurrency_key for rows in ended.values() for row in rows])


def _count_members(using: str, ended: Mapping[str, Sequence[Any]], follow: list[Job]) -> None:
    """Batch members ended (or came back): move their batches' counters. A member whose chain
    goes on in its batch (``follow``) has not ended, unless the batch was cancelled: then it
    counts as cancelled and its next step is dropped."""
    counts = {kind: count_members(rows) for kind, rows in ended.items()}
    going_on = {row.batch_id for row in follow if row.batch_id} & set(counts.get(SUCCEEDED, ()))
    if going_on:
        stopped = set(
            JobBatch.objects.using(using)
            .select_for_update()
            .filter(pk__in=going_on, cancelled_at__isnull=False)
            .values_list("pk", flat=True)
        )
        counts[CANCELLED] = counts.get(CANCELLED, Counter()) + Counter(
            {pk: n for pk, n in counts[SUCCEEDED].items() if pk in stopped}
        )
        counts[SUCCEEDED] = Counter({pk: n for pk, n in counts[SUCCEEDED].items() if pk not in going_on})
        follow[:] = [row for row in follow if row.batch_id not in stopped]
    if any(counts.values()):
        members_ended(using, **counts)


def _always() -> bool:
    return True


# Each feature: the column its rows carry, the outcomes it reacts to, its reaction (run in
# this order), and whether it is on. A release frees a slot; a released batch member stays
# pending; the history of finished jobs concerns every row (``id``) while it is kept.
REACTIONS: tuple[tuple[str, frozenset[str], Reaction, Callable[[], bool]], ...] = (
    ("concurrency_key", frozenset({SUCCEEDED, FAILED, RELEASED}), _free_slots, _always),
    ("batch_id", frozenset({SUCCEEDED, FAILED, CANCELLED, RETRIED_BACK, LEFT}), _count_members, _always),
    ("node_id", frozenset({SUCCEEDED, FAILED, CANCELLED, RETRIED_BACK}), dependencies.nodes_ended, _always),
    ("id", frozenset({SUCCEEDED, FAILED, CANCELLED}), finished.record, finished.keeping),
)


def concerned(outcome: str, rows: Iterable[Any]) -> set[str]:
    """The columns of the reactions that rows ending with ``outcome`` concern; a deferred column
    counts as unused (reading it would query a row that may be gone)."""
    rows = list(rows)
    return {
        column
        for column, outcomes, _, on in REACTIONS
        if outcome in outcomes and on() and any(vars(row).get(column) for row in rows)
    }


def reacts(outcome: str, rows: Iterable[Any]) -> bool:
    """Whether rows that end with ``outcome`` concern any reaction (and so need a transaction)."""
    return bool(concerned(outcome, rows))


def react(using: str, ended: Mapping[str, Sequence[Any]], follow: list[Job] | None = None) -> None:
    """Run the reactions that ``ended`` (rows by outcome) concerns."""
    for column, outcomes, reaction, on in REACTIONS:
        chosen_rows = {
            kind: chosen
            for kind, rows in ended.items()
            if kind in outcomes and (chosen := [row for row in rows if vars(row).get(column)])
        }
        if chosen_rows and on():
            reaction(using, chosen_rows, follow if follow is not None else [])


def running(using: str, keys: Sequence[str]) -> dict[str, int]:
    """The reserved rows of each concurrency key among ``keys``."""
    reserved = Job.objects.using(using).filter(concurrency_key__in=keys, reserved_at__isnull=False)
    return dict(reserved.order_by().values_list("concurrency_key").annotate(n=Count("id")))


def unblock(using: str, keys: Iterable[str | None]) -> int:
    """Unblock as many rows of each key as it has free slots; return how many. The lock on each
    key's row waits for a claim that is blocking the key's rows, so those rows are seen here."""
    named = sorted({key for key in keys if key})
    if not named:
        return 0
    with transaction.atomic(using=using):
        FlowLimit.objects.db_manager(using).lock([limit_key(key) for key in named])
        held = running(using, named)
        blocked = Job.objects.using(using).filter(concurrency_key__in=named, blocked=True)
        # Rows waiting for their workflow parents are not the key's to unblock.
        blocked = blocked.exclude(Exists(WorkflowEdge.objects.filter(child_id=OuterRef("node_id"), done=False)))
        limits = dict(blocked.order_by().values_list("concurrency_key", "concurrency_limit").distinct())
        free = {key: (limit or 1) - held.get(key, 0) for key, limit in limits.items() if key}
        free = {key: count for key, count in free.items() if count > 0}
        if not free:
            return 0
        # The first rows of each key with room, in claim order: ranked per key.
        order = [F("priority").desc(), F("available_at").asc(), F("id").asc()]
        ranked = (
            blocked.filter(concurrency_key__in=list(free))
            .annotate(rank=Window(RowNumber(), partition_by=F("concurrency_key"), order_by=order))
            .filter(rank__lte=max(free.values()))
            .values_list("pk", "concurrency_key", "rank", "queue")
        )
        chosen = {pk: queue for pk, key, rank, queue in ranked if key and rank <= free[key]}
        count = Job.objects.using(using).filter(pk__in=list(chosen), blocked=True).update(blocked=False)
        if count:
            # An UPDATE fires no INSERT trigger: wake the idle workers of those queues.
            notify_queues(using, chosen.values())
        return count


def sweep(using: str) -> int:
    """Unblock the rows of every blocked key with free slots (idle workers, in case a limit was raised),
    and the workflow nodes whose release was missed (``dependencies.sweep``)."""
    blocked = Job.objects.using(using).filter(concurrency_key__isnull=False, blocked=True).order_by()
    return unblock(using, blocked.values_list("concurrency_key", flat=True).distinct()) + dependencies.sweep(using)


# Where a batch's end is announced (PostgreSQL, at commit), for ``BatchHandle.wait``.
BATCH_ENDED_CHANNEL = "dbqueue_batch_ended"

# The callback kinds, in the order they are enqueued when several fire at once.
CALLBACKS = ("on_failure", "then", "on_finish")


def count_members(jobs: Iterable[Any]) -> Counter[int]:
    """``{batch_id: count}`` of the members among ``jobs`` (rows with ``batch_id``)."""
    return Counter(job.batch_id for job in jobs if job.batch_id)


def members_ended(
    using: str,
    *,
    succeeded: Counter[int] | None = None,
    failed: Counter[int] | None = None,
    cancelled: Counter[int] | None = None,
    retried: Counter[int] | None = None,
    left: Counter[int] | None = None,
    touched: Iterable[int] = (),
) -> None:
    """Move the counters of the batches whose members ended (or came back, ``retried``; or left a
    cancelled batch, ``left``), ``{batch_id: count}`` each, after the member rows changed, in
    their transaction; the callbacks that fire are enqueued in it."""
    succeeded, failed = succeeded or Counter(), failed or Counter()
    cancelled, retried, left = cancelled or Counter(), retried or Counter(), left or Counter()
    for batch_id in sorted({*succeeded, *failed, *cancelled, *retried, *left, *touched}):
        # In id order: two transactions lock batch rows in the same order.
        ended = succeeded[batch_id] + failed[batch_id] + cancelled[batch_id]
        back = retried[batch_id]
        changes: dict[str, Any] = {}
        if ended or back:
            changes["pending"] = F("pending") + (back - ended)
        if failed[batch_id] or back or left[batch_id]:
            changes["failed"] = F("failed") + (failed[batch_id] - back - left[batch_id])
        if cancelled[batch_id] or left[batch_id]:
            changes["cancelled"] = F("cancelled") + cancelled[batch_id] + left[batch_id]
        if back:
            changes["finished_at"] = None
        if changes and not JobBatch.objects.using(using).filter(pk=batch_id).update(**changes):
            logger.warning("batch id=%s is gone (pruned?): its member outcomes are not counted", batch_id)
            continue
        row = JobBatch.objects.using(using).filter(pk=batch_id).first()
        if row is None:
            continue
        fire: list[str] = []
        if failed[batch_id] and row.failed == failed[batch_id]:
            fire.append("on_failure")  # the batch's first failure (since the last retry of all its failed)
        if row.pending == 0 and row.finished_at is None and (ended or batch_id in touched):
            fire += finish_batch(row, cancelled=row.cancelled_at is not None, enqueue=False)
        _enqueue_callbacks(using, row, fire)


def finished_by_members(using: str, batch_ids: Iterable[int]) -> None:
    """Finish the batches whose ``pending`` a statement took to 0 (``claims.finish_and_reserve``)."""
    for row in JobBatch.objects.using(using).filter(pk__in=sorted(batch_ids), finished_at__isnull=True):
        finish_batch(row, cancelled=row.cancelled_at is not None)


def finish_batch(row: JobBatch, *, cancelled: bool, enqueue: bool = True) -> list[str]:
    """Mark ``row`` finished (in the caller's transaction); return the callbacks that fire (and enqueue them)."""
    using = row._state.db or alias()
    JobBatch.objects.using(using).filter(pk=row.pk).update(finished_at=DbNow())
    fire = ["on_finish"]
    if not cancelled and (row.failed == 0 or row.allow_failures):
        fire.insert(0, "then")
    logger.info(
        "batch finished id=%s name=%s total=%s failed=%s cancelled=%s",
        row.pk, row.name or "-", row.total, row.failed, row.cancelled,
    )  # fmt: skip
    send = functools.partial(batch_finished.send_robust, sender=JobBatch, batch_id=row.pk)
    transaction.on_commit(send, using=using, robust=True)
    notify_ids(using, BATCH_ENDED_CHANNEL, [row.pk])
    if enqueue:
        _enqueue_callbacks(using, row, fire)
    return fire


def _enqueue_callbacks(using: str, row: JobBatch, kinds: Sequence[str]) -> None:
    if not kinds or not row.callbacks:
        return
    try:
        steps = json.loads(row.callbacks)
    except ValueError as exc:
        logger.error("batch id=%s has unreadable callbacks, none enqueued: %s", row.pk, error_text(exc))
        return
    fired = [kind for kind in CALLBACKS if kind in kinds]
    rows = []
    for kind in fired:
        for step in (steps.get(kind) if isinstance(steps, dict) else None) or []:
            try:
                rows.append(new_job(step, check=False, batch_of=row.pk).to_job())
            except (ValueError, KeyError, TypeError, AttributeError, RecursionError, PayloadError) as exc:
                # A step written past the checks (by hand): the batch still ends, and its other callbacks run.
                logger.error("batch id=%s callback %s not enqueued: %s", row.pk, kind, _step_error(exc))
    if rows:
        insert.bulk_enqueue(rows, using)
        logger.info("batch id=%s callbacks enqueued: %s", row.pk, ", ".join(fired))


def _step_error(exc: Exception) -> str:
    """Why a stored step could not be built: our message, or the exception's class (a KeyError names a value)."""
    return str(exc) if isinstance(exc, ValueError | PayloadError) else f"malformed step ({type(exc).__name__})"
