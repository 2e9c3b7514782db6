"""A worker's heartbeat: while the worker lives, it extends every reservation it holds.

Without it ``retry_after`` would have to outlast the longest run, or a live worker's
job would be reclaimed and run twice in parallel; with it, ``retry_after`` is how
long a worker may stay silent before its jobs are presumed dead. One thread per
worker covers all it holds (running, claimed ahead, waiting for their DELETE) with
one UPDATE, and only once a held reservation is a third of its ``retry_after``
old, so a worker busy with short jobs never beats at all.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from types import TracebackType

from django.db import DatabaseError

from . import lifecycle, workers
from .db import drop_connection, error_text
from .history import Recorder
from .models import Job

logger = logging.getLogger("django_dbqueue")

# Beats per retry_after: two beats may fail before the reservation expires.
BEATS_PER_RETRY_AFTER = 3
# Never beat more often than this (seconds), whatever the retry_after.
MIN_INTERVAL = 0.25
# Seconds before a beat that failed on a database error is tried again.
ERROR_RETRY = 1.0
# Seconds ``stop`` waits for a beat in flight (a connect to a server that is away).
STOP_WAIT = 5.0
# A job that runs this many seconds is asked about cancel requests (``Job.cancel``),
# and again every as many seconds while it runs.
CANCEL_POLL = 1.0
# Seconds taken off a reservation's lease when judging whether it may have
# expired: the claim's reply, and the clocks of two hosts ticking at their rates.
LEASE_MARGIN = 1.0


def beat_interval(retry_after: float) -> float:
    """Seconds between two extensions of a reservation that expires after ``retry_after``."""
    return max(retry_after / BEATS_PER_RETRY_AFTER, MIN_INTERVAL)


class Heartbeat:
    """Extend the reservations ``worker_id`` holds (``hold``, until ``drop``), from a
    thread with its own connection, so a beat is never part of the worker's
    transactions. ``interval`` overrides every job's beat interval (tests)."""

    def __init__(
        self,
        worker_id: str,
        *,
        interval: float | None = None,
        queues: Sequence[str] | None = None,
        options: str = "",
        stats: workers.Stats | None = None,
        recorder: Recorder | None = None,
    ) -> None:
        self.worker_id = worker_id
        self.interval = interval
        # With queues, the thread also keeps the worker's QueueWorker row fresh (see
        # ``workers``), with ``stats`` in it, and adds ``recorder``'s counts to the history.
        self.queues = list(queues) if queues is not None else None
        self.options = options
        self.stats = stats
        self.recorder = recorder
        # When the worker's row is next refreshed (monotonic); None: never.
        self._seen_due: float | None = None
        # When the row was last written (monotonic): others take the worker for dead,
        # and reclaim its jobs, ``workers.dead_after()`` after that.
        self._row_fresh = time.monotonic()
        # The jobs running now (id -> job, monotonic start), when they are next asked
        # about cancel requests, and the requests seen: id -> (attempts, Job.cancel level).
        self._running: dict[int, tuple[Job, float]] = {}
        self._cancel_due: float | None = None
        self._cancels: dict[int, tuple[int, int]] = {}
        # Called from the heartbeat's thread with the job and the level of a cancel request.
        self.on_cancel: Callable[[Job, int], None] | None = None
        # Until when the thread sleeps (monotonic).
        self._sleep_until = 0.0
        self.beats = 0
        self.lost = 0
        self._lock = threading.Lock()
        # id -> (job, monotonic time its reservation was last known fresh)
        self._held: dict[int, tuple[Job, float]] = {}
        # id -> the monotonic time the next beat's interval counts from, when it is not
        # the last fresh time: after a failed beat, the retry comes sooner, while the
        # lease (``lease_safe``) still counts from the last beat that reached the database.
        self._beat_from: dict[int, float] = {}
        self._wake = threading.Event()
        # When the thread will beat next (monotonic); None while nothing is held.
        self._due: float | None = None
        self._stopping = False
        self._thread: threading.Thread | None = None

    # -- what the worker holds ----------------------------------------------

    def hold(self, jobs: Iterable[Job]) -> None:
        """Cover freshly claimed ``jobs`` (a job already covered keeps its entry);
        starts the thread on first use."""
        now = time.monotonic()
        sooner = False
        with self._lock:
            for job in jobs:
                entry = self._held.get(job.pk)
                if entry is None or entry[0].attempts != job.attempts:
                    self._held[job.pk] = (job, now)
                    self._beat_from.pop(job.pk, None)
                    sooner = sooner or self._due is None or now + self._interval(job) < self._due
        if self._thread is None:
            self.start()
        elif sooner:
            # The thread sleeps until a later beat, or until something is held.
            self._wake.set()

    def drop(self, job: Job) -> None:
        """Stop covering ``job`` (this reservation of it)."""
        with self._lock:
            entry = self._held.get(job.pk)
            if entry is not None and entry[0].attempts == job.attempts:
                del self._held[job.pk]
                self._beat_from.pop(job.pk, None)
        self._cancels.pop(job.pk, None)

    def held(self) -> list[Job]:
        with self._lock:
            return [job for job, _ in self._held.values()]

    def running(self, job: Job | None) -> None:
        """Say that ``job`` runs now (None: no job runs; see ``stopped`` for a pooled
        worker's jobs). A job that runs ``CANCEL_POLL`` seconds is asked about cancel
        requests, so short jobs cost nothing."""
        if job is None:
            # The poll time stays: the thread wakes then, finds nothing running, and
            # sleeps on, instead of being woken again by the next job.
            self._running.clear()
            return
        now = time.monotonic()
        with self._lock:
            self._running[job.pk] = (job, now)
            if self._cancel_due is not None and self._cancel_due > now:
                return  # a poll is due already; the job is asked at a poll after this one
            self._cancel_due = due = now + CANCEL_POLL
        # The thread already wakes before then for an earlier job: no wake-up per job.
        if self._thread is not None and due < self._sleep_until:
            self._wake.set()

    def stopped(self, job: Job) -> None:
        """Say that ``job`` no longer runs (one of several; see ``running``)."""
        with self._lock:
            entry = self._running.get(job.pk)
            if entry is not None and entry[0].attempts == job.attempts:
                del self._running[job.pk]

    def cancel_level(self, job: Job) -> int:
        """The cancel request seen for this reservation of ``job`` (``Job.cancel``), 0 if none."""
        attempts, level = self._cancels.get(job.pk, (-1, 0))
        return level if attempts == job.attempts else 0

    def lease_safe(self, job: Job) -> bool:
        """Tell whether this reservation of ``job`` cannot have expired yet.

        True while the last time it was known fresh (claimed, or extended by a
        beat) is less than its ``retry_after`` ago, less ``LEASE_MARGIN``: until
        then no other worker can have reclaimed it, so a row found gone was
        deleted by this worker. False once that is no longer certain (a beat
        could not reach the database for that long), or if ``job`` is not held.
        """
        with self._lock:
            entry = self._held.get(job.pk)
        if entry is None or entry[0].attempts != job.attempts:
            return False
        now = time.monotonic()
        if self.queues is not None and now >= self._row_fresh + workers.dead_after() - LEASE_MARGIN:
            # The row went unrefreshed long enough for idle workers to reclaim early.
            return False
        return now < entry[1] + job.retry_after - LEASE_MARGIN

    # -- the worker's row --------------------------------------------------------

    def register(self) -> None:
        """Write the worker's row as it starts (or the first beat does, once the database answers)."""
        try:
            workers.register(self.worker_id, self.queues or [], self.options, self.stats)
        except DatabaseError as exc:
            logger.warning("worker row not written worker_id=%s: %s", self.worker_id, error_text(exc))

    def unregister(self) -> None:
        """Write the history counts not written yet and delete the worker's row (a clean stop)."""
        try:
            if self.recorder is not None:
                self.recorder.flush()
        except DatabaseError as exc:
            logger.warning("history not written worker_id=%s: %s", self.worker_id, error_text(exc))
        try:
            workers.unregister(self.worker_id)
        except DatabaseError as exc:
            logger.warning("worker row not removed worker_id=%s: %s", self.worker_id, error_text(exc))

    # -- the thread ------------------------------------------------------------

    def start(self) -> Heartbeat:
        if self._thread is None:
            self._stopping = False
            if self.queues is not None:
                # The worker wrote its row as it started.
                self._row_fresh = time.monotonic()
                self._seen_due = time.monotonic() + workers.beat_seconds()
            self._thread = threading.Thread(target=self._run, name=f"dbqueue-heartbeat-{self.worker_id}", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        """Stop beating; wait a little for a beat in flight."""
        self._stopping = True
        self._wake.set()
        thread, self._thread = self._thread, None
        if thread is not None and thread.is_alive():
            thread.join(STOP_WAIT)

    def __enter__(self) -> Heartbeat:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, traceback: TracebackType | None
    ) -> None:
        self.stop()

    def _interval(self, job: Job) -> float:
        return self.interval if self.interval is not None else beat_interval(job.retry_after)

    def _next_beat(self) -> float | None:
        """Monotonic time of the next beat, None when nothing is held (and no row is kept fresh)."""
        with self._lock:
            self._due = min(
                (self._beat_from.get(job.pk, fresh) + self._interval(job) for job, fresh in self._held.values()),
                default=None,
            )
            chores = [due for due in (self._seen_due, self._cancel_due) if due is not None]
            return min([*chores, self._due] if self._due is not None else chores, default=None)

    def _run(self) -> None:
        connected = False
        try:
            while not self._stopping:
                due = self._next_beat()
                if due is None or due > time.monotonic():
                    # Woken early by a hold (a shorter interval may be due sooner) or a stop.
                    self._sleep_until = float("inf") if due is None else due
                    self._wake.wait(None if due is None else due - time.monotonic())
                    self._wake.clear()
                    continue
                connected = True
                self._beat()
        finally:
            if connected:
                drop_connection()

    def _beat(self) -> None:
        if self._seen_due is not None and self._seen_due <= time.monotonic() and self.queues is not None:
            self._seen_due = time.monotonic() + workers.beat_seconds()
            try:
                started = time.monotonic()
                workers.seen(self.worker_id, self.queues, self.options, self.stats)
                self._row_fresh = started
                if self.recorder is not None:
                    self.recorder.flush()
            except DatabaseError as exc:
                logger.warning("worker row or history not written worker_id=%s: %s", self.worker_id, error_text(exc))
                drop_connection()
        if self._cancel_due is not None and self._cancel_due <= time.monotonic():
            self._poll_cancel()
        if self._due is None or self._due > time.monotonic():
            return
        jobs = self.held()
        started = time.monotonic()
        try:
            extended = lifecycle.extend_many(jobs, worker_id=self.worker_id)
        except DatabaseError as exc:
            logger.warning(
                "heartbeat failed worker_id=%s jobs=%s retry_in=%ss: %s",
                self.worker_id,
                len(jobs),
                ERROR_RETRY,
                error_text(exc),
            )
            drop_connection()
            self._retry_soon(jobs)
            return
        self.beats += 1
        with self._lock:
            for job in jobs:
                entry = self._held.get(job.pk)
                if entry is None or entry[0].attempts != job.attempts:
                    continue  # dropped meanwhile
                self._beat_from.pop(job.pk, None)
                if job.pk in extended:
                    self._held[job.pk] = (job, started)
                else:
                    del self._held[job.pk]
                    self.lost += 1
                    logger.warning(
                        "heartbeat stopped job=%s id=%s attempt=%s worker_id=%s: the reservation "
                        "is no longer this worker's",
                        job.name,
                        job.pk,
                        job.attempts,
                        self.worker_id,
                    )

    def _poll_cancel(self) -> None:
        now = time.monotonic()
        with self._lock:
            jobs = [job for job, since in self._running.values() if since + CANCEL_POLL <= now]
            young = [since + CANCEL_POLL for job, since in self._running.values() if since + CANCEL_POLL > now]
            self._cancel_due = min([*young, now + CANCEL_POLL] if jobs else young, default=None)
        if not jobs:
            return
        try:
            levels = lifecycle.cancel_requests(jobs)
        except DatabaseError as exc:
            logger.warning("cancel requests not read worker_id=%s: %s", self.worker_id, error_text(exc))
            drop_connection()
            return
        for job in jobs:
            level = levels.get(job.pk, 0)
            if level and self.cancel_level(job) < level:
                self._cancels[job.pk] = (job.attempts, level)
                logger.info(
                    "cancel requested job=%s id=%s attempt=%s hard=%s", job.name, job.pk, job.attempts, level > 1
                )
                if self.on_cancel is not None:
                    self.on_cancel(job, level)

    def _retry_soon(self, jobs: list[Job]) -> None:
        """Make the next beat come ``ERROR_RETRY`` seconds from now (or sooner if due sooner)."""
        now = time.monotonic()
        with self._lock:
            for job in jobs:
                entry = self._held.get(job.pk)
                if entry is not None and entry[0].attempts == job.attempts:
                    interval = self._interval(job)
                    # Not the fresh time: the reservation was not extended.
                    self._beat_from[job.pk] = now - interval + min(ERROR_RETRY, interval)
