"""A worker's heartbeat: while the worker lives, it extends every reservation it holds, so
``retry_after`` is how long a worker may stay silent, not the longest run. One thread covers
all it holds with one UPDATE, once a reservation is a third of its ``retry_after`` old (short
jobs cost no beat); it also refreshes the worker's row, flushes the history, polls cancels.
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
# Seconds between two looks at the cancel requests of a running job (from its first second).
CANCEL_POLL = 1.0
# Seconds taken off a lease when judging whether it may have expired (the claim's reply, clock rates).
LEASE_MARGIN = 1.0


def beat_interval(retry_after: float) -> float:
    """Seconds between two extensions of a reservation that expires after ``retry_after``."""
    return max(retry_after / BEATS_PER_RETRY_AFTER, MIN_INTERVAL)


class Heartbeat:
    """Extend the reservations ``worker_id`` holds (``hold`` until ``drop``) from a thread with
    its own connection, outside the worker's transactions. ``interval``: every job's (tests)."""

    def __init__(
        self,
        worker_id: str,
        *,
        interval: float | None = None,
        queues: Sequence[str] | None = None,
        options: str | Callable[[], str] = "",
        stats: workers.Stats | None = None,
        recorder: Recorder | None = None,
    ) -> None:
        self.worker_id = worker_id
        self.interval = interval
        # With queues, it also keeps the worker's row fresh with ``stats`` and ``options`` (read
        # at each beat when a callable: a worker's threads change with --autoscale), and flushes ``recorder``.
        self.queues = list(queues) if queues is not None else None
        self.options = options
        self.stats = stats
        self.recorder = recorder
        # When the row is next refreshed (None: never), and was last (others reclaim its jobs
        # ``workers.dead_after()`` later). Monotonic, as every time here.
        self._seen_due: float | None = None
        self._row_fresh = time.monotonic()
        # Running jobs (id -> job, start), the next cancel poll, requests seen: id -> (attempts, level).
        self._running: dict[int, tuple[Job, float]] = {}
        self._cancel_due: float | None = None
        self._cancels: dict[int, tuple[int, int]] = {}
        # Called from the thread with the job and the level of a cancel request.
        self.on_cancel: Callable[[Job, int], None] | None = None
        self._sleep_until = 0.0
        self.beats = 0
        self.lost = 0
        self._lock = threading.Lock()
        # id -> (job, when its reservation was last known fresh)
        self._held: dict[int, tuple[Job, float]] = {}
        # id -> when the next beat's interval counts from after a failed beat (the lease still
        # counts from the last beat that reached the database).
        self._beat_from: dict[int, float] = {}
        self._wake = threading.Event()
        self._due: float | None = None  # the next beat; None while nothing is held
        self._stopping = False
        self._thread: threading.Thread | None = None

    def hold(self, jobs: Iterable[Job]) -> None:
        """Cover freshly claimed ``jobs`` (one covered already keeps its entry)."""
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
            self._wake.set()  # it sleeps until a later beat, or until something is held

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
        """Say that ``job`` runs now (None: none does); after ``CANCEL_POLL`` its cancel requests are read."""
        if job is None:
            # The poll time stays: the thread wakes then and sleeps on, not woken by the next job.
            self._running.clear()
            return
        now = time.monotonic()
        with self._lock:
            self._running[job.pk] = (job, now)
            if self._cancel_due is not None and self._cancel_due > now:
                return  # a poll is due already; the job is asked at a later one
            self._cancel_due = due = now + CANCEL_POLL
        if self._thread is not None and due < self._sleep_until:
            self._wake.set()

    def stopped(self, job: Job) -> None:
        """Say that ``job`` no longer runs."""
        with self._lock:
            entry = self._running.get(job.pk)
            if entry is not None and entry[0].attempts == job.attempts:
                del self._running[job.pk]

    def cancel_level(self, job: Job) -> int:
        """The cancel request seen for this reservation of ``job`` (``Job.cancel``), 0 if none."""
        attempts, level = self._cancels.get(job.pk, (-1, 0))
        return level if attempts == job.attempts else 0

    def lease_safe(self, job: Job) -> bool:
        """Tell whether this reservation of ``job`` cannot have expired yet: it was known fresh less
        than its ``retry_after`` (less ``LEASE_MARGIN``) ago, so no other worker can have taken it."""
        with self._lock:
            entry = self._held.get(job.pk)
        if entry is None or entry[0].attempts != job.attempts:
            return False
        now = time.monotonic()
        if self.queues is not None and now >= self._row_fresh + workers.dead_after() - LEASE_MARGIN:
            # The row went unrefreshed long enough for idle workers to reclaim early.
            return False
        return now < entry[1] + job.retry_after - LEASE_MARGIN

    def register(self) -> None:
        """Write the worker's row as it starts (else the first beat that reaches the database does)."""
        try:
            workers.register(self.worker_id, self.queues or [], self._options_text(), self.stats)
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

    def start(self) -> Heartbeat:
        if self._thread is None:
            self._stopping = False
            if self.queues is not None:  # the worker wrote its row as it started
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

    def _options_text(self) -> str:
        return self.options() if callable(self.options) else self.options

    def _interval(self, job: Job) -> float:
        return self.interval if self.interval is not None else beat_interval(job.retry_after)

    def _next_beat(self) -> float | None:
        """When the thread next has work; None: never."""
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
                if due is None or due > time.monotonic():  # woken early by a hold or a stop
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
                workers.seen(self.worker_id, self.queues, self._options_text(), self.stats)
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
        """Make the next beat come ``ERROR_RETRY`` seconds from now, or sooner if due."""
        now = time.monotonic()
        with self._lock:
            for job in jobs:
                entry = self._held.get(job.pk)
                if entry is not None and entry[0].attempts == job.attempts:
                    interval = self._interval(job)
                    self._beat_from[job.pk] = now - interval + min(ERROR_RETRY, interval)
