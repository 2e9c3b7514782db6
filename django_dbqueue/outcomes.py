"""The end of a run: record a job's outcome, then report it.

A job that succeeded with nothing to enqueue after it waits for the DELETE of its
batch (with the worker's next claim, or ``batch_window`` later at most); any other
outcome is stored at once, with the rows that follow it (chains, callbacks) and its
kept result, in one transaction (``Outages.store`` retries it through an outage).
Once stored, the outcome is reported: the final progress, the workers table and the
history counts, the outcome's signal and a log line; none of them changes what was
stored.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any

from . import handles, progress, rows, signals
from .exceptions import JobCancelled, JobTimeout
from .execution import Defaults, Outcome, outcome_of
from .heartbeat import Heartbeat
from .history import Recorder
from .models import FailedJob, Job, TaskResultRecord
from .outages import Outages
from .pool import Run
from .workers import Stats

logger = logging.getLogger("django_dbqueue")

# A job recorded as timed out by a process that ends for it is released for its next
# try no sooner than this (seconds), by when that process is gone: until it is, the
# job's code may still run in the thread that did not stop.
ENDING_RELEASE_DELAY = 10.0


def ending(run: Run, defaults: Defaults) -> Outcome:
    """The outcome of a run asked to stop that did not, as the process that ends for it records it."""
    seconds = run.job.timeout or defaults.timeout
    reason = run.reason or JobTimeout(f"the job ran longer than its timeout of {seconds} s and was stopped")
    if run.prepared is None:
        return Outcome("failed", 0, exception=reason, error=str(reason))
    outcome = outcome_of(run.prepared, reason, defaults)
    if outcome.status != "released":
        return outcome
    return dataclasses.replace(outcome, delay=max(outcome.delay, ENDING_RELEASE_DELAY))


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
        # Succeeded, waiting for their batch's DELETE, since a monotonic time; and the
        # result records of those that keep their results, saved with that DELETE.
        self.done: list[tuple[Job, Outcome]] = []
        self.records: dict[int, TaskResultRecord] = {}
        self.done_since = 0.0
        # Recent average run time of a job (seconds), None before the first.
        self.average_run: float | None = None

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

    def conclude(self, job: Job, outcome: Outcome, *, more: bool = False) -> None:
        """Record the outcome of a job that ran (or batch its DELETE: ``more`` jobs of its
        claim wait to run), then report it."""
        if self.outages.connection_lost(job, outcome):
            outcome = dataclasses.replace(outcome, status="released", delay=0, given_back=True, counts_exception=False)
        duration = outcome.duration
        self.average_run = duration if self.average_run is None else 0.8 * self.average_run + 0.2 * duration
        follow_ups = [] if outcome.status == "released" else self._follow_ups(job, outcome)
        keep = handles.keeps_result(job.name)
        if outcome.status == "succeeded" and not follow_ups:
            if keep:
                self.records[job.pk] = handles.outcome_record(
                    job, status="succeeded", worker_id=self.worker_id, result=outcome.result
                )
            if not self.done:
                self.done_since = time.monotonic()
            self.done.append((job, outcome))
            # Deleted with the next claim, or now if the batch runs long.
            if more and time.monotonic() - self.done_since >= self.batch_window:
                self.finish_done()
            return
        stored, failed_job = self._store(job, outcome, follow_ups, keep=keep)
        self.heartbeat.drop(job)
        self._after_store(job, outcome, stored, failed_job)

    def _follow_ups(self, job: Job, outcome: Outcome) -> list[Job]:
        if isinstance(outcome.exception, JobCancelled):
            # A cancelled job runs no on_failure callback; its remaining steps stay in FailedJob.
            return []
        try:
            return rows.follow_ups(job, succeeded=outcome.status == "succeeded")
        except Exception:  # a row's fault (JSON nested too deep) must not end the worker
            logger.exception("cannot enqueue what follows job=%s id=%s", job.name, job.pk)
            return []

    def _store(
        self, job: Job, outcome: Outcome, follow_ups: list[Job], *, keep: bool = False
    ) -> tuple[bool | None, FailedJob | None]:
        record = None
        if keep:
            record = handles.outcome_record(
                job,
                status={"succeeded": "succeeded", "failed": "failed"}.get(outcome.status, "waiting"),
                worker_id=self.worker_id,
                result=outcome.result,
                error="" if outcome.given_back else outcome.error,
                exception_class="" if outcome.given_back else outcome.exception_class,
            )
        return self.outages.store(job, outcome, follow_ups, record)

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
        """Write the final progress and send the outcome's signal (neither changes what was
        stored), then log it."""
        status = outcome.status
        self.stats.ended(job, failed=bool(stored) and status == "failed")
        if stored:
            self.history.ended(job.queue, job.name, status if status != "released" else "retried", outcome.duration)
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
            job.name,
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
