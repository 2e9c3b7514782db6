"""A running job's heartbeat: its worker extends the reservation while it lives.

Without it, ``retry_after`` would have to outlast the longest run, or a live
worker's job would be reclaimed and run a second time in parallel. With it,
``retry_after`` is how long a worker may stay silent before its jobs are
presumed dead: the heartbeat dies with its process, and the reservation then
expires as before.
"""

from __future__ import annotations

import logging
import threading
from types import TracebackType

from django.db import DatabaseError

from .db import drop_connection
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


def beat_interval(retry_after: float) -> float:
    """Seconds between two extensions of a reservation that expires after ``retry_after``."""
    return max(retry_after / BEATS_PER_RETRY_AFTER, MIN_INTERVAL)


class Heartbeat:
    """Extend ``job``'s reservation for ``worker_id`` from a thread, until ``stop``.

    The thread has its own database connection (Django's are per thread), so a
    beat is never part of the job's transactions, and it closes that
    connection when it stops. Use as a context manager around the run and the
    recording of its outcome.
    """

    def __init__(self, job: Job, worker_id: str, *, interval: float | None = None) -> None:
        self.job = job
        self.worker_id = worker_id
        self.interval = interval if interval is not None else beat_interval(job.retry_after)
        self.beats = 0
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"dbqueue-heartbeat-{job.pk}", daemon=True)

    def start(self) -> Heartbeat:
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop beating; wait a little for a beat in flight, which can extend nothing after the outcome."""
        self._stopped.set()
        if self._thread.is_alive():
            self._thread.join(STOP_WAIT)

    def __enter__(self) -> Heartbeat:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, traceback: TracebackType | None
    ) -> None:
        self.stop()

    def _run(self) -> None:
        wait = self.interval
        connected = False
        try:
            while not self._stopped.wait(wait):
                connected = True
                try:
                    extended = Job.objects.extend(self.job, worker_id=self.worker_id)
                except DatabaseError as exc:
                    logger.warning(
                        "heartbeat failed job=%s id=%s worker_id=%s retry_in=%ss: %s",
                        self.job.name,
                        self.job.pk,
                        self.worker_id,
                        ERROR_RETRY,
                        exc,
                    )
                    drop_connection()
                    wait = min(self.interval, ERROR_RETRY)
                    continue
                if not extended:
                    if not self._stopped.is_set():
                        logger.warning(
                            "heartbeat stopped job=%s id=%s attempt=%s worker_id=%s: the reservation "
                            "is no longer this worker's",
                            self.job.name,
                            self.job.pk,
                            self.job.attempts,
                            self.worker_id,
                        )
                    return
                self.beats += 1
                wait = self.interval
        finally:
            if connected:
                drop_connection()
