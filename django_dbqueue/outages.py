"""Recovery from a lost database: how a worker outlives an outage.

Every statement of the worker's main thread (a claim, an outcome) is retried on a
fresh connection after a short wait (``DB_RETRY_DELAYS``): without end while the
session is what broke, ``MAX_RECORD_ERRORS`` times for one the database refuses. A
statement whose reply was lost may have committed: such a claim's rows are given
back before the next claim, and an outcome whose compare-and-set then matches
nothing is looked up (``stored_by_earlier_try``). A job whose own connection broke
is given back without spending a try, ``MAX_GIVE_BACKS`` times at most. A pool's
jobs run on meanwhile. Every outcome the worker stores goes through here.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from contextlib import nullcontext
from typing import TypeVar

from django.db import DatabaseError, transaction

from . import lifecycle, workers
from .db import alias, caused_by_lost_connection, drop_connection, error_text, is_connection_error
from .execution import Outcome
from .heartbeat import Heartbeat
from .models import FailedJob, Job, TaskResultRecord

logger = logging.getLogger("django_dbqueue")

T = TypeVar("T")

# Waits after a database error: doubled each time, up to the last value. Short: a
# failed connect is cheap, and a worker should resume within seconds of the
# database's return, whatever the length of the outage.
DB_RETRY_DELAYS = (0.5, 1, 2)
# A job whose database connection broke under it is given back without spending a
# try at most this many times (every give-back of the job counts), so a job that
# always breaks its own connection still ends.
MAX_GIVE_BACKS = 5
# Errors other than a lost connection are retried this many times when recording an outcome.
MAX_RECORD_ERRORS = 5


class Outages:
    """``wait(seconds)`` sleeps between two tries (not cut short by a first stop signal:
    recording an outcome is part of finishing a job); after ``forced()`` (a second stop
    signal) an outcome is given up on; ``meanwhile()`` runs at each wait (deadlines)."""

    def __init__(
        self,
        worker_id: str,
        heartbeat: Heartbeat,
        *,
        wait: Callable[[float], object],
        forced: Callable[[], bool],
        meanwhile: Callable[[], object],
    ) -> None:
        self.worker_id = worker_id
        self.heartbeat = heartbeat
        self._wait, self._forced, self._meanwhile = wait, forced, meanwhile
        # Claims in a row that failed: the next one gives back what they may have reserved.
        self.claim_errors = 0
        # Jobs that ran but whose outcome this worker gave up storing: reclaimed after retry_after.
        self.unrecorded: set[int] = set()

    def retry(self, action: Callable[[], T], what: str) -> T | None:
        """Run ``action`` until it does not meet a database error; None if given up on."""
        attempt = 0
        while True:
            try:
                return action()
            except DatabaseError as exc:
                lost = self.trouble(exc, what, attempt)
                attempt += 1
                if self._forced() or (not lost and attempt >= MAX_RECORD_ERRORS):
                    logger.error("giving up on %s after %s errors; the reservation will be reclaimed", what, attempt)
                    return None

    def claim_failed(self, exc: DatabaseError) -> None:
        self.trouble(exc, "reserve", self.claim_errors)
        self.claim_errors += 1

    def trouble(self, exc: DatabaseError, what: str, attempt: int) -> bool:
        """Log a database error, wait before the next try; tell whether the connection was lost."""
        # Told by the error, not by a probe: a connection opened to probe the server
        # would sit idle through the wait and could be killed as well. A query the
        # database refuses (a missing column: SQLite says OperationalError too) is not lost.
        lost = is_connection_error(exc)
        if lost:
            # Every worker's row goes stale while the database is away: none is taken for
            # dead, and its jobs reclaimed, until it had time to beat again.
            workers.postpone_reclaim()
        # A fresh connection costs little here and clears any broken state.
        drop_connection()
        # Jobs past their timeout are asked to stop now, not once the database is back.
        self._meanwhile()
        delay = DB_RETRY_DELAYS[min(attempt, len(DB_RETRY_DELAYS) - 1)]
        logger.warning(
            "database error during %s worker_id=%s connection_lost=%s retry_in=%ss: %s",
            what,
            self.worker_id,
            lost,
            delay,
            error_text(exc),
        )
        self._wait(delay)
        return lost

    def store(
        self, job: Job, outcome: Outcome, follow_ups: list[Job], record: TaskResultRecord | None
    ) -> tuple[bool | None, FailedJob | None]:
        """Store the outcome with the rows that follow it (and ``record``, the job's result, in
        the same transaction), retrying while the database is away; None if it never could."""
        failed_job = None
        tries = 0

        def change() -> bool:
            nonlocal failed_job, tries
            tries += 1
            if outcome.status == "succeeded":
                stored = lifecycle.delete(job, follow_ups=follow_ups)
            elif outcome.status == "released":
                stored = lifecycle.release(
                    job, delay=outcome.delay, give_back=outcome.given_back, exception=outcome.counts_exception
                )
            else:
                failed_job = lifecycle.fail(
                    job, error=outcome.error, exception_class=outcome.exception_class, follow_ups=follow_ups
                )
                stored = failed_job is not None
            if not stored and tries > 1:
                # The try that lost its connection may have committed before the reply was lost.
                stored, failed_job = self.stored_by_earlier_try(job, outcome)
            if stored and record is not None:
                record.save(using=alias(), force_insert=record._state.adding)
            return stored

        def store() -> bool:
            with transaction.atomic(using=alias()) if record is not None else nullcontext():
                return change()

        return self.retry(store, "record"), failed_job

    def delete_done(
        self, done: list[tuple[Job, Outcome]], records: dict[int, TaskResultRecord], *, tried: bool = False
    ) -> set[int] | None:
        """Delete the jobs that succeeded (and save their ``records`` with them) in one statement;
        return the ids deleted, None if it never could. ``tried``: a statement that deleted
        them failed, and may have committed."""
        tries = 1 if tried else 0

        def delete() -> set[int]:
            nonlocal tries
            tries += 1
            with transaction.atomic(using=alias()) if records else nullcontext():
                deleted = lifecycle.delete_many([job for job, _ in done])
                for pk in deleted & records.keys():
                    records[pk].save(using=alias(), force_insert=records[pk]._state.adding)
            if tries > 1:
                # A try that lost its connection may have committed before the reply was lost.
                deleted |= {
                    job.pk
                    for job, outcome in done
                    if job.pk not in deleted and self.stored_by_earlier_try(job, outcome)[0]
                }
            return deleted

        return self.retry(delete, "record")

    def release_lost_claims(self) -> None:
        """Give back rows reserved in this worker's name by a claim whose reply was lost (after
        a failed claim; the jobs whose outcome it could not store wait for their retry_after)."""
        held = Job.objects.reserved().filter(reserved_by=self.worker_id).exclude(pk__in=self.unrecorded)
        for job in held:
            if lifecycle.release(job, give_back=True):
                logger.warning(
                    "released job=%s id=%s attempt=%s: its claim committed but the reply was lost",
                    job.name,
                    job.pk,
                    job.attempts,
                )

    def give_back(self, job: Job) -> None:
        """Release a claimed job this worker will not run; it spends no try."""
        try:
            lifecycle.release(job, give_back=True)
        except DatabaseError as exc:
            logger.warning(
                "could not release job=%s id=%s: %s; it is reclaimed after retry_after",
                job.name,
                job.pk,
                error_text(exc),
            )

    def connection_lost(self, job: Job, outcome: Outcome) -> bool:
        """Tell whether the job ended because its database connection broke, not by its own
        fault: then it is given back without spending a try, up to ``MAX_GIVE_BACKS`` times."""
        if outcome.status == "succeeded" or outcome.exception is None or outcome.snoozed:
            return False  # a snooze gave it back already, with its own delay
        if not caused_by_lost_connection(outcome.exception):
            return False
        if job.given_back >= MAX_GIVE_BACKS:
            logger.warning(
                "lost connection job=%s id=%s attempt=%s: given back %s times already, this one spends a try",
                job.name,
                job.pk,
                job.attempts,
                job.given_back,
            )
            return False
        return True

    def stored_by_earlier_try(self, job: Job, outcome: Outcome) -> tuple[bool, FailedJob | None]:
        """Tell whether a try whose connection dropped had stored ``outcome`` after all (or
        the reservation expired and another worker took the job). A failure is told apart
        exactly (FailedJob keeps the attempts); a row gone (a release: reserved again) was
        this worker's doing only while its lease holds (``Heartbeat.lease_safe``), else the
        outcome is logged, not reported: it is never reported twice."""
        if outcome.status == "failed":
            failed_job = FailedJob.objects.filter(job_id=job.pk, attempts=job.attempts).first()
            return failed_job is not None, failed_job
        attempts = Job.objects.filter(pk=job.pk).values_list("attempts", flat=True).first()
        changed = attempts is None if outcome.status == "succeeded" else attempts is None or attempts > job.attempts
        if changed and not self.heartbeat.lease_safe(job):
            logger.warning(
                "outcome unknown job=%s id=%s attempt=%s: the database was out of reach for longer than its "
                "retry_after, so another worker may have reclaimed and run it; not reported",
                job.name,
                job.pk,
                job.attempts,
            )
            return False, None
        return changed, None
