"""The changes of one job's state after its claim, each with its compare-and-set on ``(id, attempts)``."""

from __future__ import annotations

import functools
import logging
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from contextlib import nullcontext
from datetime import timedelta
from typing import Any

from django.db import DatabaseError, connections, transaction
from django.db.models import F, Q, QuerySet
from django.db.models.functions import Greatest

from .. import conf, insert
from ..db import DbNow, alias, bound_cursor, cached_sql, caused_by_lost_connection, read_back
from ..models import (
    CANCEL,
    CANCEL_HARD,
    CANCELLED_CLASS,
    DB_NOW,
    INVALID_ROW_CLASS,
    NO_CANCEL,
    FailedJob,
    Job,
    JobBatch,
    JobQuerySet,
    sql_names,
)
from ..rows import follow_ups
from ..signals import job_cancelled
from . import dependencies
from .failed import cancel_unstarted, failed_values, gone
from .reactions import CANCELLED, FAILED, RELEASED, SUCCEEDED, concerned, members_ended, react, reacts

logger = logging.getLogger("django_dbqueue")

RECLAIMED_ERROR = (
    "{name} (job {id}) was reserved {attempts} time(s) and its worker did not finish it "
    "within retry_after ({retry_after} s): it was attempted too many times or ran too long. "
    "If the job is slow, raise its timeout and retry_after; if its worker was killed, "
    "look at the worker's logs."
)

# -- extend, delete, release, fail ----------------------------------------------------


def extend(job: Job, *, worker_id: str) -> bool:
    """Move the reservation of ``job`` to the database's now, if ``worker_id`` still holds it."""
    return job.pk in extend_many([job], worker_id=worker_id)


def extend_many(jobs: Sequence[Job], *, worker_id: str) -> set[int]:
    """``extend`` for many jobs (the heartbeat); return the ids ``worker_id`` still held."""
    if not jobs:
        return set()
    held = Job.objects.get_queryset().held_by(jobs).filter(reserved_by=worker_id, reserved_at__isnull=False)
    # The clock is written as a value read once: SQLite stores DbNow() with 3 decimals,
    # which a reclaim's compare-and-set on reserved_at (6 decimals) would never match.
    rows = list(held.order_by().only("pk").annotate(**DB_NOW))
    if rows:
        held.update(reserved_at=rows[0].db_now)
    return {row.pk for row in rows}


def _change_held(
    job: Job, outcome: str, change: Callable[[JobQuerySet], int], follow: Sequence[Job] = (), **still: Any
) -> bool:
    """Apply ``change`` to the row of ``job`` if its reservation is still ``job``'s (and its
    columns ``still`` as given); run the reactions to ``outcome`` and insert ``follow`` with it."""
    queryset = Job.objects.get_queryset().held(job)
    queryset = queryset.filter(**still) if still else queryset
    follow = list(follow)
    with transaction.atomic(using=queryset.db) if follow or reacts(outcome, [job]) else nullcontext():
        done = bool(change(queryset))
        if done:
            react(queryset.db, {outcome: [job]}, follow)
            if follow:
                insert.bulk_enqueue(follow, queryset.db)
    return done


def delete(job: Job, *, follow_ups: Sequence[Job] = ()) -> bool:
    """Delete a job that succeeded, if its reservation is still ``job``'s, inserting ``follow_ups``
    (a chain's next step, callbacks) in the same transaction."""
    return _change_held(job, SUCCEEDED, JobQuerySet.delete_now, follow_ups)


def delete_many(jobs: Sequence[Job]) -> set[int]:
    """``delete`` for many jobs in one statement; return the ids deleted."""
    if not jobs:
        return set()
    reactions = concerned(SUCCEEDED, jobs)
    if not reactions:
        return _delete_many(jobs)
    using = Job.objects.get_queryset().db
    if connections[using].vendor == "postgresql" and reactions == {"node_id"}:
        return dependencies.delete_and_release(using, jobs)  # workflow nodes only: one statement
    with transaction.atomic(using=using):
        deleted = _delete_many(jobs)
        react(using, {SUCCEEDED: [job for job in jobs if job.pk in deleted]})
    return deleted


def _delete_many(jobs: Sequence[Job]) -> set[int]:
    """Fixed SQL, on the worker's hot path. Outside PostgreSQL (which returns the ids), a
    short row count costs one query for the rows still there (reserved by another now)."""
    connection = connections[Job.objects.get_queryset().db]
    table, pk, attempts = sql_names(connection, "id", "attempts")
    ids = {job.pk for job in jobs}
    with bound_cursor(connection) as cursor:
        if connection.vendor == "postgresql":
            cursor.execute(delete_sql(connection), [[job.pk for job in jobs], [job.attempts for job in jobs]])
            return {row[0] for row in cursor.fetchall()}
        # ``id IN`` for the index, the pairs for the compare-and-set.
        params: list[Any] = list(ids)
        for job in jobs:
            params += [job.pk, job.attempts]
        cursor.execute(
            f"DELETE FROM {table} WHERE {pk} IN ({', '.join(['%s'] * len(ids))}) "
            f"AND ({' OR '.join([f'({pk} = %s AND {attempts} = %s)'] * len(jobs))})",
            params,
        )
        if cursor.rowcount == len(ids):
            return ids
    return ids - set(Job.objects.get_queryset().filter(pk__in=ids).values_list("pk", flat=True))


@cached_sql
def delete_sql(connection: Any) -> str:
    """PostgreSQL: delete the rows whose (id, attempts) are in two arrays, returning their ids."""
    return delete_returning(connection)


def delete_returning(connection: Any, *fields: str) -> str:
    """``delete_sql``, returning ``fields`` besides the id."""
    table, pk, attempts, *others = sql_names(connection, "id", "attempts", *fields)
    extra = "".join(f", {table}.{column} AS {name}" for name, column in zip(fields, others, strict=True))
    return (
        f"DELETE FROM {table} USING unnest(%s::bigint[], %s::bigint[]) AS done (id, attempts) "
        f"WHERE {table}.{pk} = done.id AND {table}.{attempts} = done.attempts RETURNING {table}.{pk} AS id{extra}"
    )


def release(job: Job, *, delay: float = 0, give_back: bool = False, exception: bool = False) -> bool:
    """Put a reserved job back, available after ``delay`` seconds. ``give_back``: it spends no
    try (never started, or a lost connection); ``exception``: counted for ``max_exceptions``."""
    available_at = DbNow() + timedelta(seconds=delay) if delay > 0 else DbNow()
    changes: dict[str, Any] = {"reserved_at": None, "reserved_by": "", "available_at": available_at}
    if give_back:
        changes["given_back"] = F("given_back") + 1
    if exception:
        changes["exceptions"] = F("exceptions") + 1
    released = _change_held(job, RELEASED, functools.partial(QuerySet.update, **changes))
    if released and give_back:
        job.given_back += 1
    return released


def fail(
    job: Job, *, error: str, exception_class: str, reserved_at: Any = None, follow_ups: Sequence[Job] = ()
) -> FailedJob | None:
    """Move a job to ``FailedJob`` in one transaction, with ``follow_ups`` (a failure
    callback); None if its reservation is no longer ``job``'s."""
    queryset = Job.objects.get_queryset().held(job)
    if reserved_at is not None:
        queryset = queryset.filter(reserved_at=reserved_at)
    with transaction.atomic(using=queryset.db):
        if not queryset.delete_now():
            return None
        if follow_ups:
            insert.bulk_enqueue(follow_ups, queryset.db)
        failed = FailedJob.objects.using(queryset.db).create(
            **failed_values(job), exception_class=exception_class[:255], error=error, failed_at=DbNow()
        )
        read_back(failed, "failed_at")
        react(queryset.db, {FAILED: [job]})
        return failed


def cancel(job_id: int, *, hard: bool = False, reason: str = "") -> str:
    """Cancel a job: ``"cancelled"`` if nobody held it (moved to ``FailedJob``), ``"requested"``
    if a worker holds it (it stops at its next check, or with ``hard`` at once, as at a
    timeout), ``"missing"`` if there is no such row."""
    queryset = Job.objects.get_queryset()
    level = CANCEL_HARD if hard else CANCEL
    # Twice at most: a claim between the read and the write (SQLite: no row lock) makes it a running one.
    for _ in range(2):
        with transaction.atomic(using=queryset.db):
            job = queryset.filter(pk=job_id).select_for_update().first()
            if job is None:
                return "missing"
            if job.reserved_at is None:
                failed = fail(job, error=cancelled_error(job, reason), exception_class=CANCELLED_CLASS)
                if failed is not None:
                    send = functools.partial(job_cancelled.send_robust, sender=Job, job_id=job.pk, failed_job=failed)
                    transaction.on_commit(send, using=queryset.db, robust=True)
                    return "cancelled"
                continue
            if queryset.held(job).filter(reserved_at__isnull=False).update(cancel=Greatest(F("cancel"), level)):
                return "requested"
    return "missing"


def cancel_unreserved(job_ids: Sequence[int], *, reason: str = "") -> list[Job]:
    """Cancel the jobs among ``job_ids`` that nobody holds, in one transaction, as ``cancel`` cancels
    one (moved to ``FailedJob`` as cancelled, told to the reactions as failed); return them. The
    rows a worker holds are left to it."""
    using = alias()
    with transaction.atomic(using=using):
        rows = cancel_unstarted(job_ids, functools.partial(cancelled_error, reason=reason), using)
        if rows:
            react(using, {FAILED: rows})
    return rows


def cancelled_error(job: Job, reason: str = "") -> str:
    """The error a job cancelled before it ran is stored with."""
    return f"{job.name} (job {job.pk}) was cancelled before it ran{f': {reason}' if reason else '.'}"


def cancel_requests(jobs: Sequence[Job]) -> dict[int, int]:
    """The cancel requests among these reservations: ``{id: CANCEL or CANCEL_HARD}``."""
    if not jobs:
        return {}
    return dict(Job.objects.get_queryset().held_by(jobs).filter(cancel__gt=NO_CANCEL).values_list("pk", "cancel"))


# The columns a reclaim reads of an expired reservation (the rest only for a row it fails).
_LEASE_FIELDS = (
    "id", "queue", "name", "attempts", "given_back", "max_tries", "retry_after", "reserved_at",
    "reserved_by", "concurrency_key", "batch_id", "node_id",
)  # fmt: skip


def reclaim_expired(*, default_tries: int | None = None, ids: Iterable[int] | None = None) -> int:
    """Reclaim reservations older than their ``retry_after`` (only ``ids`` if given); return how
    many. A job that used its tries moves to ``FailedJob``; a row the database refuses, aside."""
    tries_default = default_tries if default_tries is not None else int(conf.get("TRIES"))
    expired = Job.objects.get_queryset().expired().order_by().only(*_LEASE_FIELDS).annotate(**DB_NOW)
    if ids is not None:
        expired = expired.filter(pk__in=list(ids))
    reclaimed = 0
    for job in expired:
        assert job.reserved_at is not None
        if job.tries_spent >= job.tries_allowed(tries_default):
            error = RECLAIMED_ERROR.format(name=job.name, id=job.pk, attempts=job.attempts, retry_after=job.retry_after)
            outcome = "failed"
            done = _per_row(job, functools.partial(_fail_lost, job, error, "MaxAttemptsExceeded"))
        else:
            outcome = "waiting"
            put_back = functools.partial(QuerySet.update, reserved_at=None, reserved_by="")
            done = _per_row(job, functools.partial(_change_held, job, RELEASED, put_back, reserved_at=job.reserved_at))
        if done:
            reclaimed += 1
            logger.warning(
                "reclaimed job=%s id=%s attempt=%s reserved_by=%s outcome=%s",
                job.name, job.pk, job.attempts, job.reserved_by or "-", outcome,
            )  # fmt: skip
    return reclaimed


def reclaim_worker(worker_id: str, *, error_for: Callable[[float], str], default_tries: int | None = None) -> int:
    """Release or fail every job a dead worker held, without waiting for retry_after;
    ``error_for(seconds_held)`` is the error of a job that used its tries."""
    count = 0
    tries_default = default_tries if default_tries is not None else int(conf.get("TRIES"))
    held = Job.objects.get_queryset().filter(reserved_by=worker_id, reserved_at__isnull=False)
    for job in held.order_by().only(*_LEASE_FIELDS).annotate(**DB_NOW):
        assert job.reserved_at is not None
        if job.tries_spent >= job.tries_allowed(tries_default):
            error = error_for((job.db_now - job.reserved_at).total_seconds())
            done = _per_row(job, functools.partial(_fail_lost, job, error, "WorkerLost"))
        else:
            done = _per_row(job, functools.partial(release, job))
        count += done
    return count


def _fail_lost(job: Job, error: str, exception: str) -> bool:
    """Fail a reservation that was lost (expired, or its worker died) on its last try."""
    full = Job.objects.get_queryset().held(job).filter(reserved_at=job.reserved_at).first()
    if full is None:
        return False
    failed = fail(
        full,
        error=error,
        exception_class=f"django_dbqueue.exceptions.{exception}",
        reserved_at=job.reserved_at,
        follow_ups=follow_ups(full, succeeded=False),
    )
    return failed is not None


def _per_row(job: Job, change: Callable[[], bool]) -> bool:
    """Run ``change`` of one row under a savepoint; if the database refuses it, move the row
    aside, so one bad row never stops a loop over rows (a lost connection does)."""
    using = Job.objects.get_queryset().db
    try:
        with transaction.atomic(using=using):
            return change()
    except DatabaseError as exc:
        if caused_by_lost_connection(exc, using):
            raise
        return move_aside(job, reason=f"the database refused a change of its row ({type(exc).__name__})")


def move_aside(job: Job, *, reason: str, using: str | None = None) -> bool:
    """Move a row the worker cannot act on (written past the table's checks, or unreadable to
    the claim) to ``FailedJob`` unrun, whoever holds it, with ``reason``; return whether it moved."""
    queryset = Job.objects.db_manager(using).get_queryset()
    try:
        full = queryset.filter(pk=job.pk).first()
    except DatabaseError:
        raise
    except Exception as exc:  # noqa: BLE001 (a value the ORM cannot read: SQLite keeps any type in any column)
        reason = f"{reason}; its values cannot be read ({type(exc).__name__})"
        return move_unreadable(job.pk, reason=reason, using=using)
    if full is None:
        return False
    error = (
        f"{full.name} (job {full.pk}) was moved aside unrun: {reason}. "
        "Fix the row's values (or the code that wrote them) and retry it."
    )
    with transaction.atomic(using=queryset.db):
        if not queryset.held(full).delete_now():
            return False
        failed = FailedJob.objects.using(queryset.db).create(
            **failed_values(full), exception_class=INVALID_ROW_CLASS, error=error, failed_at=DbNow()
        )
    logger.error(
        "job moved aside job=%s id=%s queue=%s failed_id=%s reason=%s",
        full.name, full.pk, full.queue, failed.pk, reason,
    )  # fmt: skip
    return True


def move_unreadable(pk: int, *, reason: str, using: str | None = None) -> bool:
    """Move a waiting row whose values the ORM cannot read to ``FailedJob`` unrun, from
    the columns that can be read (its text and its id); return whether it moved."""
    queryset = Job.objects.db_manager(using).get_queryset().filter(pk=pk, reserved_at__isnull=True)
    found = queryset.values_list("name", "queue", "payload").first()
    if found is None:
        return False
    name, queue, text = (str(value)[:limit] for value, limit in zip(found, (200, 100, None), strict=True))
    error = f"{name} (job {pk}) was moved aside unrun: {reason}. Fix the row's values (or the code that wrote them)."
    with transaction.atomic(using=queryset.db):
        if not queryset.delete_now():
            return False
        failed = FailedJob.objects.using(queryset.db).create(
            job_id=pk, queue=queue, name=name, payload=text, created_at=DbNow(), attempts=0,
            exception_class=INVALID_ROW_CLASS, error=error, failed_at=DbNow(),
        )  # fmt: skip
    logger.error("job moved aside job=%s id=%s queue=%s failed_id=%s reason=%s", name, pk, queue, failed.pk, reason)
    return True


# -- operators' changes of rows nobody holds --------------------------------------------


def delete_unreserved(ids: Sequence[int]) -> list[Job]:
    """Delete the jobs among ``ids`` that no worker has reserved; return the rows deleted."""
    with transaction.atomic(using=alias()):
        # Row locks (PostgreSQL, MariaDB) keep workers off before the DELETE, whose condition protects everywhere.
        rows = list(Job.objects.filter(pk__in=ids, reserved_at__isnull=True).select_for_update().order_by())
        if not rows:
            return []
        unreserved = Job.objects.get_queryset().filter(pk__in=[row.pk for row in rows], reserved_at__isnull=True)
        if unreserved.delete_now() != len(rows):
            rows = gone(rows)
        react(alias(), {CANCELLED: rows})
    return rows


def delete_waiting(queue: str, last_id: int) -> int:
    """Delete the jobs of ``queue`` up to id ``last_id`` that nobody holds; return how many."""
    jobs = Job.objects.filter(queue=queue, reserved_at__isnull=True, id__lte=last_id)
    # Locked: a delete signal receiver makes Django select the rows before it deletes them by id.
    with transaction.atomic(using=alias()):
        members = list(
            jobs.filter(Q(batch_id__isnull=False) | Q(node_id__isnull=False))
            .select_for_update()
            .only("id", "batch_id", "node_id")
            .order_by()
        )
        deleted, _ = jobs.select_for_update().delete()
        if members:
            react(alias(), {CANCELLED: gone(members)})
    return deleted


def run_now(jobs: QuerySet[Job]) -> int:
    """Make the unreserved jobs among ``jobs`` available at once; return how many."""
    return jobs.filter(reserved_at__isnull=True).update(available_at=DbNow())


def skip_member(job: Job) -> bool:
    """End a claimed member of a cancelled batch unrun: delete its row (if its reservation is
    still ``job``'s) and count it cancelled, in one transaction."""
    return _change_held(job, CANCELLED, JobQuerySet.delete_now)


def cancel_batch(batch_id: int) -> int | None:
    """Mark a batch cancelled and delete its members nobody holds; return how many, or None if
    it was cancelled or finished already."""
    using = alias()
    with transaction.atomic(using=using):
        # The batch row first: an ``add`` waits for this transaction, then sees the cancel.
        if not JobBatch.objects.filter(pk=batch_id, cancelled_at__isnull=True, finished_at__isnull=True).update(
            cancelled_at=DbNow()
        ):
            return None
        # Rows a worker holds are left to it; a claim that commits meanwhile wins over the DELETE.
        deleted = Job.objects.get_queryset().filter(batch_id=batch_id, reserved_at__isnull=True).delete_now()
        members_ended(using, cancelled=Counter({batch_id: deleted}) if deleted else Counter(), touched={batch_id})
    return deleted
