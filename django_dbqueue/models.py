"""The queue's tables, and the only code that knows how a job row is claimed.

Every state change of a job (reserve, release, delete, fail, reclaim) is a
method of ``Job.objects`` so the worker, the admin, the commands and the
Tasks backend share one implementation. Each change that finishes a
reservation is a compare-and-set on ``(id, attempts)``: ``attempts`` grows
by one at every reservation and is never reset, so it names the reservation,
and a worker whose job was reclaimed and reserved by someone else changes
nothing.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable, Iterable, Sequence
from contextlib import nullcontext
from datetime import datetime, timedelta
from typing import Any

from django.core.validators import MaxValueValidator, MinValueValidator
from django.db import DatabaseError, IntegrityError, connections, models, transaction
from django.db.models import Exists, F, Func, OuterRef, Q
from django.db.models.functions import Greatest, Substr

from . import conf
from .db import DbNow, alias, bound_cursor, cached_sql, caused_by_lost_connection, read_back
from .validation import MAX_PRIORITY, MIN_PRIORITY, NULLABLE_BOUNDS, ROW_BOUNDS, row_error

logger = logging.getLogger("django_dbqueue")

# Rows inserted at once after which PostgreSQL re-analyzes the job table.
ANALYZE_AFTER = 1000

# Annotation that reads the database's clock into ``Job.db_now``; passed as a
# dict so the type checker keeps the attribute declared on the model.
_DB_NOW = {"db_now": DbNow()}

RECLAIMED_ERROR = (
    "{name} (job {id}) was reserved {attempts} time(s) and its worker did not finish it "
    "within retry_after ({retry_after} s): it was attempted too many times or ran too long. "
    "If the job is slow, raise its timeout and retry_after; if its worker was killed, "
    "look at the worker's logs."
)


class LeaseOver(Func):
    """True where a reservation is older than its ``retry_after``, by the database's clock.

    Compared in SQL, so finding the expired reservations reads no row that has
    not expired (``reserved_at + retry_after`` against the clock, per database).
    """

    conditional = True
    output_field = models.BooleanField()

    def __init__(self) -> None:
        super().__init__(F("reserved_at"), F("retry_after"))

    def _columns(self, compiler: Any, connection: Any) -> tuple[str, str, list[Any]]:
        at, at_params = compiler.compile(self.source_expressions[0])
        after, after_params = compiler.compile(self.source_expressions[1])
        return at, after, [*at_params, *after_params]

    def as_sql(self, compiler: Any, connection: Any, *args: Any, **extra_context: Any) -> Any:  # SQLite
        at, after, params = self._columns(compiler, connection)
        return f"(julianday({at}) + {after} / 86400.0 <= julianday('now'))", params

    def as_postgresql(self, compiler: Any, connection: Any, **extra_context: Any) -> Any:
        at, after, params = self._columns(compiler, connection)
        return f"({at} + {after} * interval '1 second' <= STATEMENT_TIMESTAMP())", params

    def as_mysql(self, compiler: Any, connection: Any, **extra_context: Any) -> Any:
        at, after, params = self._columns(compiler, connection)
        return f"(TIMESTAMPADD(SECOND, {after}, {at}) <= UTC_TIMESTAMP(6))", params


class JobQuerySet(models.QuerySet["Job"]):
    def waiting(self) -> JobQuerySet:
        """Jobs a worker may reserve now (unless their queue is paused)."""
        return self.filter(reserved_at__isnull=True, blocked=False, available_at__lte=DbNow())

    def blocked(self) -> JobQuerySet:
        """Jobs waiting for a free slot of their concurrency key."""
        return self.filter(reserved_at__isnull=True, blocked=True)

    def delayed(self) -> JobQuerySet:
        """Jobs that become available later (a delay, a backoff, a rate limit)."""
        return self.filter(reserved_at__isnull=True, blocked=False, available_at__gt=DbNow())

    def reserved(self) -> JobQuerySet:
        """Jobs a worker holds."""
        return self.filter(reserved_at__isnull=False)

    def expired(self) -> JobQuerySet:
        """Reserved jobs whose reservation is older than their ``retry_after`` (to be reclaimed)."""
        return self.filter(LeaseOver(), reserved_at__isnull=False)

    def held(self, job: Job) -> JobQuerySet:
        """The row of ``job`` if nobody reserved it since ``job`` was read."""
        return self.filter(pk=job.pk, attempts=job.attempts)

    def delete_now(self) -> int:
        """Delete the matching rows in one DELETE statement; return how many.

        ``QuerySet.delete()`` first SELECTs the rows and deletes them by id
        when any delete signal receiver is connected, which would drop the
        ``attempts`` condition of a compare-and-set. Job rows have no
        relations and send no delete signals.
        """
        # None when the filter can match nothing (``pk__in=[]``): no statement is sent.
        return int(self._raw_delete(self.db) or 0)


class JobManager(models.Manager["Job"]):
    def get_queryset(self) -> JobQuerySet:
        return JobQuerySet(self.model, using=self._db or alias())

    def waiting(self) -> JobQuerySet:
        return self.get_queryset().waiting()

    def delayed(self) -> JobQuerySet:
        return self.get_queryset().delayed()

    def blocked(self) -> JobQuerySet:
        return self.get_queryset().blocked()

    def reserved(self) -> JobQuerySet:
        return self.get_queryset().reserved()

    # -- reserve -----------------------------------------------------------

    def reserve(self, queues: Sequence[str], *, worker_id: str = "") -> Job | None:
        """Claim the next available job of the first non-empty queue, or return None."""
        jobs = self.reserve_many(queues, limit=1, worker_id=worker_id)
        return jobs[0] if jobs else None

    def reserve_many(
        self,
        queues: Sequence[str],
        *,
        limit: int,
        worker_id: str = "",
        default_tries: int | None = None,
        before_reclaim: Callable[[], None] | None = None,
    ) -> list[Job]:
        """Claim up to ``limit`` jobs from the first non-empty queue in ``queues``.

        When nothing is available, reclaim expired reservations and try once more,
        so only an idle worker pays for the reclaim (``before_reclaim`` is called
        first: a reclaim of many rows can take a while).
        """
        from .claims import claim

        if limit < 1:
            raise ValueError("limit must be at least 1")
        jobs = claim(self.get_queryset().db, queues, limit, worker_id)
        if not jobs:
            jobs = self._reclaim_and_claim(queues, limit, worker_id, default_tries, before_reclaim)
        return jobs

    def _reclaim_and_claim(
        self,
        queues: Sequence[str],
        limit: int,
        worker_id: str,
        default_tries: int | None,
        before_reclaim: Callable[[], None] | None,
    ) -> list[Job]:
        from .claims import claim

        if before_reclaim is not None:
            before_reclaim()
        reclaimed = self.reclaim_expired(default_tries=default_tries)
        from .workers import reclaim_dead

        # Jobs of workers that stopped beating, before their retry_after (workers.py).
        reclaimed += reclaim_dead(default_tries=default_tries)
        from .concurrency import sweep_now_and_then

        if sweep_now_and_then(self.get_queryset().db) or reclaimed:
            return claim(self.get_queryset().db, queues, limit, worker_id)
        return []

    def finish_and_reserve(
        self,
        done: Sequence[Job],
        queues: Sequence[str],
        *,
        limit: int,
        worker_id: str = "",
        default_tries: int | None = None,
        before_reclaim: Callable[[], None] | None = None,
    ) -> tuple[set[int], list[Job]]:
        """Delete ``done`` (jobs that succeeded, as ``delete_many_reserved``), then
        claim up to ``limit`` jobs (as ``reserve_many``); return the ids deleted
        and the jobs claimed.

        On PostgreSQL the DELETE and the claim of the first queue are one
        statement, so a worker in steady state pays one round trip and one
        commit per batch.
        """
        reserve = functools.partial(
            self.reserve_many,
            queues,
            limit=limit,
            worker_id=worker_id,
            default_tries=default_tries,
            before_reclaim=before_reclaim,
        )
        if not done:
            return set(), reserve()
        from .claims import (
            claim_params,
            clears_unique_keys,
            from_claim,
            paused,
            plain_claimed,
            timed,
            uses_flow_claim,
            walks,
        )

        using = self.get_queryset().db
        if (
            connections[using].vendor != "postgresql"
            or not queues
            or queues[0] in paused(using)
            or uses_flow_claim(queues[0])
            or any(job.concurrency_key for job in done)
        ):
            deleted = self.delete_many_reserved(done)
            return deleted, reserve()
        connection = connections[using]
        walk = walks(queues[0])
        members = any(job.batch_id for job in done)
        # Batch members: their batches' counters move in the same statement, in a
        # transaction that enqueues the callbacks of a batch it finished (batches.py).
        with transaction.atomic(using=using) if members else nullcontext(), bound_cursor(connection) as cursor:
            started = time.monotonic()
            cursor.execute(
                _finish_and_claim_sql(connection, walk, clears_unique_keys(queues[0]), members=members),
                [
                    *([job.pk for job in done], [job.attempts for job in done]),
                    *claim_params(worker_id, queues[0], limit, walk=walk),
                ],
            )
            rows = cursor.fetchall()
            timed(queues[0], walk, time.monotonic() - started)
            if members and rows[0][0]:
                from .batches import finished_by_members

                finished_by_members(using, rows[0][0])
        finished = rows[0][0] if members else None
        if members:
            rows = [row[1:] for row in rows]
        deleted = set(rows[0][0])
        jobs = plain_claimed(using, queues[0], from_claim(using, [row[1:] for row in rows if row[1] is not None]))
        if not jobs:
            # The first queue is empty: the others, then as ``reserve_many``. (All of
            # them if a batch just finished: its callbacks came after the claim.)
            from .claims import claim

            jobs = claim(using, queues if finished else queues[1:], limit, worker_id)
            if not jobs:
                jobs = self._reclaim_and_claim(queues, limit, worker_id, default_tries, before_reclaim)
        return deleted, jobs

    # -- extend a reservation ----------------------------------------------

    def extend(self, job: Job, *, worker_id: str) -> bool:
        """Move the reservation of ``job`` to the database's now, if ``worker_id`` still holds it.

        False once the job was finished, released or reclaimed: a later
        reservation is never extended. See ``extend_many``.
        """
        return job.pk in self.extend_many([job], worker_id=worker_id)

    def extend_many(self, jobs: Sequence[Job], *, worker_id: str) -> set[int]:
        """Move the reservations of ``jobs`` that ``worker_id`` still holds to the
        database's now; return the ids of those it still held.

        The worker's heartbeat calls this for every job it holds (running,
        claimed and waiting to run, or ran and waiting for the batched DELETE).
        """
        if not jobs:
            return set()
        held = self.get_queryset().filter(_held_by_reservation(jobs), reserved_by=worker_id, reserved_at__isnull=False)
        # Read the clock once and write it as a value, like the claim: SQLite stores
        # DbNow() as text with 3 decimals, which a reclaim's compare-and-set on
        # reserved_at (6 decimals) would never match.
        rows = list(held.order_by().only("pk").annotate(**_DB_NOW))
        if rows:
            held.update(reserved_at=rows[0].db_now)
        return {row.pk for row in rows}

    # -- finish a reservation ----------------------------------------------

    def delete_many_reserved(self, jobs: Sequence[Job]) -> set[int]:
        """Delete jobs that succeeded, in one statement, where their reservation is
        still theirs; return the ids deleted.

        The batched counterpart of ``delete_reserved`` for jobs with nothing to
        enqueue after them; fixed SQL, as it runs once per batch on the worker's
        hot path. On PostgreSQL the statement returns the ids it deleted;
        elsewhere its row count tells when all were, and otherwise one more
        query finds which rows are still there.
        """
        if not jobs:
            return set()
        if any(job.concurrency_key or job.batch_id for job in jobs):
            using = self.get_queryset().db
            with transaction.atomic(using=using):
                deleted = self._delete_many(jobs)
                ended = [job for job in jobs if job.pk in deleted]
                _slots_freed(using, ended)
                _members_ended(using, succeeded=ended)
            return deleted
        return self._delete_many(jobs)

    def _delete_many(self, jobs: Sequence[Job]) -> set[int]:
        connection = connections[self.get_queryset().db]
        table, pk, attempts = sql_names(connection, "id", "attempts")
        ids = {job.pk for job in jobs}
        with bound_cursor(connection) as cursor:
            if connection.vendor == "postgresql":
                cursor.execute(_delete_sql(connection), [[job.pk for job in jobs], [job.attempts for job in jobs]])
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
        # A row still there was not deleted: its reservation is another's now.
        return ids - set(self.get_queryset().filter(pk__in=ids).values_list("pk", flat=True))

    def delete_reserved(self, job: Job, *, follow_ups: Sequence[Job] = ()) -> bool:
        """Delete a job that succeeded, if its reservation is still ``job``'s.

        ``follow_ups`` (a chain's next step, callbacks) are inserted in the same
        transaction, so they exist if and only if the job is gone.
        """
        queryset = self.get_queryset().held(job)
        if not follow_ups and not job.concurrency_key and not job.batch_id:
            return bool(queryset.delete_now())
        with transaction.atomic(using=queryset.db):
            deleted = queryset.delete_now()
            if deleted:
                if job.batch_id:
                    follow_ups = _batch_member_follows(queryset.db, job, follow_ups)
                self.bulk_enqueue(follow_ups)
                _slots_freed(queryset.db, [job])
        return bool(deleted)

    def release(self, job: Job, *, delay: float = 0, give_back: bool = False, exception: bool = False) -> bool:
        """Put a reserved job back, available after ``delay`` seconds.

        ``give_back``: the reservation does not spend one of the job's tries (it
        never started, or the database connection broke under it). ``exception``:
        the attempt ended in an exception (counted for ``max_exceptions``).
        """
        changes: dict[str, Any] = {"reserved_at": None, "reserved_by": "", "available_at": _after(delay)}
        if give_back:
            changes["given_back"] = F("given_back") + 1
        if exception:
            changes["exceptions"] = F("exceptions") + 1
        queryset = self.get_queryset().held(job)
        with transaction.atomic(using=queryset.db) if job.concurrency_key else nullcontext():
            released = bool(queryset.update(**changes))
            if released:
                _slots_freed(queryset.db, [job])
        if released and give_back:
            job.given_back += 1
        return released

    def fail(
        self,
        job: Job,
        *,
        error: str,
        exception_class: str,
        reserved_at: datetime | None = None,
        follow_ups: Sequence[Job] = (),
    ) -> FailedJob | None:
        """Move a job to ``FailedJob`` in one transaction; None if it is no longer ours.

        ``follow_ups`` (a failure callback) are inserted in the same transaction.
        """
        queryset = self.get_queryset().held(job)
        if reserved_at is not None:
            queryset = queryset.filter(reserved_at=reserved_at)
        with transaction.atomic(using=queryset.db):
            if not queryset.delete_now():
                return None
            _slots_freed(queryset.db, [job])
            if follow_ups:
                self.bulk_enqueue(follow_ups)
            failed = FailedJob.objects.using(queryset.db).create(
                **_failed_values(job), exception_class=exception_class[:255], error=error, failed_at=DbNow()
            )
            read_back(failed, "failed_at")
            if job.batch_id:
                _members_ended(queryset.db, failed=[job])
            return failed

    # -- cancel --------------------------------------------------------------

    def cancel(self, job_id: int, *, hard: bool = False, reason: str = "") -> str:
        """Cancel a job: ``"cancelled"`` if nobody held it (it moved to ``FailedJob``
        as cancelled, in one transaction, a chain's remaining steps with it),
        ``"requested"`` if a worker holds it (the worker stops it: when it next
        checks, or with ``hard`` at once, as at a timeout), ``"missing"`` if there is
        no such row (finished, failed, or never enqueued).
        """
        queryset = self.get_queryset()
        level = CANCEL_HARD if hard else CANCEL
        # Twice at most: a claim between the read and the write (SQLite takes no row
        # lock) makes the compare-and-set miss, and the job is then a running one.
        for _ in range(2):
            with transaction.atomic(using=queryset.db):
                job = queryset.filter(pk=job_id).select_for_update().first()
                if job is None:
                    return "missing"
                if job.reserved_at is None:
                    error = f"{job.name} (job {job.pk}) was cancelled before it ran{f': {reason}' if reason else '.'}"
                    failed = self.fail(job, error=error, exception_class=CANCELLED_CLASS)
                    if failed is not None:
                        transaction.on_commit(
                            functools.partial(_send_cancelled, job.pk, failed), using=queryset.db, robust=True
                        )
                        return "cancelled"
                    continue
                if queryset.held(job).filter(reserved_at__isnull=False).update(cancel=Greatest(F("cancel"), level)):
                    return "requested"
        return "missing"

    def cancel_requests(self, jobs: Sequence[Job]) -> dict[int, int]:
        """The cancel requests among these reservations: ``{id: CANCEL or CANCEL_HARD}``."""
        if not jobs:
            return {}
        return dict(
            self.get_queryset().filter(_held_by_reservation(jobs), cancel__gt=NO_CANCEL).values_list("pk", "cancel")
        )

    # -- reclaim -----------------------------------------------------------

    def expired(self) -> list[Job]:
        """Reserved jobs whose reservation is older than their ``retry_after`` (compared in
        SQL; ``Job.objects.get_queryset().expired()`` is the queryset)."""
        return list(self.get_queryset().expired())

    def reclaim_expired(self, *, default_tries: int | None = None, ids: Iterable[int] | None = None) -> int:
        """Reclaim reservations older than their ``retry_after``; return how many.

        A job that has used its tries moves to ``FailedJob`` instead of running again.
        ``ids`` limits the reclaim to those jobs. Each row is reclaimed on its own:
        one the database refuses to change is moved aside (``move_aside``) and the
        others are reclaimed all the same.
        """
        tries_default = default_tries if default_tries is not None else int(conf.get("TRIES"))
        expired = self.get_queryset().expired().order_by().only(*_LEASE_FIELDS).annotate(**_DB_NOW)
        if ids is not None:
            expired = expired.filter(pk__in=list(ids))
        reclaimed = 0
        for job in expired:
            assert job.reserved_at is not None
            if job.tries_spent >= job.tries_allowed(tries_default):
                error = RECLAIMED_ERROR.format(
                    name=job.name, id=job.pk, attempts=job.attempts, retry_after=job.retry_after
                )
                outcome = "failed"
                done = self._per_row(job, functools.partial(self._fail_lost, job, error, "MaxAttemptsExceeded"))
            else:
                outcome = "waiting"
                done = self._per_row(job, functools.partial(self._reclaim_one, job))
            if done:
                reclaimed += 1
                logger.warning(
                    "reclaimed job=%s id=%s attempt=%s reserved_by=%s outcome=%s",
                    job.name,
                    job.pk,
                    job.attempts,
                    job.reserved_by or "-",
                    outcome,
                )
        return reclaimed

    def _reclaim_one(self, job: Job) -> bool:
        """Put back one expired reservation, if it is still the one read."""
        using = self.get_queryset().db
        with transaction.atomic(using=using):
            done = bool(
                self.get_queryset()
                .held(job)
                .filter(reserved_at=job.reserved_at)
                .update(reserved_at=None, reserved_by="")
            )
            if done:
                _slots_freed(using, [job])
        return done

    def _fail_lost(self, job: Job, error: str, exception: str) -> bool:
        """Fail a reservation that was lost (expired, or its worker died) on its last try."""
        full = self.get_queryset().held(job).filter(reserved_at=job.reserved_at).first()
        if full is None:
            return False
        failed = self.fail(
            full,
            error=error,
            exception_class=f"django_dbqueue.exceptions.{exception}",
            reserved_at=job.reserved_at,
            follow_ups=_failure_follow_ups(full),
        )
        return failed is not None

    def _per_row(self, job: Job, change: Callable[[], bool]) -> bool:
        """Run ``change`` (a state change of one row, in a loop over rows) under a
        savepoint; if the database refuses it, move the row aside instead, so one
        bad row never stops the loop. A lost connection still ends the loop."""
        using = self.get_queryset().db
        try:
            with transaction.atomic(using=using):
                return change()
        except DatabaseError as exc:
            if caused_by_lost_connection(exc, using):
                raise
            return self.move_aside(job, reason=f"the database refused a change of its row ({type(exc).__name__})")

    def move_aside(self, job: Job, *, reason: str) -> bool:
        """Move a row the worker cannot act on to ``FailedJob`` unrun, with ``reason``
        in its error, whoever holds it; return whether it moved.

        For a row written past the table's checks (by hand, ``update()``, raw SQL,
        or before migration 0014) or one whose value the claim cannot read. Its
        values are kept, brought within bounds, and the error says which were not.
        """
        using = self.get_queryset().db
        full = self.get_queryset().filter(pk=job.pk).first()
        if full is None:
            return False
        error = (
            f"{full.name} (job {full.pk}) was moved aside unrun: {reason}. "
            "Fix the row's values (or the code that wrote them) and retry it."
        )
        with transaction.atomic(using=using):
            if not self.get_queryset().held(full).delete_now():
                return False
            failed = FailedJob.objects.using(using).create(
                **_failed_values(full), exception_class=INVALID_ROW_CLASS, error=error, failed_at=DbNow()
            )
        logger.error(
            "job moved aside job=%s id=%s queue=%s failed_id=%s reason=%s",
            full.name,
            full.pk,
            full.queue,
            failed.pk,
            reason,
        )
        return True

    def reclaim_worker(
        self,
        worker_id: str,
        *,
        error_for: Callable[[float], str],
        default_tries: int | None = None,
    ) -> int:
        """Release or fail every job a dead worker held, without waiting for retry_after.

        ``error_for(seconds_held)`` gives the error stored for a job that used its tries.
        """
        count = 0
        tries_default = default_tries if default_tries is not None else int(conf.get("TRIES"))
        held = self.get_queryset().filter(reserved_by=worker_id, reserved_at__isnull=False)
        for job in held.order_by().only(*_LEASE_FIELDS).annotate(**_DB_NOW):
            assert job.reserved_at is not None
            if job.tries_spent >= job.tries_allowed(tries_default):
                error = error_for((job.db_now - job.reserved_at).total_seconds())
                done = self._per_row(job, functools.partial(self._fail_lost, job, error, "WorkerLost"))
            else:
                done = self._per_row(job, functools.partial(self.release, job))
            count += done
        return count

    # -- enqueue -----------------------------------------------------------

    def bulk_enqueue(self, jobs: Iterable[Job], *, batch_size: int = 1000) -> list[Job]:
        """Insert many jobs, one statement per ``batch_size`` rows.

        On PostgreSQL a large insert is followed by ANALYZE: planned with the
        statistics of a nearly empty table, the claim would sort the whole
        queue instead of reading its index in order. ``enqueue_many`` inserts
        new calls faster with ``bulk.insert``.
        """
        from .insert import analyze_if_large

        queryset = self.get_queryset()
        rows = list(jobs)
        check_rows(rows)
        if any(row.unique_key for row in rows):
            return [row for row in self.insert_each(rows) if row is not None]
        rows = queryset.bulk_create(rows, batch_size=batch_size)
        analyze_if_large(queryset.db, len(rows))
        return rows

    def insert_each(self, rows: Sequence[Job]) -> list[Job | None]:
        """Insert ``rows`` one by one in one transaction; a row whose unique key
        another job holds is left out (None in its place) and logged.

        For rows built from stored steps (a chain's next step, a callback, a
        retry from FailedJob): a duplicate there is dropped, as a duplicate
        enqueue is, and never fails the transaction that carries it. Each row
        with a unique key is inserted under a savepoint, so the unique index's
        refusal undoes that row alone.
        """
        using = self.get_queryset().db
        check_rows(rows)
        inserted: list[Job | None] = []
        with transaction.atomic(using=using):
            for row in rows:
                if not row.unique_key:
                    row.save(force_insert=True, using=using)
                    inserted.append(row)
                    continue
                try:
                    with transaction.atomic(using=using):
                        row.save(force_insert=True, using=using)
                except IntegrityError as exc:
                    from .insert import holds_unique_key

                    if not holds_unique_key(exc, connections[using]):
                        raise
                    holder = self.get_queryset().filter(unique_key=row.unique_key).values_list("pk", flat=True).first()
                    logger.info("job=%s not enqueued: job %s holds its unique key %r", row.name, holder, row.unique_key)
                    row.pk = None
                    inserted.append(None)
                    continue
                inserted.append(row)
        return inserted


def check_rows(rows: Iterable[Job]) -> None:
    """Raise ValueError naming the first row that holds a value out of the table's bounds."""
    for row in rows:
        error = row_error(row.__dict__)
        if error is not None:
            raise ValueError(f"Cannot enqueue {row.name}: {error}")


def _held_by_reservation(jobs: Iterable[Job]) -> Q:
    """Rows that still carry these jobs' reservations: ``(id, attempts)`` unchanged."""
    condition = Q()
    for job in jobs:
        condition |= Q(pk=job.pk, attempts=job.attempts)
    return condition


def sql_names(connection: Any, *fields: str) -> list[str]:
    """The job table's quoted name, then the quoted columns of ``fields``: identifiers
    for fixed SQL come from the model's meta, never from input."""
    meta = Job._meta
    qn = connection.ops.quote_name
    columns = {field.name: str(field.column) for field in meta.concrete_fields}
    return [str(qn(meta.db_table)), *(str(qn(columns[name])) for name in fields)]


@cached_sql
def _delete_sql(connection: Any) -> str:
    """PostgreSQL: delete the rows whose (id, attempts) are in two arrays, returning their ids."""
    return _delete_returning(connection)


def _delete_returning(connection: Any, *fields: str) -> str:
    """``_delete_sql``, returning ``fields`` besides the id."""
    table, pk, attempts, *others = sql_names(connection, "id", "attempts", *fields)
    extra = "".join(f", {table}.{column} AS {name}" for name, column in zip(fields, others, strict=True))
    return (
        f"DELETE FROM {table} USING unnest(%s::bigint[], %s::bigint[]) AS done (id, attempts) "
        f"WHERE {table}.{pk} = done.id AND {table}.{attempts} = done.attempts RETURNING {table}.{pk} AS id{extra}"
    )


def _finish_and_claim_sql(connection: Any, walk: bool, clear: bool, *, members: bool = False) -> str:
    """PostgreSQL: ``_delete_sql`` and ``claims.claim_sql`` in one statement and one transaction.

    Each row holds the array of deleted ids, then a claimed row's columns; when
    nothing was claimed, one row holds the array and NULLs. Both parts read the
    same snapshot; they never touch the same rows (one deletes rows this worker
    holds, the other claims rows nobody does).

    With ``members`` (some of the jobs are batch members), each batch's
    ``pending`` goes down by its members deleted, and every row starts with the
    array of the batches that reached 0 (``batches.finished_by_members``).
    """
    key = (connection.vendor, walk, clear, members)
    text = _FINISH_AND_CLAIM.get(key)
    if text is None:
        from .claims import claim_sql

        claim = claim_sql(connection, walk=walk, clear=clear)
        if not members:
            text = (
                f"WITH done AS ({_delete_sql(connection)}), claimed AS ({claim}) "
                "SELECT ARRAY(SELECT id FROM done), claimed.* FROM (SELECT 1) AS one LEFT JOIN claimed ON TRUE"
            )
        else:
            qn = connection.ops.quote_name
            batch, batch_id, pending = (
                qn(JobBatch._meta.db_table),
                qn(str(JobBatch._meta.get_field("id").column)),
                qn(str(JobBatch._meta.get_field("pending").column)),
            )
            text = (
                f"WITH done AS ({_delete_returning(connection, 'batch_id')}), "
                f"counted AS (SELECT batch_id, count(*) AS n FROM done WHERE batch_id IS NOT NULL GROUP BY batch_id), "
                f"moved AS (UPDATE {batch} SET {pending} = {batch}.{pending} - counted.n FROM counted "
                f"WHERE {batch}.{batch_id} = counted.batch_id "
                f"RETURNING {batch}.{batch_id} AS id, {batch}.{pending} AS left), "
                f"claimed AS ({claim}) "
                "SELECT ARRAY(SELECT id FROM moved WHERE moved.left = 0), ARRAY(SELECT id FROM done), claimed.* "
                "FROM (SELECT 1) AS one LEFT JOIN claimed ON TRUE"
            )
        _FINISH_AND_CLAIM[key] = text
    return text


# ``_finish_and_claim_sql`` per vendor, walk, clear and members (see ``claims.claim_sql``).
_FINISH_AND_CLAIM: dict[tuple[str, bool, bool, bool], str] = {}


def _slots_freed(using: str, jobs: Iterable[Job]) -> None:
    """In the transaction that ended these jobs' reservations: unblock the rows
    waiting for a slot of their concurrency keys (concurrency.py)."""
    keys = [job.concurrency_key for job in jobs if job.concurrency_key]
    if keys:
        from .concurrency import unblock

        unblock(using, keys)


def _members_ended(using: str, *, succeeded: Iterable[Job] = (), failed: Iterable[Job] = ()) -> None:
    """In the transaction that ended these jobs: move their batches' counters (batches.py)."""
    from .batches import count_members, members_ended

    done, lost = count_members(succeeded), count_members(failed)
    if done or lost:
        members_ended(using, succeeded=done, failed=lost)


def _batch_member_follows(using: str, job: Job, follow_ups: Sequence[Job]) -> Sequence[Job]:
    """In the transaction that deleted batch member ``job`` (it succeeded): count it
    ended unless its chain goes on; drop the chain's next step if the batch was
    cancelled (the member then counts as cancelled). Return the rows to insert."""
    from collections import Counter

    from .batches import members_ended

    assert job.batch_id is not None
    follows = [row for row in follow_ups if row.batch_id == job.batch_id]
    if not follows:
        members_ended(using, succeeded=Counter({job.batch_id: 1}))
        return follow_ups
    cancelled = (
        JobBatch.objects.using(using).select_for_update().filter(pk=job.batch_id, cancelled_at__isnull=False).exists()
    )
    if not cancelled:
        return follow_ups
    members_ended(using, cancelled=Counter({job.batch_id: 1}))
    return [row for row in follow_ups if row.batch_id != job.batch_id]


def _send_cancelled(job_id: int, failed: FailedJob) -> None:
    from .signals import job_cancelled

    job_cancelled.send_robust(sender=Job, job_id=job_id, failed_job=failed)


# The columns a reclaim reads of an expired reservation (the rest, with the
# payload, only for a row it fails).
_LEASE_FIELDS = (
    "id", "queue", "name", "attempts", "given_back", "max_tries", "retry_after", "reserved_at",
    "reserved_by", "concurrency_key", "batch_id",
)  # fmt: skip


def _failed_values(job: Job) -> dict[str, Any]:
    """The ``FailedJob`` columns of ``job``, each brought within the job table's bounds
    (a row written past them must still move to ``FailedJob``, whose checks refuse less)."""
    values = {
        "job_id": job.pk,
        "batch_id": job.batch_id,
        "queue": job.queue,
        "name": job.name,
        "payload": job.payload,
        "created_at": job.created_at,
        "priority": job.priority,
        "max_tries": job.max_tries,
        "retry_after": job.retry_after,
        "timeout": job.timeout,
        "attempts": job.attempts,
    }
    if row_error(values) is None:
        return values
    for column, (low, high) in ROW_BOUNDS.items():
        value = values.get(column)
        if column not in values or (value is None and column in NULLABLE_BOUNDS):
            continue
        value = value if isinstance(value, int) else low
        values[column] = max(low, value) if high is None else min(high, max(low, value))
    return values


def _failure_follow_ups(job: Job) -> list[Job]:
    from .rows import follow_ups

    return follow_ups(job, succeeded=False)


def _after(delay: float) -> Any:
    """The database clock, ``delay`` seconds from now."""
    if delay <= 0:
        return DbNow()
    return DbNow() + timedelta(seconds=delay)


# Values of ``Job.cancel``.
NO_CANCEL, CANCEL, CANCEL_HARD = 0, 1, 2
CANCELLED_CLASS = "django_dbqueue.exceptions.JobCancelled"
INVALID_ROW_CLASS = "django_dbqueue.exceptions.InvalidJobRow"


NOT_NEGATIVE = [MinValueValidator(0)]


def bounds_condition() -> Q:
    """The job table's CHECK condition: every column of ``ROW_BOUNDS`` within its bounds.

    A NULL passes a CHECK (and Django's validation of one), so the nullable
    columns need no ``IS NULL OR``: each node costs PostgreSQL work in every
    statement that writes a row (docs/performance.md).
    """
    condition = Q()
    for column, (low, high) in ROW_BOUNDS.items():
        condition &= Q(**{f"{column}__gte": low}) if high is None else Q(**{f"{column}__range": (low, high)})
    return condition


class Job(models.Model):
    """A job waiting, delayed or reserved. Finished jobs are deleted."""

    id = models.BigAutoField(primary_key=True)
    queue = models.CharField(max_length=100, default="default")
    name = models.CharField(max_length=200, help_text="Registered name of the job definition.")
    payload = models.TextField(help_text="JSON envelope: arguments and options.")
    # Higher runs first within a queue; Django's Tasks framework uses -100..100.
    # The bounds of this and the other numbered columns are the table's one CHECK
    # constraint (Meta.constraints), checked first where rows are built
    # (validation.row_error); the validators say the same to forms.
    priority = models.SmallIntegerField(
        default=0, validators=[MinValueValidator(MIN_PRIORITY), MaxValueValidator(MAX_PRIORITY)]
    )
    # Reservations so far; bumped by every reserve and never reset.
    attempts = models.IntegerField(default=0, validators=NOT_NEGATIVE)
    # Reservations given back without spending a try: claimed but never started
    # (a stopping worker), or ended by the loss of the database connection, not
    # by the job. The tries checks count ``attempts - given_back``.
    given_back = models.IntegerField(default=0, db_default=0, validators=NOT_NEGATIVE)
    # A request to cancel the job while a worker holds it (``Job.objects.cancel``):
    # NO_CANCEL, CANCEL (the job stops when it next checks) or CANCEL_HARD (the
    # worker stops it as at a timeout). A job nobody holds is cancelled at once.
    cancel = models.SmallIntegerField(default=0, db_default=0, validators=NOT_NEGATIVE)
    # Attempts that ended in an exception and were released (for ``max_exceptions``).
    exceptions = models.IntegerField(default=0, db_default=0, validators=NOT_NEGATIVE)
    # None: the worker's --tries (or DBQUEUE["TRIES"]) applies.
    max_tries = models.SmallIntegerField(null=True, blank=True, validators=NOT_NEGATIVE)
    # Stored per row so any worker can tell when a reservation has expired.
    retry_after = models.IntegerField(validators=NOT_NEGATIVE)
    # Seconds one run may take; None: the worker's --timeout applies.
    timeout = models.IntegerField(null=True, blank=True, validators=NOT_NEGATIVE)
    available_at = models.DateTimeField()
    reserved_at = models.DateTimeField(null=True, blank=True)
    # Id of the worker process holding the reservation, so a supervisor can
    # reclaim a dead child's jobs at once.
    reserved_by = models.CharField(max_length=100, blank=True, default="")
    created_at = models.DateTimeField()
    # Flow control (docs/flow.md); NULL, not "", when unused: unique indexes
    # leave NULLs out, and partial indexes hold only the rows that use it. No other row may hold the same unique_key
    # (unique.py): it is freed when the row is deleted or moves to FailedJob, or
    # by the claim when unique_until_start is set.
    unique_key = models.CharField(max_length=255, null=True, blank=True)  # noqa: DJ001
    unique_until_start = models.BooleanField(default=False, db_default=False)
    # At most concurrency_limit reserved rows share a concurrency_key (concurrency.py).
    concurrency_key = models.CharField(max_length=255, null=True, blank=True)  # noqa: DJ001
    concurrency_limit = models.SmallIntegerField(null=True, blank=True, validators=NOT_NEGATIVE)
    # Waiting for a free slot of its concurrency key: claims skip it until a
    # reservation of that key ends and unblocks it.
    blocked = models.BooleanField(default=False, db_default=False)
    # The rate-limit bucket its starts spend, and that bucket's limit as
    # "count/seconds/burst" (rates.py).
    rate_key = models.CharField(max_length=255, null=True, blank=True)  # noqa: DJ001
    rate_limit = models.CharField(max_length=50, null=True, blank=True)  # noqa: DJ001
    # The batch this row is a member of (batches.py): its outcome moves the
    # batch's counters in the same transaction. NULL for jobs outside batches,
    # which the partial index (migration 0009) leaves out.
    batch_id = models.BigIntegerField(null=True, blank=True)

    objects = JobManager()

    # The database's clock, on rows read by queries that annotate it.
    db_now: datetime

    class Meta:
        db_table = "dbqueue_job"
        ordering = ["-priority", "available_at", "id"]
        # Its indexes are made by the migrations, per database (the partial ones
        # where the database has partial indexes): dbqueue_job_claim (queue,
        # priority DESC, available_at, id) serves the claim on MariaDB, MySQL and
        # SQLite; on PostgreSQL the claim reads dbqueue_job_waiting, the same
        # columns WHERE reserved_at IS NULL AND NOT blocked (0004, 0008), and the
        # full one is gone (0012). dbqueue_job_reserved (reserved_at) serves the
        # reclaim and the lookups of reserved rows, partial (reserved_at IS NOT
        # NULL) on PostgreSQL and SQLite; the flow-control and batch columns have
        # partial indexes of their own (0008, 0009).
        permissions = [("cancel_job", "Can cancel jobs, waiting or running")]
        # One CHECK for every bound the worker relies on (validation.ROW_BOUNDS;
        # migration 0014). PostgreSQL compiles it again in each statement that
        # writes a row, at a cost that follows its number of terms
        # (docs/performance.md): keep it to the bounds the worker needs.
        constraints = [models.CheckConstraint(condition=bounds_condition(), name="dbqueue_job_bounds")]

    def __str__(self) -> str:
        return f"{self.name} #{self.pk}"

    def tries_allowed(self, default: int) -> int:
        return self.max_tries if self.max_tries is not None else default

    @property
    def tries_spent(self) -> int:
        """Reservations that count against the job's tries."""
        return self.attempts - self.given_back


# Result store records of ``@job`` jobs (``TaskResultRecord``): their key, their
# ``backend`` (tasks name theirs), and the status of a job retried from FailedJob,
# whose ``job_id`` names the new run.
JOB_RECORDS = ""
RETRIED = "retried"


def record_id(job_id: int) -> str:
    """The result store's key for a ``@job`` job."""
    return f"job:{job_id}"


def _retry_pointers(retried: list[tuple[int, Job]]) -> None:
    """Point the records of failed jobs just retried (old id, new row) at their new runs.

    One multi-row upsert per chunk of retries: a record the failed run kept (its
    result, with ``results=True``) is replaced, since it belongs to that run. The
    times are the new rows' ``created_at``, read back from the database where the
    backend returns them; values, not expressions, so PostgreSQL inserts the rows
    with one ``unnest``.
    """
    records = []
    fallback = None
    for old_id, job in retried:
        if job.pk is None:  # MySQL (not MariaDB) returns no ids from a bulk insert
            continue
        created = job.created_at
        if hasattr(created, "resolve_expression"):
            # Not read back (Django 5.2, MySQL): the stored time of the first row, read once.
            fallback = fallback or Job.objects.filter(pk=job.pk).values_list("created_at", flat=True).get()
            created = fallback
        records.append(
            TaskResultRecord(
                id=record_id(old_id),
                task_path=job.name,
                backend=JOB_RECORDS,
                queue=job.queue,
                priority=job.priority,
                status=RETRIED,
                job_id=job.pk,
                enqueued_at=created,
                finished_at=created,
            )
        )
    if not records:
        return
    connection = connections[TaskResultRecord.objects.db]
    TaskResultRecord.objects.bulk_create(
        records,
        update_conflicts=True,
        # MySQL's ON DUPLICATE KEY UPDATE names no target; the primary key is implied.
        unique_fields=["id"] if connection.features.supports_update_conflicts_with_target else None,
        update_fields=["status", "job_id", "task_path", "queue", "priority", "enqueued_at", "finished_at"],
    )


def _cancelled_batches(using: str, ids: set[int | None]) -> set[int | None]:
    """The cancelled batches among ``ids``."""
    if not ids:
        return set()
    cancelled = JobBatch.objects.using(using).filter(pk__in=ids, cancelled_at__isnull=False)
    return set(cancelled.values_list("pk", flat=True))


def _flow_columns(text: str) -> dict[str, Any]:
    """The flow-control columns a failed job had, from its envelope (``chains.new_job`` keeps them there)."""
    from .exceptions import PayloadError
    from .payload import raw

    try:
        flow = raw(text).get("flow")
    except (ValueError, PayloadError, RecursionError):
        return {}
    if not isinstance(flow, dict):
        return {}
    # Only the flow columns (bulk.Flow's fields): anything else an envelope holds is
    # left out, and the values are checked with the row's (``_without_invalid``).
    return {name: value for name, value in flow.items() if name in _FLOW_COLUMNS}


_FLOW_COLUMNS = frozenset(
    ("unique_key", "unique_until_start", "concurrency_key", "concurrency_limit", "rate_key", "rate_limit")
)


def _without_invalid(failed: list[FailedJob], rows: list[Job]) -> tuple[list[FailedJob], list[Job]]:
    """Leave out the failed jobs whose row would hold a value out of bounds: they stay failed, with an error logged."""
    kept = []
    for old, new in zip(failed, rows, strict=True):
        error = row_error(new.__dict__)
        if error is None:
            kept.append((old, new))
        else:
            logger.error("failed job not retried failed_id=%s job=%s: its row %s", old.pk, old.name, error)
    return [old for old, _ in kept], [new for _, new in kept]


def _without_taken_keys(failed: list[FailedJob], rows: list[Job]) -> tuple[list[FailedJob], list[Job]]:
    """Leave out the failed jobs whose unique key another job holds now: they stay failed, with a warning."""
    keys = [row.unique_key for row in rows if row.unique_key]
    if not keys:
        return failed, rows
    taken = set(Job.objects.filter(unique_key__in=keys).values_list("unique_key", flat=True))
    if not taken:
        return failed, rows
    kept = [(old, new) for old, new in zip(failed, rows, strict=True) if new.unique_key not in taken]
    for old, new in zip(failed, rows, strict=True):
        if new.unique_key in taken:
            logger.warning(
                "failed job %s (%s) not retried: job %s with the same unique key %r is waiting or running",
                old.pk,
                old.name,
                Job.objects.filter(unique_key=new.unique_key).values_list("pk", flat=True).first(),
                new.unique_key,
            )
    return [old for old, _ in kept], [new for _, new in kept]


class FailedJobQuerySet(models.QuerySet["FailedJob"]):
    def retry(self) -> list[Job]:
        """Put each failed job back as a fresh job and remove its failed row, in one transaction."""
        with transaction.atomic(using=self.db):
            failed = list(self.select_for_update().order_by("id"))
            # A failed member of a cancelled batch would not run in it: it runs on its own.
            outside = _cancelled_batches(self.db, {row.batch_id for row in failed if row.batch_id})
            rows = [
                Job(
                    queue=row.queue,
                    name=row.name,
                    payload=row.payload,
                    priority=row.priority,
                    max_tries=row.max_tries,
                    retry_after=row.retry_after,
                    timeout=row.timeout,
                    available_at=DbNow(),
                    created_at=DbNow(),
                    batch_id=None if row.batch_id in outside else row.batch_id,
                    **_flow_columns(row.payload),
                )
                for row in failed
            ]
            failed, rows = _without_invalid(failed, rows)
            failed, rows = _without_taken_keys(failed, rows)
            if any(row.unique_key for row in rows):
                # A key taken since the check above: that failed job stays failed.
                kept = [(old, new) for old, new in zip(failed, Job.objects.insert_each(rows), strict=True) if new]
                failed, jobs = [old for old, _ in kept], [new for _, new in kept if new is not None]
            else:
                jobs = Job.objects.bulk_enqueue(rows)
            FailedJob.objects.using(self.db).filter(pk__in=[row.pk for row in failed]).delete()
            if any(row.batch_id for row in failed):
                from .batches import count_members, members_ended

                members_ended(
                    self.db,
                    retried=count_members(row for row in failed if row.batch_id not in outside),
                    left=count_members(row for row in failed if row.batch_id in outside),
                )
            # A handle of the failed id follows the job to its new run.
            _retry_pointers([(row.job_id, job) for row, job in zip(failed, jobs, strict=True)])
        from .signals import job_enqueued

        for job in jobs:
            job_enqueued.send_robust(sender=FailedJob, job=job)
        return jobs


class FailedJobManager(models.Manager["FailedJob"]):
    def get_queryset(self) -> FailedJobQuerySet:
        return FailedJobQuerySet(self.model, using=self._db or alias())

    def retry(self, ids: Iterable[int]) -> list[Job]:
        """Retry the failed jobs with these ids; see ``FailedJobQuerySet.retry``."""
        return self.get_queryset().filter(pk__in=list(ids)).retry()


class FailedJob(models.Model):
    """A job that used its tries or could not run: the dead-letter table."""

    id = models.BigAutoField(primary_key=True)
    job_id = models.BigIntegerField(help_text="Id the job had while it was queued.")
    queue = models.CharField(max_length=100)
    name = models.CharField(max_length=200)
    payload = models.TextField(help_text="The whole envelope, as it was queued.")
    # The job's options, so a retry queues it exactly as it was.
    priority = models.SmallIntegerField(default=0)
    max_tries = models.PositiveSmallIntegerField(null=True, blank=True)
    retry_after = models.PositiveIntegerField(default=60)
    timeout = models.PositiveIntegerField(null=True, blank=True)
    attempts = models.PositiveIntegerField()
    exception_class = models.CharField(max_length=255)
    error = models.TextField(help_text="The full traceback, or why the job could not run.")
    created_at = models.DateTimeField(help_text="When the job was first enqueued.")
    failed_at = models.DateTimeField()
    # The batch the job was a member of; a retry puts it back into that batch.
    batch_id = models.BigIntegerField(null=True, blank=True)

    objects = FailedJobManager()

    class Meta:
        db_table = "dbqueue_failed_job"
        ordering = ["-failed_at", "-id"]
        indexes = [
            models.Index(fields=["failed_at"], name="dbqueue_failed_at"),
            models.Index(fields=["batch_id"], name="dbqueue_failed_batch"),
        ]

    def __str__(self) -> str:
        return f"{self.name} (failed #{self.pk})"

    @property
    def error_summary(self) -> str:
        """The last non-empty line of the error: the exception and its message."""
        lines = [line for line in self.error.strip().splitlines() if line.strip()]
        return lines[-1].strip() if lines else ""


class QueueDatabaseManager(models.Manager[Any]):
    """Reads and writes the database that holds the queue."""

    def get_queryset(self) -> models.QuerySet[Any]:
        return super().get_queryset().using(self._db or alias())


class JobProgress(models.Model):
    """Progress of one job (key = its id) or chain (key = ``chain:<id>``)."""

    id = models.BigAutoField(primary_key=True)
    key = models.CharField(max_length=100, unique=True)
    percent = models.FloatField(default=0)
    stage = models.CharField(max_length=200, blank=True, default="")
    finished = models.BooleanField(default=False)
    failed = models.BooleanField(default=False)
    error = models.TextField(blank=True, default="")
    updated_at = models.DateTimeField()

    objects = QueueDatabaseManager()

    class Meta:
        db_table = "dbqueue_job_progress"
        verbose_name_plural = "job progress"
        indexes = [models.Index(fields=["updated_at"], name="dbqueue_progress_updated")]
        constraints = [
            models.CheckConstraint(
                condition=Q(percent__gte=0, percent__lte=100),
                name="dbqueue_progress_percent_range",
            ),
        ]

    def __str__(self) -> str:
        return f"{self.key}: {self.percent:.0f}%"


class QueueControl(models.Model):
    """Markers every worker on every host reads, such as a restart request."""

    key = models.CharField(max_length=100, unique=True)
    updated_at = models.DateTimeField()

    objects = QueueDatabaseManager()

    class Meta:
        db_table = "dbqueue_control"
        verbose_name = "queue control marker"

    def __str__(self) -> str:
        return f"{self.key} at {self.updated_at}"


class QueueWorker(models.Model):
    """A live worker process: the queues it serves, written at start and by its heartbeat.

    Removed when the worker stops; a row whose ``last_seen_at`` is old belongs to a
    worker that died.
    """

    id = models.BigAutoField(primary_key=True)
    worker_id = models.CharField(max_length=100, unique=True, help_text="As in Job.reserved_by.")
    hostname = models.CharField(max_length=100)
    pid = models.PositiveIntegerField()
    queues = models.TextField(help_text="Queues served, comma-separated, highest priority first.")
    started_at = models.DateTimeField()
    last_seen_at = models.DateTimeField()
    # The options that matter to an operator, as "name=value" words (threads=4 batch=10 ...).
    options = models.CharField(max_length=200, blank=True, default="", db_default="")
    # Written with ``last_seen_at`` by the heartbeat: jobs run so far, those that
    # failed for good, those running now, and the one running longest.
    processed = models.PositiveBigIntegerField(default=0, db_default=0)
    failed = models.PositiveBigIntegerField(default=0, db_default=0)
    running = models.PositiveIntegerField(default=0, db_default=0)
    current_job = models.CharField(max_length=255, blank=True, default="", db_default="")

    objects = QueueDatabaseManager()

    class Meta:
        db_table = "dbqueue_worker"
        verbose_name = "worker"
        indexes = [models.Index(fields=["last_seen_at"], name="dbqueue_worker_seen")]

    def __str__(self) -> str:
        return self.worker_id

    @property
    def queue_list(self) -> list[str]:
        return [queue for queue in self.queues.split(",") if queue]


class TaskResultRecord(models.Model):
    """The outcome of a ``django.tasks`` task, kept after its job row is gone."""

    id = models.CharField(max_length=64, primary_key=True)
    task_path = models.CharField(max_length=255)
    backend = models.CharField(max_length=100)
    queue = models.CharField(max_length=100)
    priority = models.SmallIntegerField(default=0)
    status = models.CharField(max_length=20, db_index=True)
    args = models.JSONField(default=list)
    kwargs = models.JSONField(default=dict)
    return_value = models.JSONField(null=True, blank=True)
    # [{"exception_class_path": ..., "traceback": ...}], one per failed attempt.
    errors = models.JSONField(default=list)
    worker_ids = models.JSONField(default=list)
    # The job row running it now (a retry from FailedJob gets a new one).
    job_id = models.BigIntegerField(null=True, blank=True)
    enqueued_at = models.DateTimeField()
    started_at = models.DateTimeField(null=True, blank=True)
    last_attempted_at = models.DateTimeField(null=True, blank=True)
    finished_at = models.DateTimeField(null=True, blank=True)

    objects = QueueDatabaseManager()

    class Meta:
        db_table = "dbqueue_task_result"
        verbose_name = "task result"
        indexes = [models.Index(fields=["finished_at"], name="dbqueue_task_result_finished")]

    def __str__(self) -> str:
        return f"{self.task_path} {self.id}: {self.status}"


class ScheduleState(models.Model):
    """The state of one periodic schedule declared in code (``schedules.periodic``).

    The code holds what a schedule is; this row holds where it stands: the next
    tick to enqueue, the last one enqueued and its job, and whether an operator
    disabled it. A tick is enqueued in the transaction that moves ``next_tick``,
    under a lock on this row (a compare-and-set of ``next_tick`` on SQLite), so
    each tick is enqueued exactly once, whatever the number of workers. A row
    whose schedule left the code is kept, with its history, and shown as stale.
    """

    id = models.BigAutoField(primary_key=True)
    name = models.CharField(max_length=200, unique=True)
    job_name = models.CharField(max_length=200)
    # As declared: a cron expression, a shorthand (@daily) or an interval ("every 30s").
    expression = models.CharField(max_length=200)
    timezone = models.CharField(max_length=64)
    # The arguments of each run, as JSON (shown to operators).
    arguments = models.TextField(default="{}")
    enabled = models.BooleanField(default=True)
    # The next tick to enqueue; None: to be computed from the database's clock by
    # the next worker that looks (a new or changed schedule, one enabled again).
    next_tick = models.DateTimeField(null=True, blank=True)
    # The tick of the last run enqueued (a scheduled time, not the time it was enqueued).
    last_tick = models.DateTimeField(null=True, blank=True)
    # When the last run was enqueued, by a tick or "run now" (the database's clock).
    last_run_at = models.DateTimeField(null=True, blank=True)
    # The job of that run (its row is deleted when it succeeds).
    last_job_id = models.BigIntegerField(null=True, blank=True)
    # Runs enqueued, and ticks not run (missed while no worker ticked, or overlapping).
    runs = models.PositiveIntegerField(default=0)
    skipped = models.PositiveIntegerField(default=0)
    created_at = models.DateTimeField()
    updated_at = models.DateTimeField()

    objects = QueueDatabaseManager()

    # The database's clock, on rows read by queries that annotate it.
    db_now: datetime

    class Meta:
        db_table = "dbqueue_schedule"
        verbose_name = "schedule"
        ordering = ["name"]
        indexes = [models.Index(fields=["next_tick"], name="dbqueue_schedule_next")]
        permissions = [("run_schedule", "Can run a schedule now")]

    def __str__(self) -> str:
        return self.name


class FlowLimitManager(QueueDatabaseManager):
    def lock(self, keys: Iterable[str]) -> dict[str, FlowLimit]:
        """Lock the rows of ``keys`` for the current transaction, creating the missing
        ones; return them by key, with the database's clock in ``db_now``.

        Rows are locked in key order, so claims that lock several keys never wait
        on each other in a circle.
        """
        keys = sorted(set(keys))
        queryset = self.get_queryset()
        found = {row.key: row for row in _locked(queryset.filter(key__in=keys))}
        # Twice: a row ``prune`` deleted between the insert (a conflict, ignored)
        # and the lock is made again.
        for _ in range(2):
            missing = [key for key in keys if key not in found]
            if not missing:
                break
            queryset.bulk_create([FlowLimit(key=key) for key in missing], ignore_conflicts=True)
            found.update({row.key: row for row in _locked(queryset.filter(key__in=missing))})
        return found

    def prune(self, *, older_than: timedelta, concurrency_prefix: str) -> int:
        """Delete the rows no claim needs; return how many.

        A rate bucket not refilled for ``older_than`` (and holding no job back)
        would be full again at its next use, and a concurrency key's row
        (``concurrency_prefix`` + key) that no job row names holds no slot: both
        are made again when a claim needs them. Rows a claim holds locked are
        left for the next prune.
        """
        queryset = self.get_queryset()
        using = queryset.db
        now = queryset.annotate(**_DB_NOW).values_list("db_now", flat=True).first()
        if now is None:
            return 0
        unused_bucket = Q(updated_at__lt=now - older_than) & (Q(held_until__isnull=True) | Q(held_until__lt=now))
        jobs = Job.objects.db_manager(using).get_queryset()
        named = jobs.filter(concurrency_key=Substr(OuterRef("key"), len(concurrency_prefix) + 1))
        unused_key = Q(updated_at__isnull=True, key__startswith=concurrency_prefix) & ~Exists(named)
        with transaction.atomic(using=using):
            candidates = queryset.filter(unused_bucket | unused_key).order_by("key")
            if connections[using].features.has_select_for_update_skip_locked:
                candidates = candidates.select_for_update(skip_locked=True)
            ids = list(candidates.values_list("pk", flat=True)[:PRUNE_CHUNK])
            if ids:
                queryset.filter(pk__in=ids).delete()
        return len(ids)


# FlowLimit rows one prune deletes at most (the next prune takes the rest).
PRUNE_CHUNK = 10_000


def _locked(queryset: models.QuerySet[Any]) -> list[Any]:
    return list(queryset.order_by("key").select_for_update().annotate(**_DB_NOW))


class FlowLimit(models.Model):
    """A row per concurrency key and per rate-limit bucket, locked by the claims that use it.

    A claim that takes a slot of a concurrency key locks that key's row, then
    counts the key's reserved jobs; a claim that spends rate-limit tokens locks
    the bucket's row, refills ``tokens`` for the time since ``updated_at`` and
    takes what it spends. The lock serialises the claims of one key across
    workers and hosts; claims of other keys do not wait.
    """

    key = models.CharField(max_length=255, unique=True)
    tokens = models.FloatField(default=0)
    updated_at = models.DateTimeField(null=True, blank=True)
    # A rate bucket: the time after the last job held back for it is due (the next
    # one held back is due then), so jobs held back by successive claims are spaced
    # at the bucket's rate rather than all due at once.
    held_until = models.DateTimeField(null=True, blank=True)

    objects = FlowLimitManager()

    # The database's clock, on rows read by ``FlowLimit.objects.lock``.
    db_now: datetime

    class Meta:
        db_table = "dbqueue_limit"
        verbose_name = "flow limit"

    def __str__(self) -> str:
        return self.key


class UniqueWindow(models.Model):
    """A unique key taken for a time (``@job(unique_for=...)``), whatever became of its job."""

    key = models.CharField(max_length=255, unique=True)
    # The job enqueued when the window opened (its row may be gone).
    job_id = models.BigIntegerField(null=True, blank=True)
    expires_at = models.DateTimeField()

    objects = QueueDatabaseManager()

    class Meta:
        db_table = "dbqueue_unique_window"
        verbose_name = "unique window"
        indexes = [models.Index(fields=["expires_at"], name="dbqueue_unique_window_expires")]

    def __str__(self) -> str:
        return self.key


class PausedQueue(models.Model):
    """A paused queue: workers claim none of its jobs until it is resumed (the row deleted)."""

    queue = models.CharField(max_length=100, unique=True)
    paused_at = models.DateTimeField()

    objects = QueueDatabaseManager()

    class Meta:
        db_table = "dbqueue_paused_queue"
        verbose_name = "paused queue"
        permissions = [("pause_queue", "Can pause and resume queues")]

    def __str__(self) -> str:
        return self.queue


class JobBatch(models.Model):
    """A batch of jobs (batches.py): its counters move in the transactions that end its members.

    ``pending`` counts the members not yet ended: a member that succeeds, fails
    for good or is cancelled leaves it; a failed member retried comes back.
    ``total = pending + succeeded + failed + cancelled`` at every commit.
    """

    id = models.BigAutoField(primary_key=True)
    name = models.CharField(max_length=200, blank=True, default="")
    # Members in all: enqueued with the batch and added later.
    total = models.PositiveIntegerField(default=0)
    pending = models.PositiveIntegerField(default=0)
    # Members in FailedJob now (a retry takes one back to pending).
    failed = models.PositiveIntegerField(default=0)
    # Members that were still waiting when the batch was cancelled: deleted, never run.
    cancelled = models.PositiveIntegerField(default=0)
    allow_failures = models.BooleanField(default=False)
    # {"then": [step, ...], "on_failure": [...], "on_finish": [...]}: the jobs to
    # enqueue when the batch finishes or a member fails (JSON steps, as a chain's).
    callbacks = models.TextField(blank=True, default="")
    created_at = models.DateTimeField()
    # Set when ``pending`` reaches 0; cleared when a retry brings members back.
    finished_at = models.DateTimeField(null=True, blank=True)
    cancelled_at = models.DateTimeField(null=True, blank=True)

    objects = QueueDatabaseManager()

    class Meta:
        db_table = "dbqueue_batch"
        verbose_name = "batch"
        verbose_name_plural = "batches"
        ordering = ["-created_at", "-id"]
        indexes = [models.Index(fields=["finished_at"], name="dbqueue_batch_finished")]
        permissions = [("cancel_batch", "Can cancel batches")]
        constraints = [
            models.CheckConstraint(
                condition=Q(pending__lte=F("total")) & Q(failed__lte=F("total")),
                name="dbqueue_batch_counts",
            ),
        ]

    def __str__(self) -> str:
        return f"{self.name or 'batch'} #{self.pk}"

    @property
    def succeeded(self) -> int:
        return self.total - self.pending - self.failed - self.cancelled

    @property
    def done(self) -> int:
        """Members that ended, one way or another."""
        return self.total - self.pending

    @property
    def percent(self) -> float:
        """Members ended, as a percent of all (100 for an empty batch)."""
        return round(100.0 * self.done / self.total, 2) if self.total else 100.0

    @property
    def state(self) -> str:
        """``running``, ``finished``, ``failed`` (finished with failures), ``cancelling`` or ``cancelled``."""
        if self.cancelled_at is not None:
            return "cancelled" if self.finished_at is not None else "cancelling"
        if self.finished_at is None:
            return "running"
        return "failed" if self.failed else "finished"


class JobHistory(models.Model):
    """Counts of job runs per minute, queue and job name (history.py).

    Workers add their counts with the heartbeat (one upsert per beat for all the
    names they ran), never one write per job. ``run_time`` is the total seconds
    of the runs that ended; ``h0``..``h12`` count them by run time, in the
    buckets of ``history.BOUNDS`` (the last one: longer than all).
    """

    id = models.BigAutoField(primary_key=True)
    bucket = models.DateTimeField(help_text="The minute the counts belong to (the worker's clock).")
    queue = models.CharField(max_length=100)
    name = models.CharField(max_length=200)
    started = models.PositiveBigIntegerField(default=0)
    succeeded = models.PositiveBigIntegerField(default=0)
    failed = models.PositiveBigIntegerField(default=0)
    # Runs that raised and were released to run again.
    retried = models.PositiveBigIntegerField(default=0)
    run_time = models.FloatField(default=0)
    h0 = models.PositiveBigIntegerField(default=0)
    h1 = models.PositiveBigIntegerField(default=0)
    h2 = models.PositiveBigIntegerField(default=0)
    h3 = models.PositiveBigIntegerField(default=0)
    h4 = models.PositiveBigIntegerField(default=0)
    h5 = models.PositiveBigIntegerField(default=0)
    h6 = models.PositiveBigIntegerField(default=0)
    h7 = models.PositiveBigIntegerField(default=0)
    h8 = models.PositiveBigIntegerField(default=0)
    h9 = models.PositiveBigIntegerField(default=0)
    h10 = models.PositiveBigIntegerField(default=0)
    h11 = models.PositiveBigIntegerField(default=0)
    h12 = models.PositiveBigIntegerField(default=0)

    objects = QueueDatabaseManager()

    class Meta:
        db_table = "dbqueue_history"
        verbose_name = "job history bucket"
        verbose_name_plural = "job history"
        constraints = [models.UniqueConstraint(fields=["bucket", "queue", "name"], name="dbqueue_history_key")]

    def __str__(self) -> str:
        return f"{self.bucket:%Y-%m-%d %H:%M} {self.queue} {self.name}"
