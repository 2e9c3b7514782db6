"""The one-slot executor: claimed jobs run one at a time in the worker's main thread, watched by a
``JobTimer`` (``queue_work`` without ``--threads`` or ``--async-concurrency``)."""

from __future__ import annotations

import collections
import faulthandler
import logging
import math
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from . import progress
from .db import caused_by_lost_connection, drop_connection
from .execution import (
    Defaults,
    Outcome,
    Prepared,
    ends_as_asked,
    hard_stop_later,
    past_timeout,
    prepare_run,
    run_prepared,
)
from .models import Job
from .pool import Run

logger = logging.getLogger("django_dbqueue")


class Inline:
    """One slot: each job runs when ``collect`` is called, after ``before_run(job)``; one that does
    not stop in time goes to ``on_stuck(stuck, runs)`` from the timer's thread."""

    capacity = 1
    draining = False

    def __init__(
        self,
        *,
        defaults: Defaults,
        worker_id: str,
        cancel_level: Callable[[Job], int],
        on_stuck: Callable[[Run, list[Run]], None],
        before_run: Callable[[Job], None] = lambda job: None,
    ) -> None:
        self.defaults = defaults
        self._before_run = before_run
        self.worker_id = worker_id
        self._cancel_level = cancel_level
        self._on_stuck = on_stuck
        self.timer = JobTimer(defaults.timeout_grace, on_stuck=self._stuck)
        self.queued: collections.deque[Job] = collections.deque()
        self.current: Job | None = None
        self.stopping = False

    def __enter__(self) -> Inline:
        self.timer.__enter__()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.timer.__exit__()

    @property
    def busy(self) -> int:
        return len(self.queued) + (self.current is not None)

    @property
    def has_outcomes(self) -> bool:
        return bool(self.queued)

    def claimed(self, asked: int, got: int) -> None:
        pass  # one slot, whatever the queue holds

    def submit(self, jobs: list[Job]) -> None:
        self.queued.extend(jobs)

    def collect(self) -> list[tuple[Job, Outcome | None]]:
        """Run the next job here and now; once stopping, hand back every queued job unrun."""
        if self.stopping:
            return [(run.job, None) for run in self.abandon()]
        if not self.queued:
            return []
        self._before_run(self.queued[0])
        job = self.current = self.queued.popleft()
        try:
            with progress.keep_writer():
                outcome = execute(
                    job,
                    worker_id=self.worker_id,
                    defaults=self.defaults,
                    timer=self.timer,
                    cancel_probe=lambda: self._cancel_level(job) or int(self.timer.asked_to_stop(job)),
                )
        finally:
            self.current = None
        if outcome.exception is not None and caused_by_lost_connection(outcome.exception):
            drop_connection()  # the job's connection is the worker's
        return [(job, outcome)]

    def ask_to_stop(self, job: Job, reason: BaseException) -> bool:
        return self.timer.ask_to_stop(job, reason)

    def ask_all_to_stop(self, reason_for: Callable[[Job], BaseException]) -> None:
        current = self.current
        if current is not None:
            self.timer.ask_to_stop(current, reason_for(current))

    def check_deadlines(self) -> tuple[Run | None, float | None]:
        return None, None  # the timer's thread watches

    def abandon(self) -> list[Run]:
        jobs, self.queued = list(self.queued), collections.deque()
        return [Run(job, on_loop=False) for job in jobs]

    def pause(self) -> None:
        self.timer.pause()

    def _stuck(self, prepared: Prepared, reason: BaseException) -> None:
        # In the timer's thread: the main thread never comes back from this job.
        stuck = Run(prepared.job, on_loop=False, prepared=prepared, reason=reason)
        self._on_stuck(stuck, [stuck, *self.abandon()])


class JobTimer:
    """The watch over the job in the main thread: asked to stop (never interrupted) at its
    timeout or by ``ask_to_stop``; one still running ``grace`` later goes to ``on_stuck`` in the
    timer's thread, which records it and ends the process; faulthandler ends it
    ``LAST_RESORT_SLACK`` later if C code holds the GIL. One timer serves a worker's life: the
    thread wakes only for a sooner deadline, and one arming (``HARD_STOP_SLACK`` to spare) covers
    quick jobs in a row. A request names its run (id, attempts), so it never reaches the next."""

    def __init__(self, grace: float, on_stuck: Callable[[Prepared, BaseException], None] | None = None) -> None:
        self.grace = grace
        self._on_stuck = on_stuck
        # Reentrant: a stop signal's handler runs in the main thread, perhaps inside ``limit``.
        self._lock = threading.RLock()
        self._changed = threading.Condition(self._lock)
        # The run inside ``limit``, its deadlines and why it was asked to stop.
        self._prepared: Prepared | None = None
        self._seconds: int | None = None
        self._soft_at: float | None = None
        self._hard_at: float | None = None
        self._reason: BaseException | None = None
        self._taken = False  # the thread records the run and ends the process
        self._sleeping_until = math.inf
        self._thread: threading.Thread | None = None
        self._closed = False
        self._hard_stop_at = 0.0  # when faulthandler fires; 0: not armed

    def __enter__(self) -> JobTimer:
        # The thread starts with the worker, not a job: creating one blocks signals in this
        # thread for a moment, and a SIGTERM then goes to a thread that cannot wake a job's sleep.
        with self._lock:
            self._closed = False
            self._wake_for(math.inf)
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.pause()
        with self._lock:
            self._closed = True
            self._changed.notify()

    def ask_to_stop(self, job: Job, reason: BaseException) -> bool:
        """Ask this reservation of ``job`` to stop with ``reason`` (any thread); it goes to
        ``on_stuck`` if it runs ``grace`` later. False when it does not run here."""
        with self._lock:
            prepared = self._prepared
            if self._taken or prepared is None or (prepared.job.pk, prepared.job.attempts) != (job.pk, job.attempts):
                return False
            if self._reason is None:
                self._reason = reason
            hard_at = time.monotonic() + self.grace
            if self._hard_at is None or hard_at < self._hard_at:
                self._hard_at = hard_at
                self._arm(hard_at)
            self._wake_for(hard_at)
            return True

    def asked_to_stop(self, job: Job) -> bool:
        """Tell whether this reservation of ``job`` was asked to stop."""
        with self._lock:
            prepared = self._prepared
            return (
                self._reason is not None
                and prepared is not None
                and (prepared.job.pk, prepared.job.attempts) == (job.pk, job.attempts)
            )

    @contextmanager
    def limit(self, prepared: Prepared, seconds: int | None) -> Iterator[None]:
        """Watch ``prepared``'s run inside (``seconds``: its timeout; None or 0: none)."""
        now = time.monotonic()
        with self._lock:
            self._prepared, self._seconds, self._reason = prepared, seconds, None
            self._soft_at = now + seconds if seconds else None
            self._hard_at = now + seconds + self.grace if seconds else None
            if self._soft_at is not None:
                self._wake_for(self._soft_at)
        if seconds:
            assert self._hard_at is not None
            # Keep an arming that fires after this job's last resort, by HARD_STOP_SLACK at most.
            needed = self._hard_at + LAST_RESORT_SLACK
            if not needed <= self._hard_stop_at <= needed + HARD_STOP_SLACK:
                self._arm(self._hard_at, spare=HARD_STOP_SLACK)
        else:
            # An arming for an earlier job must not end this one.
            self.pause()
        try:
            with ends_as_asked(lambda: self._reason):
                yield
        finally:
            with self._lock:
                taken = self._taken
                if not taken:
                    self._prepared = self._reason = self._soft_at = self._hard_at = None
            if taken:
                # The timer's thread records it and ends the process: touch nothing meanwhile.
                threading.Event().wait()

    def pause(self) -> None:
        """Disarm faulthandler until the next job (not once a stuck job is being recorded)."""
        if self._hard_stop_at and not self._taken:
            faulthandler.cancel_dump_traceback_later()
            self._hard_stop_at = 0.0

    def _arm(self, hard_at: float, *, spare: float = 0.0) -> None:
        """Make faulthandler end the process ``LAST_RESORT_SLACK`` seconds after ``hard_at``."""
        at = hard_at + LAST_RESORT_SLACK + spare
        hard_stop_later(max(0.001, at - time.monotonic()))
        self._hard_stop_at = at

    def _wake_for(self, at: float) -> None:
        # Under the lock. The thread starts when the timer is entered (again after it ended).
        if self._thread is None or not self._thread.is_alive():
            self._thread = threading.Thread(target=self._watch, name="dbqueue-timer", daemon=True)
            self._thread.start()
        elif at < self._sleeping_until:
            self._changed.notify()

    def _watch(self) -> None:
        with self._lock:
            while not self._closed:
                now = time.monotonic()
                prepared = self._prepared
                if prepared is not None and self._reason is None and self._soft_at is not None and self._soft_at <= now:
                    self._reason = past_timeout(prepared.job, self._seconds, self.grace)
                if prepared is not None and self._hard_at is not None and self._hard_at <= now:
                    if self._on_stuck is not None:
                        self._taken = True
                        break
                    self._hard_at = None
                due = self._soft_at if self._reason is None else self._hard_at
                self._sleeping_until = math.inf if due is None else due
                self._changed.wait(None if due is None else max(0.0, due - now))
            else:
                return
            reason = self._reason
        assert self._on_stuck is not None and reason is not None
        try:
            self._on_stuck(prepared, reason)
        except Exception:  # faulthandler ends the process anyway
            logger.exception("job=%s id=%s: its outcome could not be recorded", prepared.job.name, prepared.job.pk)


# Seconds an arming for one job may outlast its last resort: jobs within it need no new arming.
HARD_STOP_SLACK = 1.0
# Seconds faulthandler leaves the timer's thread, after a job's grace, to end the process in order.
LAST_RESORT_SLACK = 5.0


def execute(
    job: Job,
    *,
    worker_id: str,
    defaults: Defaults,
    timer: JobTimer | None = None,
    cancel_probe: Callable[[], int] | None = None,
) -> Outcome:
    """Run ``job`` and return its outcome; never raises for the job's fault. Without ``timer``
    one for this run alone only asks the job to stop at its timeout."""
    if timer is None:
        with JobTimer(defaults.timeout_grace) as own_timer:
            return execute(job, worker_id=worker_id, defaults=defaults, timer=own_timer, cancel_probe=cancel_probe)
    prepared = prepare_run(job, worker_id=worker_id, defaults=defaults, cancel_probe=cancel_probe)
    if isinstance(prepared, Outcome):
        return prepared
    return run_prepared(prepared, defaults, timer)
