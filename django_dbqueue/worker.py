"""The worker loop: reserve, run, record the outcome, repeat."""

from __future__ import annotations

import collections
import dataclasses
import enum
import logging
import os
import resource
import secrets
import select
import signal
import socket
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import datetime, timedelta
from types import FrameType
from typing import Any, TypeVar

from django.db import DatabaseError, transaction

from . import batches, concurrency, conf, handles, history, progress, registry, rows, signals, unique, workers
from .claims import clear_unique_keys, retry_in, use_flow_claim, uses_flow_claim
from .db import alias, caused_by_lost_connection, drop_connection, error_text, is_connection_error, watch_network
from .exceptions import JobCancelled, JobTimeout, WorkerStopped
from .execution import Defaults, JobTimer, Outcome, Prepared, execute, outcome_of
from .heartbeat import Heartbeat
from .listener import Listener
from .models import CANCEL_HARD, FailedJob, FlowLimit, Job, TaskResultRecord
from .operations import restart_marker
from .pool import Pool, Run
from .schedules import Ticker

logger = logging.getLogger("django_dbqueue")

T = TypeVar("T")

# Waits after a database error: doubled each time, up to the last value. Short:
# a failed connect is cheap, and a worker should resume within seconds of the
# database's return, whatever the length of the outage.
DB_RETRY_DELAYS = (0.5, 1, 2)
# A job whose database connection broke under it is given back without spending
# a try, at most this many times (counting every give-back of the job), so a job
# that always breaks its own connection still ends.
MAX_GIVE_BACKS = 5
# Errors other than a lost connection are retried this many times when recording an outcome.
MAX_RECORD_ERRORS = 5
# Seconds between two looks at the restart marker (queue_restart).
RESTART_CHECK_INTERVAL = 2.0
# Seconds between two prunes of old progress rows by an idle worker.
PRUNE_INTERVAL = 600.0
# A batched claim takes about as many jobs as this worker runs in this many
# seconds (by the recent average run time, up to --batch), so jobs never wait
# long in one worker while another is free; and jobs that succeeded wait at
# most about this long for their batch's DELETE.
BATCH_WINDOW = 0.05
# queue_work --batch: the most jobs claimed at once.
DEFAULT_BATCH = 10
# Seconds a stopping worker goes on running the jobs it has claimed before it
# gives the rest back.
STOP_FINISH = 1.0
# queue_work --threads and --async-concurrency: the most allowed (a typo guard).
MAX_THREADS = 512
MAX_ASYNC = 10_000
# A worker exits with this code after a job it asked to stop (its timeout, a hard
# cancel) ran on past TIMEOUT_GRACE: it recorded that job and gave back the others,
# and its supervisor starts a fresh process (see pool, execution.JobTimer).
EXIT_TIMED_OUT = 77
# A job recorded as timed out by a process that ends for it is released for its
# next try no sooner than this (seconds), by when that process is gone: until it
# is, the job's code may still run in the thread that did not stop.
ENDING_RELEASE_DELAY = 10.0


class StopReason(enum.Enum):
    SIGNAL = "signal"
    TIMED_OUT = "timed-out"
    EMPTY = "empty"
    ONCE = "once"
    MAX_JOBS = "max-jobs"
    MAX_TIME = "max-time"
    MEMORY = "memory"
    ORPHANED = "orphaned"
    RESTART = "restart"


# Hours after which the rows pruned without a setting go: worker rows of workers
# gone that long, and flow-limit rows no claim used for a day (a rate bucket is
# full again long before; a concurrency key no job names holds no slot).
FIXED_PRUNE_HOURS = {"worker rows": workers.PRUNE_AFTER / 3600, "flow limit rows": 24.0}


def _prune_flow_limits(hours: float) -> int:
    return FlowLimit.objects.prune(older_than=timedelta(hours=hours), concurrency_prefix=concurrency.PREFIX)


@dataclasses.dataclass
class WorkerOptions:
    queues: list[str]
    defaults: Defaults
    sleep: float = 1.0
    rest: float = 0
    max_jobs: int | None = None
    max_time: float | None = None
    memory: int | None = None
    stop_when_empty: bool = False
    once: bool = False
    # Most jobs claimed per round trip, and finished per DELETE; the ones not yet
    # running wait in this worker, covered by its heartbeat.
    batch: int = DEFAULT_BATCH
    # Seconds of work a batched claim aims at, and the longest a job that
    # succeeded waits for its batch's DELETE (see BATCH_WINDOW).
    batch_window: float = BATCH_WINDOW
    # Set by a supervisor: stop when this process is no longer our parent.
    parent_pid: int | None = None
    # Jobs run at once by this process: sync jobs in this many threads, and up to
    # ``async_concurrency`` ``async def`` jobs on one event loop (see pool). One
    # thread and no loop: jobs run one at a time in the main thread.
    threads: int = 1
    async_concurrency: int = 0

    @property
    def pooled(self) -> bool:
        return self.threads > 1 or self.async_concurrency > 0

    # Tick the periodic schedules declared in code (schedules.Ticker).
    schedule: bool = True


def new_worker_id(pid: int | None = None, token: str | None = None) -> str:
    """Return an id naming a worker process: host, pid and a random part."""
    return f"{socket.gethostname()[:60]}:{pid or os.getpid()}:{token or secrets.token_hex(3)}"


def memory_mb() -> float:
    """Resident memory of this process in MB."""
    try:
        with open("/proc/self/statm") as statm:
            pages = int(statm.read().split()[1])
        return pages * os.sysconf("SC_PAGE_SIZE") / 1024 / 1024
    except (OSError, ValueError, IndexError):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


class Worker:
    """Serve ``options.queues`` until a stop condition; see ``run``."""

    def __init__(self, options: WorkerOptions, *, worker_id: str | None = None) -> None:
        self.options = options
        self.worker_id = worker_id or new_worker_id()
        self.processed = 0
        self.stop_requested = False
        self.in_job = False
        self._signals = 0
        self._reserve_errors = 0
        # The queues of this worker claimed with limits (see _flow_switched).
        self._flowing: frozenset[str] = frozenset()
        # Jobs that ran but whose outcome this worker gave up storing.
        self._unrecorded: set[int] = set()
        self._restart_seen: datetime | None = None
        self._restart_checked = 0.0
        self._pruned = -PRUNE_INTERVAL
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_w, False)
        # Claimed in a batch and not run yet.
        self._prefetched: collections.deque[Job] = collections.deque()
        # Succeeded, waiting for their batch's DELETE, since a monotonic time; and the
        # result records of those that keep their results, saved with that DELETE.
        self._done: list[tuple[Job, Outcome]] = []
        self._done_records: dict[int, TaskResultRecord] = {}
        self._done_since = 0.0
        # Recent average run time of a job (seconds), None before the first.
        self._average_run: float | None = None
        self._listener = Listener.configured()
        # Written into the worker's row and the history by the heartbeat (workers.py, history.py).
        self.stats = workers.Stats()
        self.history = history.Recorder()
        self.heartbeat = Heartbeat(
            self.worker_id,
            queues=options.queues,
            options=self._options_text(),
            stats=self.stats,
            recorder=self.history,
        )
        self.heartbeat.on_cancel = self._on_cancel
        # The job running now (for a hard cancel from the heartbeat's thread).
        self._current: Job | None = None
        # Watches the job a one-job worker runs in its main thread (see execution.JobTimer).
        self._timer = JobTimer(options.defaults.timeout_grace, on_stuck=self._end_stuck_job)
        # Runs several jobs at once (queue_work --threads / --async-concurrency).
        self._pool: Pool | None = None
        if options.pooled:
            self._pool = Pool(
                threads=options.threads,
                async_slots=options.async_concurrency,
                defaults=options.defaults,
                worker_id=self.worker_id,
                cancel_level=self.heartbeat.cancel_level,
                wake=self._poke,
            )

    # -- the loop ------------------------------------------------------------

    def run(self) -> StopReason:
        """Process jobs until a stop condition; return why the worker stopped."""
        started = time.monotonic()
        # Read before the line that says the worker runs, so a queue_restart sent
        # after that line always reaches this worker.
        self._restart_seen = self._read_restart_marker()
        self._restart_checked = started
        watch_network()
        self._register()
        for definition in registry.all_definitions().values():
            if definition.uses_limits:
                use_flow_claim(definition.effective_queue)
            if unique.scope(definition) == unique.UNTIL_STARTED:
                clear_unique_keys(definition.effective_queue)
        self._flow_switched()
        logger.info(
            "worker started worker_id=%s queues=%s%s",
            self.worker_id,
            ",".join(self.options.queues),
            f" threads={self.options.threads} async={self.options.async_concurrency}" if self._pool else "",
        )
        with self.handle_signals(), self.heartbeat.start(), self._timer, Ticker(self.worker_id, self.options.schedule):
            try:
                if self._pool is None:
                    reason = self._loop(started)
                else:
                    with self._pool.start(), progress.share_writer():
                        reason = self._pool_loop(started)
            finally:
                self._finish_done()
                self._release_prefetched()
                os.close(self._wake_r)
                os.close(self._wake_w)
        self._flush_history()
        self._unregister()
        logger.info("worker stopped worker_id=%s reason=%s processed=%s", self.worker_id, reason.value, self.processed)
        if reason is StopReason.TIMED_OUT:
            # Threads that may still run a stuck job must not hold the exit up.
            logging.shutdown()
            os._exit(EXIT_TIMED_OUT)
        return reason

    def _loop(self, started: float) -> StopReason:
        options = self.options
        # Once a stop condition is seen: it, and since when.
        stopping: tuple[StopReason, float] | None = None
        while True:
            reason = stopping[0] if stopping is not None else self._stop_reason(started)
            if reason is not None:
                # Run the jobs already claimed (a batch is about BATCH_WINDOW of
                # work) rather than give them back, which would use up one of
                # their tries each; for STOP_FINISH seconds at most, and not
                # after a second stop signal.
                stopping = stopping or (reason, time.monotonic())
                if not self._prefetched or self._signals >= 2 or time.monotonic() - stopping[1] >= STOP_FINISH:
                    return reason
            job = self._next_job()
            if job is None:
                if self.stop_requested:
                    return StopReason.SIGNAL
                if self._reserve_errors:
                    # The claim failed (its backoff is waited): not an empty queue.
                    continue
                if (reason := self._idle()) is not None:
                    return reason
                continue
            self.process(job)
            if options.once:
                return StopReason.ONCE
            # After a job, so a worker that starts above the limit still makes progress.
            if options.memory is not None and (used := memory_mb()) >= options.memory:
                logger.warning(
                    "memory limit reached worker_id=%s memory_mb=%.0f limit_mb=%s", self.worker_id, used, options.memory
                )
                return StopReason.MEMORY
            if options.rest > 0:
                self._finish_done()
                self.wait(options.rest)

    def _pool_loop(self, started: float) -> StopReason:
        """The loop of a worker that runs several jobs at once (see pool): claim as
        many jobs as there are free slots (and about ``batch_window`` of work
        more), hand them to the pool, record their outcomes as they come."""
        assert self._pool is not None
        pool, options = self._pool, self.options
        stopping: StopReason | None = None
        # When the second stop signal interrupted the running jobs (monotonic).
        forced_at: float | None = None
        # No claim before then (monotonic): the queue was found empty.
        next_claim = 0.0
        while True:
            finished = pool.collect()
            for job, outcome in finished:
                self.heartbeat.stopped(job)
                if outcome is None:
                    # Not started: the worker is stopping.
                    self._give_back(job)
                    self.heartbeat.drop(job)
                else:
                    self._conclude(job, outcome)
            stuck, next_look = pool.check_deadlines()
            if stuck is not None and forced_at is None:
                self._end_stuck(stuck)
                return StopReason.TIMED_OUT
            if stopping is None:
                stopping = self._stop_reason(started)
                if stopping is None and options.once and self.processed and not pool.busy:
                    stopping = StopReason.ONCE
                if stopping is None and finished and options.memory is not None:
                    if (used := memory_mb()) >= options.memory:
                        logger.warning(
                            "memory limit reached worker_id=%s memory_mb=%.0f limit_mb=%s",
                            self.worker_id,
                            used,
                            options.memory,
                        )
                        stopping = StopReason.MEMORY
                if stopping is not None and stopping not in (StopReason.MAX_JOBS, StopReason.ONCE):
                    # Jobs not started yet come back unrun (no try spent); running ones finish.
                    # (Those claimed within --max-jobs run: they are the last ones.)
                    pool.stopping = True
            if stopping is not None:
                if self._signals >= 2 and forced_at is None:
                    forced_at = time.monotonic()
                    logger.warning("stopping now worker_id=%s: asking %s job(s) to stop", self.worker_id, pool.busy)
                    pool.ask_all_to_stop(
                        lambda job: WorkerStopped(f"{job.name} (job {job.pk}): the worker was stopped twice")
                    )
                if not pool.busy:
                    return stopping
                if forced_at is not None and time.monotonic() - forced_at >= options.defaults.timeout_grace:
                    for run in pool.abandon():
                        logger.warning("job=%s id=%s did not stop: given back", run.job.name, run.job.pk)
                        self._give_back(run.job)
                        self.heartbeat.drop(run.job)
                    return stopping
                self._pool_wait(next_look, None)
                continue
            want = self._pool_claim_size()
            if want > 0 and time.monotonic() >= next_claim:
                jobs = self.reserve(want)
                if jobs:
                    self._submit(jobs)
                    continue
                if self._reserve_errors:
                    continue  # its backoff was waited
                if not pool.busy:
                    if (reason := self._idle()) is not None:
                        return reason
                    continue
                next_claim = time.monotonic() + self._sleep()
            if self._done and time.monotonic() - self._done_since >= options.batch_window:
                self._finish_done()
            # Until a job ends, a deadline, a signal; and, to claim again after an
            # empty claim, a NOTIFY or --sleep.
            claim_in = next_claim - time.monotonic() if want > 0 else None
            if self._pool_wait(next_look, claim_in, listen=claim_in is not None):
                next_claim = 0.0

    def _submit(self, jobs: list[Job]) -> None:
        """Hand claimed jobs to the pool (a job that carries a cancel request ends at once)."""
        assert self._pool is not None
        self.heartbeat.hold(jobs)
        runnable = []
        for job in jobs:
            if self._skipped(job):
                continue
            self._begin(job)
            if job.cancel:
                self._conclude(job, self._cancelled_before(job))
                continue
            self.heartbeat.running(job)
            runnable.append(job)
        self._pool.submit(runnable)

    def _pool_claim_size(self) -> int:
        """How many jobs a pooled worker claims now: one per free slot, plus as many as
        its slots finish in about ``batch_window`` (by the recent average run), so a
        freed slot finds its next job waiting; none once ``--max-jobs`` are claimed,
        one in all with ``--once``."""
        assert self._pool is not None
        pool, options = self._pool, self.options
        if pool.draining:
            # A job asked to stop runs on: the process may end for it.
            return 0
        if options.once:
            return 0 if self.processed else 1
        ahead = 0
        if self._average_run is not None:
            ahead = min(pool.capacity, int(pool.capacity * options.batch_window / max(self._average_run, 1e-4)))
        want = pool.capacity + ahead - pool.busy
        if options.max_jobs is not None:
            want = min(want, options.max_jobs - self.processed)
        return max(0, want)

    def _pool_outcomes_ready(self) -> bool:
        return self._pool is not None and self._pool.has_outcomes

    def _pool_wait(self, next_look: float | None, at_most: float | None, *, listen: bool = False) -> bool:
        """Wait for an outcome (the pool pokes the wake pipe), a signal, the next
        deadline to look at, or ``at_most`` seconds; tell whether a NOTIFY came."""
        if self._pool_outcomes_ready():
            return False
        seconds = 60.0 if at_most is None else at_most
        if self._done:
            seconds = min(seconds, max(0.0, self._done_since + self.options.batch_window - time.monotonic()))
        if next_look is not None:
            seconds = min(seconds, max(0.0, next_look - time.monotonic()) + 0.001)
        return self.wait(max(seconds, 0.0005), until_stop=False, listen=listen)

    def _end_stuck(self, stuck: Run) -> None:
        """A job asked to stop (its timeout, a hard cancel) runs on past its grace, or
        blocks the event loop: give back every job of this process that was not asked
        to stop, record those that were with their reason while their leases still
        hold, and let the process end (see pool)."""
        assert self._pool is not None
        runs = self._pool.abandon()
        asked = [run for run in runs if run is stuck or run.reason is not None]
        logger.error(
            "job=%s id=%s did not stop within %ss of %s in its %s: recording it, giving back the %s "
            "other job(s) of this process, and ending the process",
            stuck.job.name,
            stuck.job.pk,
            self.options.defaults.timeout_grace,
            _asked_for(stuck.reason),
            "event loop" if stuck.on_loop else "thread",
            len(runs) - len(asked),
        )
        for run in runs:
            self.heartbeat.stopped(run.job)
            if run not in asked:
                self._give_back(run.job)
                self.heartbeat.drop(run.job)
        for run in asked:
            reason = run.reason or self._timed_out(run.job)
            if run.prepared is not None:
                outcome = outcome_of(run.prepared, reason, self.options.defaults)
            else:
                outcome = Outcome("failed", 0, exception=reason, error=str(reason))
            self._conclude(run.job, _ending(outcome))

    def _end_stuck_job(self, prepared: Prepared, reason: BaseException) -> None:
        """In the timer's thread (see execution.JobTimer): the job in the main thread was
        asked to stop and runs on past its grace. Record it (give it back, after a
        second stop signal), give back the jobs claimed after it, and end the
        process: the main thread never comes back from that job."""
        job = prepared.job
        stopped = isinstance(reason, WorkerStopped)
        logger.error(
            "job=%s id=%s did not stop within %ss of %s: %s it and ending the process",
            job.name,
            job.pk,
            self.options.defaults.timeout_grace,
            _asked_for(reason),
            "giving back" if stopped else "recording",
        )
        self.heartbeat.running(None)
        if stopped:
            self.stats.stopped(job)
            self._give_back(job)
            self.heartbeat.drop(job)
        else:
            self._conclude(job, _ending(outcome_of(prepared, reason, self.options.defaults)))
        self._finish_done()
        self._release_prefetched()
        self._flush_history()
        self._unregister()
        logger.info(
            "worker stopped worker_id=%s reason=%s processed=%s",
            self.worker_id,
            (StopReason.SIGNAL if stopped else StopReason.TIMED_OUT).value,
            self.processed,
        )
        logging.shutdown()
        os._exit(0 if stopped else EXIT_TIMED_OUT)

    def _timed_out(self, job: Job) -> JobTimeout:
        seconds = job.timeout or self.options.defaults.timeout
        return JobTimeout(f"the job ran longer than its timeout of {seconds} s and was stopped")

    def _idle(self) -> StopReason | None:
        """The claim found nothing and nothing runs: stop (``--once``, ``--stop-when-empty``), or
        prune old rows now and then and wait for work (``--sleep``, or a NOTIFY).

        Not when the claim held back rows it ran out of rounds for (``retry_in`` is 0):
        jobs this worker may run still wait, so it claims again at once."""
        if retry_in() == 0:
            return None
        if self.options.once:
            return StopReason.ONCE
        if self.options.stop_when_empty:
            return StopReason.EMPTY
        self._prune_progress()
        self.wait(self._sleep(), listen=True)
        return None

    def _sleep(self) -> float:
        """Seconds to wait after an empty claim: ``--sleep``, or less when a job held
        back by a rate limit may start sooner."""
        hint = retry_in()
        return self.options.sleep if hint is None else min(self.options.sleep, hint)

    def _stop_reason(self, started: float) -> StopReason | None:
        options = self.options
        if self.stop_requested:
            return StopReason.SIGNAL
        if options.max_jobs is not None and self.processed >= options.max_jobs:
            return StopReason.MAX_JOBS
        if options.max_time is not None and time.monotonic() - started >= options.max_time:
            return StopReason.MAX_TIME
        if options.parent_pid is not None and os.getppid() != options.parent_pid:
            return StopReason.ORPHANED
        if time.monotonic() - self._restart_checked >= RESTART_CHECK_INTERVAL:
            self._restart_checked = time.monotonic()
            marker = self._read_restart_marker()
            if marker is not None and marker != self._restart_seen:
                logger.info("restart requested worker_id=%s at=%s", self.worker_id, marker.isoformat())
                return StopReason.RESTART
        return None

    def _prune_progress(self) -> None:
        """Delete old progress rows and task results now and then, when idle, if
        DBQUEUE["PROGRESS_MAX_AGE"] or DBQUEUE["RESULT_MAX_AGE"] say so."""
        if time.monotonic() - self._pruned < PRUNE_INTERVAL:
            return
        self._pruned = time.monotonic()
        for setting, what, prune in (
            ("PROGRESS_MAX_AGE", "progress rows", progress.prune),
            ("RESULT_MAX_AGE", "results", handles.prune_results),
            (None, "worker rows", lambda hours: workers.prune(hours * 3600)),
            ("HISTORY_MAX_AGE", "history rows", history.prune),
            (None, "flow limit rows", _prune_flow_limits),
        ):
            max_age = conf.get(setting) if setting is not None else FIXED_PRUNE_HOURS[what]
            if max_age is None:
                continue
            try:
                count = prune(float(max_age))
            except DatabaseError as exc:
                logger.warning("prune of %s failed: %s", what, error_text(exc))
                continue
            if count:
                logger.info("pruned %s=%s older_than_hours=%s", what.replace(" ", "_"), count, max_age)

    def _options_text(self) -> str:
        """The options an operator looks for in the workers table."""
        options = self.options
        words = [f"batch={options.batch}", f"timeout={options.defaults.timeout}", f"tries={options.defaults.tries}"]
        if options.pooled:
            words[:0] = [f"threads={options.threads}", f"async={options.async_concurrency}"]
        if options.parent_pid is not None:
            words.append(f"supervisor={options.parent_pid}")
        return " ".join(words)

    def _flush_history(self) -> None:
        """Write the counts the heartbeat has not written yet (a clean stop)."""
        try:
            self.history.flush()
        except DatabaseError as exc:
            logger.warning("history not written worker_id=%s: %s", self.worker_id, error_text(exc))

    def _register(self) -> None:
        try:
            workers.register(self.worker_id, self.options.queues, self._options_text(), self.stats)
        except DatabaseError as exc:
            # The heartbeat writes the row once the database answers.
            logger.warning("worker row not written worker_id=%s: %s", self.worker_id, error_text(exc))

    def _unregister(self) -> None:
        try:
            workers.unregister(self.worker_id)
        except DatabaseError as exc:
            logger.warning("worker row not removed worker_id=%s: %s", self.worker_id, error_text(exc))

    def _read_restart_marker(self) -> datetime | None:
        try:
            return restart_marker()
        except DatabaseError:
            # The reserve step reports and handles database trouble.
            return self._restart_seen

    # -- steps -----------------------------------------------------------------

    def _next_job(self) -> Job | None:
        """The next prefetched job, else a fresh claim (which also finishes the jobs that ran)."""
        if self._prefetched:
            return self._prefetched.popleft()
        jobs = self.reserve(self._claim_size())
        if not jobs:
            return None
        self.heartbeat.hold(jobs)
        self._prefetched.extend(jobs[1:])
        return jobs[0]

    def _claim_size(self) -> int:
        """How many jobs to claim: up to --batch, as many as run in about BATCH_WINDOW."""
        options = self.options
        if options.once or options.batch == 1 or self._average_run is None:
            return 1
        fits = int(options.batch_window / max(self._average_run, 1e-4))
        limit = max(1, min(options.batch, fits))
        if options.max_jobs is not None:
            limit = max(1, min(limit, options.max_jobs - self.processed))
        return limit

    def reserve(self, limit: int = 1) -> list[Job]:
        """Finish the jobs that succeeded and claim up to ``limit`` more, in one
        statement where the database allows; on a database error, log, wait and
        return none."""
        if self._done_records:
            # Kept results are saved in the transaction of their jobs' DELETE.
            self._finish_done()
        done, self._done = self._done, []
        try:
            if self._reserve_errors:
                self._release_lost_claims()
            deleted, jobs = Job.objects.finish_and_reserve(
                [job for job, _ in done],
                self.options.queues,
                limit=limit,
                worker_id=self.worker_id,
                default_tries=self.options.defaults.tries,
                # The last job's watchdog must not end a long reclaim.
                before_reclaim=self._timer.pause,
            )
        except DatabaseError as exc:
            self._database_trouble(exc, "reserve", attempt=self._reserve_errors)
            self._reserve_errors += 1
            # The statement may have deleted them before its reply was lost.
            self._done = done
            self._finish_done(tried=True)
            return []
        self._reserve_errors = 0
        self._report_done(done, deleted)
        if not jobs and self._flow_switched():
            # The plain claim met jobs with limits and gave them back: they wait for the
            # flow claim, which takes them now (not an empty queue).
            return self.reserve(limit)
        return jobs

    def _flow_switched(self) -> bool:
        """Tell whether one of this worker's queues moved to the flow claim since the
        last look (``claims.plain_claimed`` does so when it gives back a job with limits)."""
        flowing = frozenset(queue for queue in self.options.queues if uses_flow_claim(queue))
        switched, self._flowing = flowing != self._flowing, flowing
        return switched

    def _give_back(self, job: Job) -> None:
        """Release a claimed job this worker will not run; it spends no try."""
        try:
            Job.objects.release(job, give_back=True)
        except DatabaseError as exc:
            logger.warning(
                "could not release job=%s id=%s: %s; it is reclaimed after retry_after",
                job.name,
                job.pk,
                error_text(exc),
            )

    def _release_prefetched(self) -> None:
        while self._prefetched:
            job = self._prefetched.popleft()
            self._give_back(job)
            self.heartbeat.drop(job)

    def _release_lost_claims(self) -> None:
        """Give back rows reserved in this worker's name by a claim whose reply was lost.

        The claim's commit can reach the server while the connection drops before
        the reply does; between jobs this worker holds nothing, so such a row would
        otherwise wait out its retry_after. A job that ran but whose outcome could
        not be stored is left alone: it is reclaimed after its retry_after.
        """
        held = Job.objects.reserved().filter(reserved_by=self.worker_id).exclude(pk__in=self._unrecorded)
        for job in held:
            if Job.objects.release(job, give_back=True):
                logger.warning(
                    "released job=%s id=%s attempt=%s: its claim committed but the reply was lost",
                    job.name,
                    job.pk,
                    job.attempts,
                )

    def process(self, job: Job) -> Outcome:
        """Run a reserved job and record its outcome, then send signals and log.

        The heartbeat covers the job from its claim until its outcome is stored,
        so neither a long run nor a database outage while recording lets the
        reservation expire. A job that succeeded with nothing to enqueue after
        it waits for its batch's DELETE (see ``_finish_done``).
        """
        if self._skipped(job):
            return Outcome("succeeded", 0)
        self._begin(job)
        outcome = self._cancelled_before(job) if job.cancel else self._execute(job)
        self._conclude(job, outcome)
        return outcome

    def _skipped(self, job: Job) -> bool:
        """End a claimed member of a cancelled batch without running it (batches.py)."""
        if not job.batch_id:
            return False
        try:
            if not batches.cancelled_lately(job.batch_id):
                return False
            skipped = batches.skip_member(job)
        except DatabaseError as exc:
            # Run as usual: the member may see the cancel itself (context.batch).
            logger.warning("cannot tell whether batch id=%s was cancelled: %s", job.batch_id, error_text(exc))
            return False
        self.processed += 1
        self.heartbeat.drop(job)
        logger.info(
            "job=%s id=%s queue=%s attempt=%s outcome=%s batch=%s",
            job.name,
            job.pk,
            job.queue,
            job.attempts,
            "skipped" if skipped else "lost",
            job.batch_id,
        )
        return True

    def _begin(self, job: Job) -> None:
        self.processed += 1
        self.stats.started(job)
        self.history.started(job.queue, job.name)
        self.heartbeat.hold([job])
        _send(signals.job_started, job=job, worker_id=self.worker_id)

    def _conclude(self, job: Job, outcome: Outcome) -> None:
        """Record the outcome of a job that ran (or batch its DELETE), then report it."""
        self.stats.stopped(job)
        if self._lost_connection(job, outcome):
            outcome = dataclasses.replace(outcome, status="released", delay=0, given_back=True, counts_exception=False)
        duration = outcome.duration
        self._average_run = duration if self._average_run is None else 0.8 * self._average_run + 0.2 * duration
        follow_ups = [] if outcome.status == "released" else self._follow_ups(job, outcome)
        keep = handles.keeps_result(job.name)
        if outcome.status == "succeeded" and not follow_ups:
            if keep:
                self._done_records[job.pk] = handles.outcome_record(
                    job, status="succeeded", worker_id=self.worker_id, result=outcome.result
                )
            if not self._done:
                self._done_since = time.monotonic()
            self._done.append((job, outcome))
            # Deleted with the next claim, or now if the batch runs long.
            if self._prefetched and time.monotonic() - self._done_since >= self.options.batch_window:
                self._finish_done()
            return
        stored, failed_job = self._store(job, outcome, follow_ups, keep=keep)
        self.heartbeat.drop(job)
        self._after_store(job, outcome, stored, failed_job)

    def _cancelled_before(self, job: Job) -> Outcome:
        """The outcome of a claimed job that carries a cancel request: it was asked to
        stop while an earlier worker held it, so it does not run again."""
        exc = JobCancelled(f"{job.name} (job {job.pk}) was cancelled while an earlier worker ran it")
        return Outcome("failed", 0, exception=exc, error=str(exc))

    def _on_cancel(self, job: Job, level: int) -> None:
        """Called from the heartbeat's thread when a cancel request for ``job`` is seen.

        A hard cancel asks that reservation of the job to stop (the pool and the
        timer compare its id and attempts with what runs, under their own lock, so
        it never reaches a job started since), and ends its process if it runs on.
        """
        if level < CANCEL_HARD:
            return
        reason = JobCancelled(f"{job.name} (job {job.pk}) was cancelled and stopped (hard)")
        if self._pool is not None:
            self._pool.ask_to_stop(job, reason)
        else:
            self._timer.ask_to_stop(job, reason)

    def _lost_connection(self, job: Job, outcome: Outcome) -> bool:
        """Tell whether the job ended because its database connection broke, not by
        its own fault; then it is given back without spending a try, up to
        ``MAX_GIVE_BACKS`` times."""
        if outcome.status == "succeeded" or outcome.exception is None:
            return False
        if not caused_by_lost_connection(outcome.exception):
            return False
        if self._pool is None:
            # The job's connection is the worker's: open a fresh one for what follows.
            # (A pool thread drops its own.)
            drop_connection()
        if outcome.snoozed:
            return False  # given back already, with the job's own delay
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

    def _finish_done(self, *, tried: bool = False) -> None:
        """Delete the jobs that succeeded in one statement, then report each.

        ``tried``: a statement that deleted them failed, and may have committed.
        """
        if not self._done:
            return
        done, self._done = self._done, []
        records, self._done_records = self._done_records, {}
        tries = 1 if tried else 0

        def delete() -> set[int]:
            nonlocal tries
            tries += 1
            if not records:
                deleted = Job.objects.delete_many_reserved([job for job, _ in done])
            else:
                with transaction.atomic(using=alias()):
                    deleted = Job.objects.delete_many_reserved([job for job, _ in done])
                    for pk in deleted:
                        if pk in records:
                            records[pk].save(using=alias(), force_insert=records[pk]._state.adding)
            if tries > 1:
                # A try that lost its connection may have committed before the reply was lost.
                deleted |= {
                    job.pk
                    for job, outcome in done
                    if job.pk not in deleted and self._stored_by_earlier_try(job, outcome)[0]
                }
            return deleted

        self._report_done(done, self._retry_database(delete, "record"))

    def _report_done(self, done: list[tuple[Job, Outcome]], deleted: set[int] | None) -> None:
        """Signal and log jobs that succeeded, once their DELETE ran (None: it never could)."""
        for job, outcome in done:
            self.heartbeat.drop(job)
            self._after_store(job, outcome, None if deleted is None else job.pk in deleted, None)

    def _after_store(self, job: Job, outcome: Outcome, stored: bool | None, failed_job: FailedJob | None) -> None:
        self.stats.ended(job, failed=bool(stored) and outcome.status == "failed")
        if stored:
            self.history.ended(
                job.queue,
                job.name,
                outcome.status if outcome.status != "released" else "retried",
                outcome.duration,
            )
            self._report(job, outcome, failed_job)
        logger.log(
            logging.INFO if outcome.status == "succeeded" or outcome.snoozed else logging.WARNING,
            "job=%s id=%s queue=%s attempt=%s outcome=%s duration=%.3fs%s%s%s",
            job.name,
            job.pk,
            job.queue,
            job.attempts,
            outcome.status,
            outcome.duration,
            f" retry_in={outcome.delay:g}s" if outcome.status == "released" else "",
            f" error={outcome.exception_class}" if outcome.exception is not None else "",
            (" snoozed" if outcome.snoozed else " given_back=connection_lost") if outcome.given_back else "",
        )
        if stored is None:
            self._unrecorded.add(job.pk)
        if stored is False:
            logger.warning(
                "reservation lost job=%s id=%s attempt=%s: another worker holds it, outcome not recorded",
                job.name,
                job.pk,
                job.attempts,
            )

    def _execute(self, job: Job) -> Outcome:
        self.in_job = True
        self._current = job
        self.heartbeat.running(job)
        try:
            with progress.keep_writer():
                return execute(
                    job,
                    worker_id=self.worker_id,
                    defaults=self.options.defaults,
                    timer=self._timer,
                    # A cancel request, or the worker's own request to stop (timeout,
                    # hard cancel, second stop signal).
                    cancel_probe=lambda: self.heartbeat.cancel_level(job) or int(self._timer.asked_to_stop(job)),
                )
        finally:
            self.heartbeat.running(None)
            self._current = None
            self.in_job = False

    def _store(
        self, job: Job, outcome: Outcome, follow_ups: list[Job], *, keep: bool = False
    ) -> tuple[bool | None, FailedJob | None]:
        """Store the outcome with the rows that follow it (and, with ``keep``, its result
        record, in the same transaction), retrying while the database is away; None if
        it never could."""
        failed_job = None
        tries = 0

        def store() -> bool:
            if not keep:
                return change()
            record = handles.outcome_record(
                job,
                status={"succeeded": "succeeded", "failed": "failed"}.get(outcome.status, "waiting"),
                worker_id=self.worker_id,
                result=outcome.result,
                error="" if outcome.given_back else outcome.error,
                exception_class="" if outcome.given_back else outcome.exception_class,
            )
            with transaction.atomic(using=alias()):
                stored = change()
                if stored:
                    record.save(using=alias(), force_insert=record._state.adding)
            return stored

        def change() -> bool:
            nonlocal failed_job, tries
            tries += 1
            if outcome.status == "succeeded":
                stored = Job.objects.delete_reserved(job, follow_ups=follow_ups)
            elif outcome.status == "released":
                stored = Job.objects.release(
                    job, delay=outcome.delay, give_back=outcome.given_back, exception=outcome.counts_exception
                )
            else:
                failed_job = Job.objects.fail(
                    job, error=outcome.error, exception_class=outcome.exception_class, follow_ups=follow_ups
                )
                stored = failed_job is not None
            if not stored and tries > 1:
                # The try that lost its connection may have committed before the reply was lost.
                stored, failed_job = self._stored_by_earlier_try(job, outcome)
            return stored

        return self._retry_database(store, "record"), failed_job

    def _stored_by_earlier_try(self, job: Job, outcome: Outcome) -> tuple[bool, FailedJob | None]:
        """Tell whether a try whose connection dropped had stored ``outcome`` after all.

        A compare-and-set that matches nothing on the next try means that, or that
        the reservation expired and another worker took the job. A failure is told
        apart exactly (FailedJob keeps the reservation's attempts). A row that is
        gone (or, for a release, reserved again) was changed by this worker only if
        its reservation cannot have expired meanwhile (``Heartbeat.lease_safe``);
        after a longer outage another worker may have reclaimed, run and deleted
        it, so the outcome counts as not stored by this worker: it is logged, not
        reported, and a job's outcome is never reported twice.
        """
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

    def _follow_ups(self, job: Job, outcome: Outcome) -> list[Job]:
        if isinstance(outcome.exception, JobCancelled):
            # A cancelled job runs no on_failure callback; its remaining steps stay in FailedJob.
            return []
        try:
            return rows.follow_ups(job, succeeded=outcome.status == "succeeded")
        except Exception:  # a row's fault (JSON nested too deep) must not end the worker
            logger.exception("cannot enqueue what follows job=%s id=%s", job.name, job.pk)
            return []

    def _report(self, job: Job, outcome: Outcome, failed_job: FailedJob | None) -> None:
        """Write the final progress and send the outcome's signal; neither changes what was stored."""
        if outcome.tracker is not None:
            with progress.keep_writer():
                outcome.tracker.flush()
                if outcome.status == "succeeded":
                    outcome.tracker.succeeded()
                elif outcome.status == "failed":
                    outcome.tracker.failed(outcome.error)
        if outcome.status == "succeeded":
            _send(
                signals.job_succeeded,
                job=job,
                worker_id=self.worker_id,
                duration=outcome.duration,
                result=outcome.result,
            )
        elif outcome.status == "released":
            _send(
                signals.job_released,
                job=job,
                worker_id=self.worker_id,
                duration=outcome.duration,
                exception=outcome.exception,
                delay=outcome.delay,
            )
        else:
            if isinstance(outcome.exception, JobCancelled):
                _send(signals.job_cancelled, job_id=job.pk, failed_job=failed_job)
            _send(
                signals.job_failed,
                job=job,
                failed_job=failed_job,
                worker_id=self.worker_id,
                exception=outcome.exception,
            )

    def _retry_database(self, action: Callable[[], T], what: str) -> T | None:
        attempt = 0
        while True:
            try:
                return action()
            except DatabaseError as exc:
                lost = self._database_trouble(exc, what, attempt)
                attempt += 1
                if self._signals >= 2 or (not lost and attempt >= MAX_RECORD_ERRORS):
                    logger.error("giving up on %s after %s errors; the reservation will be reclaimed", what, attempt)
                    return None

    def _database_trouble(self, exc: DatabaseError, what: str, attempt: int) -> bool:
        # Retried without end only while the session is what broke (a killed
        # session, a restarted server); a query the database refuses (a missing
        # column: SQLite says OperationalError too) is not. Told by the error, not
        # by a probe: a connection opened to probe the server would sit idle
        # through the wait below and could be killed as well.
        lost = is_connection_error(exc)
        if lost:
            # The other workers' rows go stale while the database is away: none of them
            # is taken for dead, and its jobs reclaimed, until it had time to beat again.
            workers.postpone_reclaim()
        # A fresh connection costs little on this path and clears any broken state.
        drop_connection()
        if self._pool is not None and self._pool.busy:
            # The pool's jobs run on meanwhile: those past their timeout are asked to stop
            # now, not once the database is back; one that does not is ended then. (Not
            # once the pool gave up its jobs to end the process: none may start now.)
            self._pool.check_deadlines()
        delay = DB_RETRY_DELAYS[min(attempt, len(DB_RETRY_DELAYS) - 1)]
        logger.warning(
            "database error during %s worker_id=%s connection_lost=%s retry_in=%ss: %s",
            what,
            self.worker_id,
            lost,
            delay,
            error_text(exc),
        )
        # Not cut short by a first stop signal: recording the current outcome is
        # part of finishing the current job.
        self.wait(delay, until_stop=False)
        return lost

    def wait(self, seconds: float, *, until_stop: bool = True, listen: bool = False) -> bool:
        """Sleep up to ``seconds``; a stop signal wakes the worker at once, and with
        ``listen`` so does a new job (PostgreSQL NOTIFY): then return True."""
        if seconds <= 0 or (until_stop and self.stop_requested):
            return False
        self._timer.pause()
        waiting_on = [self._wake_r]
        listen_fd = self._listener.fileno() if listen and self._listener is not None else None
        if listen_fd is not None:
            waiting_on.append(listen_fd)
        ready, _, _ = select.select(waiting_on, [], [], seconds)
        if self._wake_r in ready:
            os.read(self._wake_r, 4096)
        if listen_fd is not None and listen_fd in ready and self._listener is not None:
            self._listener.drain()
            return True
        return False

    # -- signals ---------------------------------------------------------------

    def request_stop(self) -> None:
        """Finish the current job, then stop."""
        self.stop_requested = True
        self._poke()

    def _poke(self) -> None:
        """Wake the main thread from ``wait`` (from any thread, or a signal handler)."""
        try:
            os.write(self._wake_w, b"x")
        except (BlockingIOError, OSError):
            pass

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        self._signals += 1
        if self._signals == 1:
            logger.info(
                "stopping worker_id=%s signal=%s: finishing the current job",
                self.worker_id,
                signal.Signals(signum).name,
            )
            self.request_stop()
        elif self._pool is not None:
            self.request_stop()
        else:
            # Asked, never raised into the job: it stops by itself (and is released) or
            # is given back once its grace is over, and the process exits.
            current = self._current
            stopped = WorkerStopped(f"the worker was stopped by {signal.Signals(signum).name} twice")
            if current is not None and self._timer.ask_to_stop(current, stopped):
                logger.warning(
                    "stopping now worker_id=%s: the current job is asked to stop, and given back in %ss unless it does",
                    self.worker_id,
                    self.options.defaults.timeout_grace,
                )
            self.request_stop()

    @contextmanager
    def handle_signals(self) -> Iterator[None]:
        """Handle SIGTERM and SIGINT while the worker runs; restore the old handlers after."""
        previous: dict[int, Any] = {}
        try:
            for stop_signal in (signal.SIGTERM, signal.SIGINT):
                previous[stop_signal] = signal.signal(stop_signal, self._on_signal)
        except ValueError:
            # Not the main thread: stop only through request_stop().
            pass
        try:
            yield
        finally:
            for signum, handler in previous.items():
                signal.signal(signum, handler)


def _asked_for(reason: BaseException | None) -> str:
    """What asked a job to stop, for the log."""
    if isinstance(reason, JobCancelled):
        return "a hard cancel"
    if isinstance(reason, WorkerStopped):
        return "a second stop signal"
    return "its timeout"


def _ending(outcome: Outcome) -> Outcome:
    """The outcome of a job that did not stop, as a process that ends for it records it:
    a release waits ``ENDING_RELEASE_DELAY`` at least."""
    if outcome.status != "released":
        return outcome
    return dataclasses.replace(outcome, delay=max(outcome.delay, ENDING_RELEASE_DELAY))


def _send(signal_: Any, **kwargs: Any) -> None:
    """Send a signal; a receiver that raises is logged and changes nothing."""
    for receiver, response in signal_.send_robust(sender=Worker, **kwargs):
        if isinstance(response, Exception):
            logger.error("signal receiver %r raised", receiver, exc_info=response)
