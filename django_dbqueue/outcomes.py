"""The end of a run: store a job's outcome through any outage, then report it.

A job that succeeded with nothing to follow it waits for its batch's DELETE (the next claim,
or ``batch_window`` later); any other outcome is stored at once, with its follow-ups, kept
result and (a success whose run used durable steps) the DELETE of its step rows, in one
transaction. Every statement is retried on a fresh connection while the database is away;
reports (progress, stats, history, signals, logs) never change what was stored.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from contextlib import nullcontext
from typing import Any, TypeVar

from django.db import DatabaseError, transaction

from . import handles, lifecycle, progress, rows, signals, steps, workers
from .db import alias, caused_by_lost_connection, drop_connection, error_text, is_connection_error
from .exceptions import JobCancelled, WorkerStopped
from .execution import Defaults, Outcome, outcome_of, timeout_error
from .heartbeat import Heartbeat
from .history import Recorder, shown_name
from .models import FailedJob, Job, TaskResultRecord
from .pool import Run
from .workers import Stats

logger = logging.getLogger("django_dbqueue")

T = TypeVar("T")

# Waits after a database error, doubled up to the last: short, so a worker resumes within
# seconds of the database's return, whatever the outage's length.
DB_RETRY_DELAYS = (0.5, 1, 2)
# A job whose connection broke under it is given back without spending a try at most this
# many times, so a job that always breaks its own connection still ends.
MAX_GIVE_BACKS = 5
# Errors other than a lost connection are retried this many times when recording an outcome.
MAX_RECORD_ERRORS = 5
# A job recorded as timed out by a process that ends for it is released no sooner than this
# (seconds): until that process is gone, the job's code may still run in its thread.
ENDING_RELEASE_DELAY = 10.0


def ending(run: Run, defaults: Defaults) -> Outcome:
    """The outcome of a run asked to stop that did not, as the process that ends for it records it."""
    reason = run.reason or timeout_error(run.job.timeout or defaults.timeout)
    if run.prepared is None:
        return Outcome("failed", 0, exception=reason, error=str(reason))
    outcome = outcome_of(run.prepared, reason, defaults)
    if outcome.status != "released":
        return outcome
    return dataclasses.replace(outcome, delay=max(outcome.delay, ENDING_RELEASE_DELAY))


def asked_for(reason: BaseException | None) -> str:
    """What asked a run to stop, for the log of the process that ends for it."""
    if isinstance(reason, JobCancelled):
        return "a hard cancel"
    if isinstance(reason, WorkerStopped):
        return "a second stop signal"
    return "its timeout"


class Outages:
    """How the worker's main thread outlives a lost database. ``wait(seconds)`` sleeps between
    tries (a first stop signal does not cut it short); after ``forced()`` (a second signal) an
    outcome is given up on; ``meanwhile()`` runs at each wait (deadlines)."""

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
        """Run ``action`` until it meets no database error; None if given up on."""
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
        # Told by the error, not by a probe (a probe's connection, idle through the wait, could
        # be killed too). A query the database refuses (SQLite's OperationalError) is not lost.
        lost = is_connection_error(exc)
        if lost:
            # Every worker's row goes stale while the database is away: take none for dead yet.
            workers.postpone_reclaim()
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
        """Store the outcome with its follow-ups (and ``record``, in the same transaction); None
        if it never could."""
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
                handles.save_records([record], alias())
            if stored and forget_steps:
                steps.delete(alias(), [job.pk])
            return stored

        forget_steps = outcome.stepped and outcome.status == "succeeded"

        def store() -> bool:
            with transaction.atomic(using=alias()) if record is not None or forget_steps else nullcontext():
                return change()

        return self.retry(store, "record"), failed_job

    def delete_done(
        self, done: list[tuple[Job, Outcome]], records: dict[int, TaskResultRecord], *, tried: bool = False
    ) -> set[int] | None:
        """Delete the jobs that succeeded (saving their ``records``) in one statement; the ids
        deleted, None if it never could. ``tried``: an earlier statement may have committed."""
        tries = 1 if tried else 0

        def delete() -> set[int]:
            nonlocal tries
            tries += 1
            with transaction.atomic(using=alias()) if records else nullcontext():
                deleted = lifecycle.delete_many([job for job, _ in done])
                handles.save_records([records[pk] for pk in sorted(deleted & records.keys())], alias())
            if tries > 1:
                deleted |= {
                    job.pk
                    for job, outcome in done
                    if job.pk not in deleted and self.stored_by_earlier_try(job, outcome)[0]
                }
            return deleted

        return self.retry(delete, "record")

    def release_lost_claims(self) -> None:
        """Give back rows reserved in this worker's name by a claim whose reply was lost."""
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
        """Tell whether the job ended because its connection broke, not by its own fault: then
        it is given back without spending a try, ``MAX_GIVE_BACKS`` times at most."""
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
        """Tell whether a try whose connection dropped stored ``outcome`` after all. A failure is
        told exactly (FailedJob keeps the attempts); a row gone was this worker's doing only while
        its lease holds (``Heartbeat.lease_safe``): else the outcome is never reported twice."""
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


class Outcomes:
    """The outcomes of ``worker_id``'s jobs; ``sender`` is the signals' sender."""

    def __init__(
        self,
        worker_id: str,
        *,
        batch_window: float,
        heartbeat: Heartbeat,
        stats: Stats,
        history: Recorder,
        outages: Outages,
        sender: Any,
    ) -> None:
        self.worker_id = worker_id
        self.batch_window = batch_window
        self.heartbeat, self.stats, self.history, self.outages = heartbeat, stats, history, outages
        self.sender = sender
        # Succeeded, waiting for their batch's DELETE since ``done_since`` (monotonic), with the
        # records of those that keep their results.
        self.done: list[tuple[Job, Outcome]] = []
        self.records: dict[int, TaskResultRecord] = {}
        self.done_since = 0.0
        # Recent average run time of a job (seconds), None before the first; and per job name.
        self.average_run: float | None = None
        self.run_by_name: dict[str, float] = {}

    def take_done(self) -> list[tuple[Job, Outcome]]:
        """The jobs that succeeded, for a claim that deletes them (``report_done`` after it);
        those that keep a result are deleted now, with their records."""
        if self.records:
            self.finish_done()
        done, self.done = self.done, []
        return done

    def delete_due(self) -> float | None:
        """Seconds until the waiting DELETE is due (0: now); None if no job waits for one."""
        return max(0.0, self.done_since + self.batch_window - time.monotonic()) if self.done else None

    def before_run(self, job: Job) -> None:
        """Delete the jobs that succeeded now if ``job``, about to run in the same thread, may end
        after their DELETE is due (its name's recent average says so, or it has not run here yet):
        a worker killed during a long job must not leave the quick ones before it to run again."""
        if self.done:
            expected = self.run_by_name.get(job.name)
            if expected is None or time.monotonic() + expected > self.done_since + self.batch_window:
                self.finish_done()

    def conclude(self, job: Job, outcome: Outcome, *, more: bool = False) -> None:
        """Store the outcome of a job that ran (or batch its DELETE while ``more`` jobs of its
        claim wait to run), then report it."""
        if self.outages.connection_lost(job, outcome):
            outcome = dataclasses.replace(outcome, status="released", delay=0, given_back=True, counts_exception=False)
        duration = job.ran_for = outcome.duration
        self.average_run = duration if self.average_run is None else 0.8 * self.average_run + 0.2 * duration
        named = self.run_by_name.get(job.name)
        self.run_by_name[job.name] = duration if named is None else 0.8 * named + 0.2 * duration
        status = outcome.status
        record = None
        if handles.keeps_result(job.name, job.payload):
            record = handles.outcome_record(
                job,
                status={"succeeded": "succeeded", "failed": "failed"}.get(status, "waiting"),
                worker_id=self.worker_id,
                result=outcome.result,
                error="" if outcome.given_back else outcome.error,
                exception_class="" if outcome.given_back else outcome.exception_class,
            )
        follow_ups: list[Job] = []
        # A cancelled job runs no on_failure callback; its remaining steps stay in FailedJob.
        if status != "released" and not isinstance(outcome.exception, JobCancelled):
            try:
                follow_ups = rows.follow_ups(job, succeeded=status == "succeeded", result=outcome.result)
            except Exception:  # a row's fault (JSON nested too deep) must not end the worker
                logger.exception("cannot enqueue what follows job=%s id=%s", job.name, job.pk)
        # A job whose run used durable steps is deleted with its step rows, at once.
        if status == "succeeded" and not follow_ups and not outcome.stepped:
            if record is not None:
                self.records[job.pk] = record
            if not self.done:
                self.done_since = time.monotonic()
            self.done.append((job, outcome))
            # Deleted with the next claim, or now if the batch runs long.
            if more and time.monotonic() - self.done_since >= self.batch_window:
                self.finish_done()
            return
        stored, failed_job = self.outages.store(job, outcome, follow_ups, record)
        self.heartbeat.drop(job)
        self._after_store(job, outcome, stored, failed_job)

    def finish_done(self, *, tried: bool = False) -> None:
        """Delete the jobs that succeeded in one statement, then report each (``tried``: a
        statement that deleted them failed, and may have committed)."""
        if self.done:
            done, self.done = self.done, []
            records, self.records = self.records, {}
            self.report_done(done, self.outages.delete_done(done, records, tried=tried))

    def report_done(self, done: list[tuple[Job, Outcome]], deleted: set[int] | None) -> None:
        """Signal and log jobs that succeeded, once their DELETE ran (None: it never could)."""
        for job, outcome in done:
            self.heartbeat.drop(job)
            self._after_store(job, outcome, None if deleted is None else job.pk in deleted, None)

    def _after_store(self, job: Job, outcome: Outcome, stored: bool | None, failed_job: FailedJob | None) -> None:
        """Count, write the final progress and send the outcome's signal, then log it."""
        status = outcome.status
        self.stats.ended(job, failed=bool(stored) and status == "failed")
        if stored:
            self.history.ended(
                job.queue, shown_name(job), status if status != "released" else "retried", outcome.duration
            )
            if outcome.tracker is not None:
                with progress.keep_writer():
                    outcome.tracker.flush()
                    if status == "succeeded":
                        outcome.tracker.succeeded()
                    elif status == "failed":
                        outcome.tracker.failed(outcome.error)
            sent = {"job": job, "worker_id": self.worker_id}
            if status == "succeeded":
                self.send(signals.job_succeeded, **sent, duration=outcome.duration, result=outcome.result)
            elif status == "released":
                self.send(
                    signals.job_released,
                    **sent,
                    duration=outcome.duration,
                    exception=outcome.exception,
                    delay=outcome.delay,
                )
            else:
                if isinstance(outcome.exception, JobCancelled):
                    self.send(signals.job_cancelled, job_id=job.pk, failed_job=failed_job)
                self.send(signals.job_failed, **sent, failed_job=failed_job, exception=outcome.exception)
        logger.log(
            logging.INFO if status == "succeeded" or outcome.snoozed else logging.WARNING,
            "job=%s id=%s queue=%s attempt=%s outcome=%s duration=%.3fs%s%s%s",
            shown_name(job),
            job.pk,
            job.queue,
            job.attempts,
            status,
            outcome.duration,
            f" retry_in={outcome.delay:g}s" if status == "released" else "",
            f" error={outcome.exception_class}" if outcome.exception is not None else "",
            (" snoozed" if outcome.snoozed else " given_back=connection_lost") if outcome.given_back else "",
        )
        if stored is None:
            self.outages.unrecorded.add(job.pk)
        if stored is False:
            logger.warning(
                "reservation lost job=%s id=%s attempt=%s: another worker holds it, outcome not recorded",
                job.name,
                job.pk,
                job.attempts,
            )

    def send(self, signal_: Any, **kwargs: Any) -> None:
        """Send a signal; a receiver that raises is logged and changes nothing."""
        for receiver, response in signal_.send_robust(sender=self.sender, **kwargs):
            if isinstance(response, Exception):
                logger.error("signal receiver %r raised", receiver, exc_info=response)
