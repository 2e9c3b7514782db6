"""The worker loop: claim, run on an executor of one slot or N, record the outcome, repeat."""

from __future__ import annotations

import dataclasses
import enum
import logging
import os
import select
import signal
import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime
from types import FrameType
from typing import Any, NoReturn

from django.db import DatabaseError

from . import batches, claims, finished, history, lifecycle, registry, schema, signals, unique, workers
from .autoscale import Bounds
from .claims import clear_unique_keys, retry_in, use_flow_claim, uses_flow_claim
from .db import alias, error_text, watch_network
from .exceptions import JobCancelled, WorkerStopped
from .execution import Defaults, Outcome
from .heartbeat import Heartbeat
from .inline import Inline
from .listener import Listener
from .models import CANCEL_HARD, Job
from .operations import restart_marker
from .outcomes import Outages, Outcomes, asked_for, ending
from .pool import Executor, Pool, Run
from .pressure import Pressure
from .ticker import Ticker

logger = logging.getLogger("django_dbqueue")

# Seconds between two looks at the restart marker (queue_restart).
RESTART_CHECK_INTERVAL = 2.0
# Seconds between two prunes of old rows by an idle worker.
PRUNE_INTERVAL = 600.0
# A claim takes about as many jobs as the slots run in this many seconds (so none waits long
# in one worker while another is free); succeeded jobs wait about as long for their DELETE.
BATCH_WINDOW = 0.05
# queue_work --batch: the most jobs claimed at once per slot. 50 drains no-op jobs 1.5-1.7x
# faster than 10; the quick jobs that ran before a long one are deleted before it starts
# (``Outcomes.before_run``), so a kill during it runs none of them again.
DEFAULT_BATCH = 50
# Seconds a stopping worker goes on starting the jobs it claimed before it gives the rest back.
STOP_FINISH = 1.0
# queue_work --threads and --async-concurrency: the most allowed (a typo guard).
MAX_THREADS = 512
MAX_ASYNC = 10_000
# The exit code after a job asked to stop ran on past its grace (recorded, the others given
# back): the supervisor starts a fresh process.
EXIT_TIMED_OUT = 77


class StopReason(enum.Enum):
    SIGNAL = "signal"
    TIMED_OUT = "timed-out"
    EMPTY = "empty"
    DONE = "done"
    ONCE = "once"
    MAX_JOBS = "max-jobs"
    MAX_TIME = "max-time"
    MEMORY = "memory"
    ORPHANED = "orphaned"
    RESTART = "restart"


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
    # Stop once the queues hold no job at all (waiting, delayed, blocked or reserved), retries included.
    until_done: bool = False
    once: bool = False
    batch: int = DEFAULT_BATCH  # most jobs claimed at once per slot
    batch_window: float = BATCH_WINDOW
    parent_pid: int | None = None  # set by a supervisor: stop once it is no longer our parent
    # Sync jobs in this many threads, ``async def`` ones on one loop (pool); else the main thread.
    threads: int = 1
    async_concurrency: int = 0
    autoscale: Bounds | None = None  # threads from its minimum to its maximum, as the queue needs
    schedule: bool = True  # tick the schedules declared in code

    @property
    def pooled(self) -> bool:
        return self.threads > 1 or self.async_concurrency > 0 or self.autoscale is not None


class Worker:
    """Serve ``options.queues`` until a stop condition; see ``run``."""

    def __init__(self, options: WorkerOptions, *, worker_id: str | None = None) -> None:
        self.options = options
        self.worker_id = worker_id or workers.new_worker_id()
        self.processed = 0
        self.stop_requested = False
        self._signals = 0
        self._flowing: frozenset[str] = frozenset()
        self._restart_seen: datetime | None = None
        self._restart_checked = 0.0
        self._pruned = -PRUNE_INTERVAL
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_w, False)
        self._listener = Listener.configured()
        self.pressure = Pressure.configured(self.worker_id)
        # Written into the worker's row and the history by the heartbeat.
        self.stats = workers.Stats()
        self.history = history.Recorder()
        self.heartbeat = Heartbeat(
            self.worker_id, queues=options.queues, options=self._options_text, stats=self.stats, recorder=self.history
        )
        self.heartbeat.on_cancel = self._on_cancel
        self.executor: Executor
        if options.pooled:
            self.executor = Pool(
                threads=options.threads,
                async_slots=options.async_concurrency,
                defaults=options.defaults,
                worker_id=self.worker_id,
                cancel_level=self.heartbeat.cancel_level,
                wake=self._poke,
                autoscale=options.autoscale,
            )
        else:
            self.executor = Inline(
                defaults=options.defaults,
                worker_id=self.worker_id,
                cancel_level=self.heartbeat.cancel_level,
                on_stuck=self._end_stuck,
                before_run=lambda job: self.outcomes.before_run(job),
            )
        self.outages = Outages(
            self.worker_id,
            self.heartbeat,
            wait=lambda seconds: self.wait(seconds, until_stop=False),
            forced=lambda: self._signals >= 2,
            meanwhile=lambda: self.executor.busy and self.executor.check_deadlines(),
        )
        self.outcomes = Outcomes(
            self.worker_id,
            batch_window=options.batch_window,
            heartbeat=self.heartbeat,
            stats=self.stats,
            history=self.history,
            outages=self.outages,
            sender=Worker,
        )

    def run(self) -> StopReason:
        """Process jobs until a stop condition; return why the worker stopped."""
        started = time.monotonic()
        self._require_tables(at_start=True)
        # Before "worker started": a queue_restart sent after that line reaches this worker.
        self._restart_seen = self._read_restart_marker()
        self._restart_checked = started
        watch_network()
        self.heartbeat.register()
        for definition in registry.all_definitions().values():
            if definition.uses_limits:
                use_flow_claim(definition.effective_queue)
            if unique.scope(definition) == unique.UNTIL_STARTED:
                clear_unique_keys(definition.effective_queue)
        self._flow_switched()
        if finished.keeping():
            # The days ahead of the history's partitions (PostgreSQL), as idle workers' pruning also makes.
            try:
                finished.add_partitions()
            except DatabaseError as exc:
                logger.warning("could not add the finished jobs' partitions: %s", error_text(exc))
        logger.info(
            "worker started worker_id=%s queues=%s%s",
            self.worker_id,
            ",".join(self.options.queues),
            f" {self._options_text()}" if self.options.pooled else "",
        )
        with (
            self.handle_signals(),
            self.heartbeat.start(),
            self.executor,
            Ticker(self.worker_id, self.options.schedule),
        ):
            try:
                reason = self._loop(started)
            except schema.NotMigrated:
                self.heartbeat.unregister()
                raise
            finally:
                self.outcomes.finish_done()
                self._release_claimed()
                os.close(self._wake_r)
                os.close(self._wake_w)
        self.heartbeat.unregister()
        logger.info("worker stopped worker_id=%s reason=%s processed=%s", self.worker_id, reason.value, self.processed)
        return reason

    def _loop(self, started: float) -> StopReason:
        executor, options = self.executor, self.options
        stopping: tuple[StopReason, float] | None = None  # the stop condition seen, and since when
        next_claim = 0.0  # no claim before then: the queue was found empty
        held = 0.0  # nor before then: the database is under pressure (pressure.py)
        finished = False
        while True:
            stuck, next_look = executor.check_deadlines()
            if stuck is not None:
                self._end_stuck(stuck, executor.abandon())
            if stopping is None and (reason := self._stop_reason(started, finished)) is not None:
                stopping = (reason, time.monotonic())
            if stopping is not None:
                # Claimed jobs run rather than go back: all after --max-jobs or --once, none over
                # --memory or after a second signal, else for STOP_FINISH seconds.
                reason, since = stopping
                if self._signals >= 2 or reason is StopReason.MEMORY:
                    executor.stopping = True
                elif reason not in (StopReason.MAX_JOBS, StopReason.ONCE):
                    executor.stopping = time.monotonic() - since >= STOP_FINISH
            finished = self._collect()
            if stopping is not None:
                if not executor.busy:
                    return stopping[0]
                if not finished:
                    until = None if executor.stopping else stopping[1] + STOP_FINISH - time.monotonic()
                    self._wait_for_outcomes(next_look, until)
                continue
            if finished:
                if options.rest > 0:
                    self.outcomes.finish_done()
                    self.wait(options.rest)
                continue
            want = self._claim_size()
            if want > 0 and time.monotonic() >= max(next_claim, held):
                jobs = self.reserve(want)
                executor.claimed(want, len(jobs))
                if jobs:
                    self._submit(jobs)
                    if self.pressure is not None:
                        held = time.monotonic() + self.pressure.pause  # a NOTIFY does not cut it short
                    continue
                if self.outages.claim_errors:
                    continue  # its backoff was waited: not an empty queue
                if not executor.busy:
                    if (reason := self._idle()) is not None:
                        return reason
                    continue
                next_claim = time.monotonic() + self._sleep()
            if self.outcomes.delete_due() == 0:
                self.outcomes.finish_done()
            # Until a job ends, a deadline, a signal; after an empty claim, a NOTIFY or --sleep.
            claim_in = max(next_claim, held) - time.monotonic() if want > 0 else None
            if self._wait_for_outcomes(next_look, claim_in, listen=claim_in is not None):
                next_claim = 0.0

    def _claim_size(self) -> int:
        """How many jobs to claim: none while draining or one slot has jobs left; else one per
        free slot plus what the slots run in ``batch_window``, ``--batch`` per slot at most."""
        executor, options = self.executor, self.options
        slots, busy = executor.capacity, executor.busy
        if executor.draining or (slots == 1 and busy):
            return 0
        if options.once:
            return 0 if self.processed else 1
        ahead = 0
        if (average := self.outcomes.average_run) is not None:
            ahead = int(slots * options.batch_window / max(average, 1e-4))
        want = slots + min(ahead, slots * (options.batch - 1)) - busy
        if options.max_jobs is not None:
            want = min(want, options.max_jobs - self.processed)
        return max(0, want)

    def _wait_for_outcomes(self, next_look: float | None, at_most: float | None, *, listen: bool = False) -> bool:
        """Wait for an outcome, a signal, the next deadline or ``at_most`` seconds; tell whether a NOTIFY came."""
        if self.executor.has_outcomes:
            return False
        seconds = 60.0 if at_most is None else at_most
        if (due := self.outcomes.delete_due()) is not None:
            seconds = min(seconds, due)
        if next_look is not None:
            seconds = min(seconds, max(0.0, next_look - time.monotonic()) + 0.001)
        return self.wait(max(seconds, 0.0005), until_stop=False, listen=listen)

    def _stop_reason(self, started: float, finished: bool) -> StopReason | None:
        options = self.options
        if self.stop_requested:
            return StopReason.SIGNAL
        if options.max_jobs is not None and self.processed >= options.max_jobs:
            return StopReason.MAX_JOBS
        if options.max_time is not None and time.monotonic() - started >= options.max_time:
            return StopReason.MAX_TIME
        if options.parent_pid is not None and os.getppid() != options.parent_pid:
            return StopReason.ORPHANED
        if options.once and self.processed and not self.executor.busy:
            return StopReason.ONCE
        # After a job, so a worker that starts above the limit still makes progress.
        if finished and options.memory is not None and (used := workers.memory_mb()) >= options.memory:
            logger.warning(
                "memory limit reached worker_id=%s memory_mb=%.0f limit_mb=%s", self.worker_id, used, options.memory
            )
            return StopReason.MEMORY
        if time.monotonic() - self._restart_checked >= RESTART_CHECK_INTERVAL:
            self._restart_checked = time.monotonic()
            marker = self._read_restart_marker()
            if marker is not None and marker != self._restart_seen:
                logger.info("restart requested worker_id=%s at=%s", self.worker_id, marker.isoformat())
                return StopReason.RESTART
        return None

    def _idle(self) -> StopReason | None:
        """Nothing claimed, nothing runs: stop, or prune now and then and wait for work; not if the
        claim ran out of rounds (``retry_in`` is 0)."""
        if retry_in() == 0:
            return None
        if self.options.once:
            return StopReason.ONCE
        if self.options.stop_when_empty:
            return StopReason.EMPTY
        if self.options.until_done and claims.holds_nothing(self.options.queues, alias()):
            return StopReason.DONE
        self._prune()
        self.wait(self._sleep(), listen=True)
        return None

    def _require_tables(self, *, at_start: bool = False, migrations: bool = False) -> None:
        """Stop with ``schema.NotMigrated`` if the queue's database lacks the app's tables (with
        ``migrations``, or its latest migration); a database out of reach is ridden out."""
        found = schema.problem(alias(), migrations=migrations)
        if found is None:
            return
        logger.error("worker stopped worker_id=%s: %s", self.worker_id, found)
        if at_start:  # else run's own cleanup closes them
            os.close(self._wake_r)
            os.close(self._wake_w)
        raise schema.NotMigrated(found)

    def _sleep(self) -> float:
        """Seconds to wait after an empty claim: ``--sleep``, or less for a rate-limited job."""
        hint = retry_in()
        return self.options.sleep if hint is None else min(self.options.sleep, hint)

    def reserve(self, limit: int = 1) -> list[Job]:
        """Delete the jobs that succeeded and claim up to ``limit`` more, in one statement where
        the database allows; on a database error, log, wait and return none."""
        done = self.outcomes.take_done()
        started = time.monotonic()
        try:
            if self.outages.claim_errors:
                self.outages.release_lost_claims()
            deleted, jobs = claims.finish_and_reserve(
                [job for job, _ in done],
                self.options.queues,
                limit=limit,
                worker_id=self.worker_id,
                default_tries=self.options.defaults.tries,
                # The last job's watchdog must not end a long reclaim.
                before_reclaim=self.executor.pause,
            )
        except DatabaseError as exc:
            if schema.names_missing_schema(exc):
                self._require_tables(migrations=True)  # else "no such table" for ever
            self.outages.claim_failed(exc)
            # The statement may have deleted them before its reply was lost.
            self.outcomes.done = done
            self.outcomes.finish_done(tried=True)
            return []
        self.outages.claim_errors = 0
        if self.pressure is not None:
            self.pressure.claimed(time.monotonic() - started)
        self.outcomes.report_done(done, deleted)
        if not jobs and self._flow_switched():
            # The plain claim gave back jobs with limits: the flow claim takes them now.
            return self.reserve(limit)
        return jobs

    def _flow_switched(self) -> bool:
        """Tell whether one of this worker's queues moved to the flow claim since the last look."""
        flowing = frozenset(queue for queue in self.options.queues if uses_flow_claim(queue))
        switched, self._flowing = flowing != self._flowing, flowing
        return switched

    def process(self, job: Job) -> None:
        """Run a claimed job and record its outcome (a one-slot worker: here and now)."""
        self._submit([job])
        self._collect()

    def _submit(self, jobs: list[Job]) -> None:
        """Hand claimed jobs to the executor, covered by the heartbeat; a cancelled one ends at once."""
        self.heartbeat.hold(jobs)
        runnable = []
        for job in jobs:
            if self._skipped(job):
                continue
            self.processed += 1
            self.stats.started(job)
            self.history.started(job.queue, history.shown_name(job))
            self.outcomes.send(signals.job_started, job=job, worker_id=self.worker_id)
            if job.cancel:
                # Asked to stop while an earlier worker held it: it does not run again.
                exc = JobCancelled(f"{job.name} (job {job.pk}) was cancelled while an earlier worker ran it")
                self._conclude(job, Outcome("failed", 0, exception=exc, error=str(exc)))
                continue
            self.heartbeat.running(job)
            runnable.append(job)
        self.executor.submit(runnable)

    def _collect(self) -> bool:
        """Record the outcomes of the jobs that ended (one slot: run the next now), give back those
        not started; tell whether any ended."""
        finished = self.executor.collect()
        for job, outcome in finished:
            self.heartbeat.stopped(job)
            if outcome is None:
                self._give_back(job)
            else:
                self._conclude(job, outcome)
        return bool(finished)

    def _skipped(self, job: Job) -> bool:
        """End a claimed member of a cancelled batch without running it (batches.py)."""
        if not job.batch_id:
            return False
        try:
            if not batches.cancelled_lately(job.batch_id):
                return False
            skipped = lifecycle.skip_member(job)
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

    def _release_claimed(self) -> None:
        """Give back the jobs handed to the executor that no thread or loop took."""
        self.executor.stopping = True
        for run in self.executor.abandon():
            if run.thread is None and not run.on_loop:
                self._give_back(run.job)

    def _give_back(self, job: Job) -> None:
        self.outages.give_back(job)
        self.heartbeat.drop(job)

    def _on_cancel(self, job: Job, level: int) -> None:
        """From the heartbeat's thread: a hard cancel asks this reservation of ``job`` to stop."""
        if level >= CANCEL_HARD:
            self.executor.ask_to_stop(job, JobCancelled(f"{job.name} (job {job.pk}) was cancelled and stopped (hard)"))

    def _end_stuck(self, stuck: Run, runs: list[Run]) -> NoReturn:
        """A job asked to stop runs on past its grace (or blocks the loop): record those asked for
        a timeout or a cancel, give back every other job, end the process (from the main
        thread, or the timer's for one slot)."""
        recorded = [
            run
            for run in runs
            if (run is stuck or run.reason is not None) and not isinstance(run.reason, WorkerStopped)
        ]
        logger.error(
            "job=%s id=%s did not stop within %ss of %s in its %s: recording %s job(s), giving back %s, "
            "and ending the process",
            stuck.job.name,
            stuck.job.pk,
            self.options.defaults.timeout_grace,
            asked_for(stuck.reason),
            "event loop" if stuck.on_loop else "thread",
            len(recorded),
            len(runs) - len(recorded),
        )
        self.executor.stopping = True
        self.heartbeat.running(None)
        for run in runs:
            self.heartbeat.stopped(run.job)
            if run not in recorded:
                if run.reason is not None:
                    logger.warning("job=%s id=%s did not stop: given back", run.job.name, run.job.pk)
                self._give_back(run.job)
                continue
            self._conclude(run.job, ending(run, self.options.defaults))
        self.outcomes.finish_done()
        self.heartbeat.unregister()
        reason = StopReason.TIMED_OUT if recorded else StopReason.SIGNAL
        logger.info("worker stopped worker_id=%s reason=%s processed=%s", self.worker_id, reason.value, self.processed)
        # Threads that may still run a stuck job must not hold the exit up.
        logging.shutdown()
        os._exit(EXIT_TIMED_OUT if recorded else 0)

    def _conclude(self, job: Job, outcome: Outcome) -> None:
        self.stats.stopped(job)
        self.outcomes.conclude(job, outcome, more=self.executor.busy > 0)

    def _prune(self) -> None:
        if time.monotonic() - self._pruned >= PRUNE_INTERVAL:
            self._pruned = time.monotonic()
            workers.prune_old_rows()

    def _options_text(self) -> str:
        """The options an operator looks for in the workers table (each beat: threads follow --autoscale)."""
        options = self.options
        words = [f"batch={options.batch}", f"timeout={options.defaults.timeout}", f"tries={options.defaults.tries}"]
        if options.pooled:
            threads = self.executor.capacity - options.async_concurrency
            words[:0] = [f"threads={threads}", f"async={options.async_concurrency}"]
        if options.autoscale is not None:
            words.insert(0, f"autoscale={options.autoscale}")
        if self.pressure is not None and self.pressure.pause:
            words.append(self.pressure.text())
        if options.parent_pid is not None:
            words.append(f"supervisor={options.parent_pid}")
        return " ".join(words)

    def _read_restart_marker(self) -> datetime | None:
        try:
            return restart_marker()
        except DatabaseError:
            return self._restart_seen  # the claim reports database trouble

    def wait(self, seconds: float, *, until_stop: bool = True, listen: bool = False) -> bool:
        """Sleep up to ``seconds``, woken by a stop signal, and with ``listen`` by a NOTIFY (then True)."""
        if seconds <= 0 or (until_stop and self.stop_requested):
            return False
        self.executor.pause()
        waiting_on = [self._wake_r]
        listen_fd = self._listener.fileno() if listen and self._listener is not None else None
        if listen_fd is not None and self._listener is not None and self._listener.heard():
            self._listener.drain()
            return True
        if listen_fd is not None:
            waiting_on.append(listen_fd)
        ready, _, _ = select.select(waiting_on, [], [], seconds)
        if self._wake_r in ready:
            os.read(self._wake_r, 4096)
        if listen_fd is not None and listen_fd in ready and self._listener is not None:
            self._listener.drain()
            return True
        return False

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
        name = signal.Signals(signum).name
        if self._signals == 1:
            logger.info("stopping worker_id=%s signal=%s: finishing the current job", self.worker_id, name)
        elif self.executor.busy:
            # Asked, never raised into a job: it stops, or is given back after its grace.
            logger.warning(
                "stopping now worker_id=%s: asking %s job(s) to stop, given back in %ss unless they do",
                self.worker_id,
                self.executor.busy,
                self.options.defaults.timeout_grace,
            )
            self.executor.ask_all_to_stop(
                lambda job: WorkerStopped(f"{job.name} (job {job.pk}): the worker was stopped by {name} twice")
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
            pass  # not the main thread: stop only through request_stop()
        try:
            yield
        finally:
            for signum, handler in previous.items():
                signal.signal(signum, handler)
