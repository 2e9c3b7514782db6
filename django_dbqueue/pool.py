"""The N-slot executor (``queue_work --threads N --async-concurrency M``): sync jobs in threads,
``async def`` jobs on one event loop; the main thread alone claims and stores outcomes. With
``--autoscale MIN,MAX`` the threads follow the queue (``autoscale`` decides): a thread added
starts at once, one that goes ends between two jobs, never during one.

No exception is raised into a job's thread (at an arbitrary point it would leave a broken
connection or a held lock to the thread's next jobs): a job past its timeout, hard-cancelled or
forced to stop is asked to (``cancel_requested``); while one runs on, no job starts and none is
claimed; one still running ``timeout_grace`` later ends the process in order
(``Worker._end_stuck``). An asyncio job is cancelled at its next ``await``.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import faulthandler
import inspect
import itertools
import logging
import queue
import threading
import time
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import Any, Protocol, Self

from asgiref.sync import sync_to_async
from django.db import DatabaseError, connections

from . import progress, registry
from .autoscale import Autoscaler, Bounds
from .db import caused_by_lost_connection, drop_connection
from .exceptions import WorkerStopped
from .execution import (
    Defaults,
    Outcome,
    Prepared,
    arun_prepared,
    cancel_reason,
    cancel_task,
    ends_as_asked,
    hard_stop_later,
    outcome_of,
    past_timeout,
    prepare_run,
    run_prepared,
)
from .middleware import for_loop
from .models import Job

logger = logging.getLogger("django_dbqueue")

# Seconds between two looks at the running jobs' deadlines.
SCAN_INTERVAL = 0.1
# Seconds faulthandler leaves the worker to end a stuck job in order before it ends the
# process itself, once no thread could run Python code for half as long (_arm_last_resort).
LAST_RESORT_SLACK = 10.0


def connections_per_process(threads: int, async_slots: int) -> int:
    """The most database connections one worker process opens: one per job thread, the main
    thread's, the heartbeat's, LISTEN's, the progress writer's, the ticker's, and with a loop
    the thread ``sync_to_async`` runs ORM calls in."""
    if threads <= 1 and not async_slots:
        return 5  # jobs run on the main thread's connection
    return threads + 5 + (1 if async_slots else 0)


@dataclasses.dataclass(eq=False)
class Run:
    """A job handed to the pool, until the worker collects its outcome."""

    job: Job
    on_loop: bool
    prepared: Prepared | None = None
    # Monotonic: when it is asked to stop (threads; asyncio enforces its own), when its
    # process ends for it. None: no timeout.
    soft_at: float | None = None
    hard_at: float | None = None
    # Why it was asked to stop: what it ends with, or is recorded with if its process ends.
    reason: BaseException | None = None
    thread: _Thread | None = None
    # Its outcome was handed back: its deadlines no longer apply.
    ended: bool = False
    task: asyncio.Task[Any] | None = None

    def start_clock(self, defaults: Defaults) -> None:
        """Set the run's deadlines as it starts."""
        seconds = self.job.timeout or defaults.timeout
        if seconds:
            if not self.on_loop:
                self.soft_at = time.monotonic() + seconds
            self.hard_at = time.monotonic() + seconds + defaults.timeout_grace


class Executor(Protocol):
    """What the worker loop asks of its executor, entered for the worker's life."""

    @property
    def capacity(self) -> int: ...  # slots: jobs run at once

    stopping: bool  # set when the worker stops starting jobs: those not started come back unrun

    @property
    def busy(self) -> int: ...  # handed over and not collected: running or waiting for a slot
    @property
    def draining(self) -> bool: ...  # a job asked to stop runs on: none starts, none is claimed
    @property
    def has_outcomes(self) -> bool: ...  # ``collect`` has something to do now

    def __enter__(self) -> Self: ...
    def __exit__(self, *exc_info: object) -> None: ...
    def claimed(self, asked: int, got: int) -> None: ...  # a claim's result, before its jobs' submit
    def submit(self, jobs: list[Job]) -> None: ...
    def collect(self) -> list[tuple[Job, Outcome | None]]: ...  # None: not started
    def ask_to_stop(self, job: Job, reason: BaseException) -> bool: ...
    def ask_all_to_stop(self, reason_for: Callable[[Job], BaseException]) -> None: ...
    def check_deadlines(self) -> tuple[Run | None, float | None]: ...  # a stuck run; when to look again
    def abandon(self) -> list[Run]: ...  # forget every job handed over, for the worker to settle
    def pause(self) -> None: ...  # the worker waits, or talks to the database, between jobs


class _Thread:
    """One pool thread: runs jobs from the pool's queue one at a time."""

    def __init__(self, pool: Pool, number: int) -> None:
        self.pool = pool
        self.run: Run | None = None
        self.thread = threading.Thread(target=self.main, name=f"dbqueue-job-{number}", daemon=True)

    def main(self) -> None:
        pool = self.pool
        try:
            while True:
                run = pool._thread_jobs.get()
                if run is None:
                    return  # the pool stops, or has a thread too many (autoscale)
                # Not while a job asked to stop runs on: its process may end for it.
                pool._may_start.wait()
                outcome: Outcome | None = None
                # Before the look at ``stopping``: a stopping worker gives back the runs no thread took.
                run.thread = self
                try:
                    if not pool.stopping:
                        outcome = self.execute(run)
                except BaseException as exc:  # noqa: BLE001 - nothing a job does may end a pool thread
                    outcome = _internal_error(run, exc)
                pool._finished(run, outcome)
        finally:
            connections.close_all()

    def execute(self, run: Run) -> Outcome:
        pool = self.pool
        self.run = run
        run.start_clock(pool.defaults)
        try:
            prepared = prepare_run(
                run.job, worker_id=pool.worker_id, defaults=pool.defaults, cancel_probe=pool._cancel_probe(run)
            )
            if isinstance(prepared, Outcome):
                return prepared
            run.prepared = prepared
            if run.reason is not None:
                return outcome_of(prepared, run.reason, pool.defaults)
            return run_prepared(prepared, pool.defaults, self)
        finally:
            self.run = None
            _reset_connections(run)

    def limit(self, prepared: Prepared, seconds: int | None) -> AbstractContextManager[None]:
        """The ``execution.Timer`` of a pool run: the main thread watches its deadlines."""
        run = self.run
        assert run is not None
        return ends_as_asked(lambda: run.reason)


def _internal_error(run: Run, exc: BaseException) -> Outcome:
    """The outcome of a run the pool's own code failed around: given back, no try spent."""
    logger.error("job=%s id=%s: the pool failed to run it; given back", run.job.name, run.job.pk, exc_info=exc)
    return Outcome("released", 0, exception=exc, error=f"{type(exc).__name__}: {exc}", given_back=True)


def _reset_connections(run: Run) -> None:
    """Give back this thread's connections as Django does at a request's end: closed if a job
    left it in a transaction, broken, or past its ``CONN_MAX_AGE`` (0, the default: at once; with
    ``OPTIONS["pool"]``, back to the pool); so a job thread holds a connection only while a job
    that uses the ORM runs, and a persistent one (``CONN_MAX_AGE`` > 0) for its next job."""
    for connection in connections.all(initialized_only=True):
        if connection.connection is None:
            continue
        try:
            if connection.in_atomic_block or not connection.get_autocommit():
                logger.warning(
                    "job=%s id=%s left a transaction open on %r: rolled back and closed",
                    run.job.name,
                    run.job.pk,
                    connection.alias,
                )
                raw, connection.connection = connection.connection, None
                try:
                    raw.close()
                except Exception:  # noqa: BLE001 - it is being thrown away
                    pass
                del connections[connection.alias]
            else:
                connection.close_if_unusable_or_obsolete()
        except DatabaseError:
            drop_connection(connection.alias)


class Pool:
    """Up to ``threads`` sync jobs in threads (with ``autoscale``, from its minimum to its maximum,
    as the queue needs) and ``async_slots`` async jobs on one loop."""

    def __init__(
        self,
        *,
        threads: int,
        async_slots: int,
        defaults: Defaults,
        worker_id: str,
        cancel_level: Callable[[Job], int],
        wake: Callable[[], None],
        autoscale: Bounds | None = None,
    ) -> None:
        self.threads = max(1, threads) if autoscale is None else autoscale.minimum
        self._scaler = None if autoscale is None else Autoscaler(autoscale, time.monotonic())
        self.async_slots = async_slots
        self.defaults = defaults
        self.worker_id = worker_id
        self._cancel_level = cancel_level  # heartbeat.cancel_level
        self._wake = wake  # called from any thread when an outcome is ready
        self._thread_jobs: queue.SimpleQueue[Run | None] = queue.SimpleQueue()
        # Cleared while a thread job asked to stop runs on: the process may end for it.
        self._may_start = threading.Event()
        self._may_start.set()
        # Outcomes to collect; None: not started (the pool is stopping).
        self._outcomes: collections.deque[tuple[Run, Outcome | None]] = collections.deque()
        self.stopping = False
        self._abandoned = False  # jobs still running were given up on
        # Runs to start in the loop's thread, and its slots (made there).
        self._to_loop: list[Run] = []
        self._loop_slots: asyncio.Semaphore | None = None
        self._pool_threads: list[_Thread] = []
        self._thread_numbers = itertools.count(1)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loop_thread: threading.Thread | None = None
        # Job id -> its run, for every job handed over and not collected.
        self.runs: dict[int, Run] = {}
        self._next_scan = 0.0
        # The last resort (_arm_last_resort): when armed to fire (0: not), the soonest it may,
        # and the thread that pushes it back while the interpreter runs.
        self._last_resort_at = 0.0
        self._last_resort_due = 0.0
        self._last_resort_lock = threading.Condition()
        self._last_resort_keeper: threading.Thread | None = None
        self._writer: AbstractContextManager[None] = nullcontext()

    def __enter__(self) -> Pool:
        """Start the threads and the loop; all jobs write progress through one connection."""
        self._writer = progress.share_writer()
        self._writer.__enter__()
        self._add_threads(self.threads)
        if self.async_slots:
            self._loop = asyncio.new_event_loop()
            self._loop_thread = threading.Thread(target=self._loop.run_forever, name="dbqueue-loop", daemon=True)
            self._loop_thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        try:
            self.stop(wait=1.0)
        finally:
            self._writer.__exit__(None, None, None)

    def _add_threads(self, count: int) -> None:
        for _ in range(count):
            pool_thread = _Thread(self, next(self._thread_numbers))
            self._pool_threads.append(pool_thread)
            pool_thread.thread.start()

    def pause(self) -> None:
        pass  # the last resort is armed only while runs are past a deadline (check_deadlines)

    def stop(self, wait: float = 5.0) -> None:
        """End the threads and the loop (after the jobs they run, up to ``wait`` seconds)."""
        self.stopping = True
        self._may_start.set()
        for _ in self._pool_threads:
            self._thread_jobs.put(None)
        # A thread may still run a job that did not stop: waiting for it is in vain.
        deadline = time.monotonic() + (0.0 if self._abandoned else wait)
        for pool_thread in self._pool_threads:
            pool_thread.thread.join(max(0.0, deadline - time.monotonic()))
        if self._loop is not None and self._loop_thread is not None:
            # Close the connections of the thread Django's sync_to_async runs ORM calls in.
            closing = asyncio.run_coroutine_threadsafe(sync_to_async(connections.close_all)(), self._loop)
            try:
                closing.result(max(0.1, deadline - time.monotonic()))
            except Exception:  # noqa: BLE001 - a stuck ORM call keeps its connection until exit
                logger.warning("the connections of the async ORM thread were not closed")
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._loop_thread.join(max(0.0, deadline - time.monotonic()))
            if not self._loop_thread.is_alive():
                self._loop.close()
        self._disarm_last_resort()

    @property
    def busy(self) -> int:
        return len(self.runs)

    @property
    def capacity(self) -> int:
        return self.threads + self.async_slots

    def _runs_on_loop(self, job: Job) -> bool:
        """Tell whether ``job`` is an ``async def`` job and the pool has a loop for it."""
        if not self.async_slots:
            return False
        try:
            definition = registry.get(job.name)
        except Exception:  # noqa: BLE001 - an unknown name fails in a thread, with its reason
            return False
        return inspect.iscoroutinefunction(definition.func)

    def submit(self, jobs: list[Job]) -> None:
        """Run each of ``jobs`` on the first free thread (sync jobs) or loop slot (async jobs); with
        ``autoscale``, look at the slots then."""
        for job in jobs:
            run = Run(job, on_loop=False)
            self.runs[job.pk] = run
            if self._runs_on_loop(job):
                # Prepared here: model arguments come through the ORM, which the loop may not use.
                prepared = prepare_run(
                    job, worker_id=self.worker_id, defaults=self.defaults, cancel_probe=self._cancel_probe(run)
                )
                if isinstance(prepared, Outcome):
                    self._finished(run, prepared)
                    continue
                if for_loop(prepared.middleware()) is not None:
                    run.on_loop = True
                    run.prepared = prepared
                    self._to_loop.append(run)
                    continue
                # A sync middleware wraps it: it runs in a thread (asgiref's async_to_sync).
            self._thread_jobs.put(run)
        if self._to_loop and self._loop is not None:
            runs, self._to_loop = self._to_loop, []
            self._loop.call_soon_threadsafe(self._start_tasks, runs)
        if self._scaler is not None:
            self._resize()

    def claimed(self, asked: int, got: int) -> None:
        """Note that a claim asked for ``asked`` jobs and got ``got``, which ``submit`` gets next:
        with ``autoscale``, the slots are looked at then (at once after an empty claim)."""
        if self._scaler is not None:
            self._scaler.claimed(asked, got)
            if not got:
                self._resize()

    def _resize(self) -> None:
        """Start or end threads as the autoscaler decides; a thread too many ends between two jobs."""
        assert self._scaler is not None
        if self.stopping:
            return
        busy = self._held_for_threads()
        resize = self._scaler.decide(busy, time.monotonic())
        if resize is None:
            return
        self._pool_threads = [thread for thread in self._pool_threads if thread.thread.is_alive()]
        self._add_threads(resize.after - self.threads)
        for _ in range(self.threads - resize.after):
            # Behind the runs queued already: taken by a thread that has none (it ends, and
            # closes its connections).
            self._thread_jobs.put(None)
        self.threads = resize.after
        logger.info(
            "slots changed worker_id=%s from=%s to=%s busy=%s reason=%s",
            self.worker_id,
            resize.before,
            resize.after,
            busy,
            resize.reason,
        )

    def _held_for_threads(self) -> int:
        """Jobs running in a thread or waiting for one."""
        if not self.async_slots:
            return len(self.runs)
        return sum(not run.on_loop for run in self.runs.values())

    def _start_tasks(self, runs: list[Run]) -> None:
        assert self._loop is not None  # in the loop's thread
        if self._loop_slots is None:
            self._loop_slots = asyncio.Semaphore(self.async_slots)
        for run in runs:
            run.task = self._loop.create_task(self._run_on_loop(run, self._loop_slots))

    async def _run_on_loop(self, run: Run, slots: asyncio.Semaphore) -> None:
        assert run.prepared is not None
        outcome: Outcome | None = None
        try:
            async with slots:
                if not self.stopping:
                    run.start_clock(self.defaults)
                    outcome = await arun_prepared(run.prepared, self.defaults)
        except asyncio.CancelledError:
            # While it waited for a slot: a forced stop (not started), or a cancel.
            reason = cancel_reason(run.task)
            if reason is not None and not isinstance(reason, WorkerStopped):
                outcome = outcome_of(run.prepared, reason, self.defaults)
        except BaseException as exc:  # noqa: BLE001 - the loop must live on
            outcome = _internal_error(run, exc)
        self._finished(run, outcome)

    def _finished(self, run: Run, outcome: Outcome | None) -> None:
        # Any thread (deque.append is atomic).
        if outcome is not None and outcome.exception is not None and not run.on_loop:
            if caused_by_lost_connection(outcome.exception):
                drop_connection()  # the thread's next job opens a fresh one
        run.ended = True
        self._outcomes.append((run, outcome))
        self._wake()

    def collect(self) -> list[tuple[Job, Outcome | None]]:
        """The outcomes of the jobs that ended since the last call (None: not started)."""
        done = []
        while self._outcomes:
            run, outcome = self._outcomes.popleft()
            if self.runs.get(run.job.pk) is not run:
                continue  # given up on already (a forced stop)
            del self.runs[run.job.pk]
            done.append((run.job, outcome))
        return done

    @property
    def has_outcomes(self) -> bool:
        return bool(self._outcomes)

    def _cancel_probe(self, run: Run) -> Callable[[], int]:
        """What ``context.cancel_requested`` reads: a cancel request, or the worker's own."""
        return lambda: self._cancel_level(run.job) or (1 if run.reason is not None else 0)

    def ask_to_stop(self, job: Job, reason: BaseException) -> bool:
        """Ask this reservation of ``job`` to stop with ``reason``, and end the process if it
        runs ``timeout_grace`` seconds later; False if the pool does not run it."""
        run = self.runs.get(job.pk)
        if run is None or run.job.attempts != job.attempts:
            return False
        grace_end = time.monotonic() + self.defaults.timeout_grace
        run.hard_at = grace_end if run.hard_at is None else min(run.hard_at, grace_end)
        if run.reason is None:
            run.reason = reason
        if run.on_loop and self._loop is not None:
            # After the task's start (call_soon is first in, first out): run.task is set.
            self._loop.call_soon_threadsafe(self._cancel_task, run, reason)
        self._next_scan = 0.0
        return True

    @staticmethod
    def _cancel_task(run: Run, reason: BaseException) -> None:
        if run.task is not None and not run.task.done():
            cancel_task(run.task, reason)

    def ask_all_to_stop(self, reason_for: Callable[[Job], BaseException]) -> None:
        for run in list(self.runs.values()):
            self.ask_to_stop(run.job, reason_for(run.job))

    @property
    def draining(self) -> bool:
        return not self._may_start.is_set()

    def check_deadlines(self) -> tuple[Run | None, float | None]:
        """Ask thread jobs past their timeout to stop; return a run past its grace (the process
        must end) and when to look again (every ``SCAN_INTERVAL`` at most, while jobs run)."""
        now = time.monotonic()
        if not self.runs:
            self._may_start.set()
            self._disarm_last_resort()
            return None, None
        if now < self._next_scan:
            return None, self._next_scan
        self._next_scan = now + SCAN_INTERVAL
        stuck = None
        draining = False
        for run in list(self.runs.values()):
            if run.ended:
                continue  # its outcome waits to be collected
            if run.hard_at is not None and run.hard_at <= now:
                stuck = stuck or run
            elif run.soft_at is not None and run.soft_at <= now and run.reason is None and run.thread is not None:
                run.reason = past_timeout(
                    run.job, run.job.timeout or self.defaults.timeout, self.defaults.timeout_grace
                )
            draining = draining or (run.reason is not None and run.thread is not None)
        if draining:
            self._may_start.clear()
        else:
            self._may_start.set()
        self._arm_last_resort()
        return stuck, self._next_scan

    def _arm_last_resort(self) -> None:
        """Arm faulthandler for an interpreter blocked (C code holding the GIL) past a hard stop:
        ``LAST_RESORT_SLACK`` after the earliest, and only once no Python code ran for half that
        slack (a keeper thread pushes it back), so a worker that waits for the database is spared."""
        earliest = min(
            (run.hard_at for run in self.runs.values() if run.hard_at is not None and not run.ended), default=None
        )
        if earliest is None:
            self._disarm_last_resort()
            return
        with self._last_resort_lock:
            self._last_resort_due = earliest + LAST_RESORT_SLACK
            self._keep_last_resort(time.monotonic())
            if self._last_resort_keeper is None:
                self._last_resort_keeper = threading.Thread(
                    target=self._last_resort_keeper_main, name="dbqueue-last-resort", daemon=True
                )
                self._last_resort_keeper.start()

    def _keep_last_resort(self, now: float) -> None:
        """Arm it ``LAST_RESORT_SLACK`` from ``now``, or at its due time if later (under the lock)."""
        soonest = max(self._last_resort_due, now + LAST_RESORT_SLACK / 2)
        wanted = max(self._last_resort_due, now + LAST_RESORT_SLACK)
        # Re-arming starts faulthandler's thread: keep an arming that fires late enough, and
        # at most one slack later than it must.
        if soonest <= self._last_resort_at <= wanted + LAST_RESORT_SLACK:
            return
        hard_stop_later(wanted - now)
        self._last_resort_at = wanted
        self._last_resort_lock.notify()

    def _last_resort_keeper_main(self) -> None:
        """Push the arming back within half a slack of firing: that this runs shows the
        interpreter is not blocked."""
        with self._last_resort_lock:
            try:
                while self._last_resort_at:
                    self._last_resort_lock.wait(self._last_resort_at - LAST_RESORT_SLACK / 2 - time.monotonic() + 0.01)
                    if self._last_resort_at:
                        self._keep_last_resort(time.monotonic())
            finally:
                self._last_resort_keeper = None

    def _disarm_last_resort(self) -> None:
        if not self._last_resort_at:
            return  # only this thread arms it once disarmed
        with self._last_resort_lock:
            if self._last_resort_at:
                faulthandler.cancel_dump_traceback_later()
                self._last_resort_at = 0.0
                self._last_resort_lock.notify()

    def abandon(self) -> list[Run]:
        """Forget every job handed out (threads or tasks may still run it); return their runs."""
        runs = list(self.runs.values())
        self.runs.clear()
        self._abandoned = self._abandoned or bool(runs)
        return runs
