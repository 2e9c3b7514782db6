"""The ticker: a thread in each worker that ticks the schedules (``schedules``) with its own
connection, the declared ones and the stored ones, whose version it reads every ``STORED_CHECK``
seconds (a schedule created, edited, disabled or deleted is ticked as such within them).
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable, Collection, Mapping
from typing import Any

from django.db import DatabaseError, connections
from django.db.models import F

from . import schedules, stored_schedules
from .db import DbNow, alias, drop_connection, error_text, is_lock
from .models import ScheduleState
from .schedules import Outcome, Schedule

logger = logging.getLogger("django_dbqueue")

# The longest a ticker sleeps, so a change by another process is seen within it.
MAX_SLEEP = 30.0
# Seconds between two reads of the stored schedules' version: a schedule created, changed,
# disabled or deleted (admin, queue_schedules) is ticked as such within them, on every worker.
STORED_CHECK = 5.0
# Seconds before a ticker looks again at a row another worker is ticking, and at one written for
# an edit it has not read (read first; a code schedule another deploy changed waits for that deploy).
BUSY_RETRY = 0.1
CHANGED_RETRY = 1.0
# Seconds before a ticker retries after a database error (doubled, up to the last).
ERROR_RETRY = (1.0, 2.0, 5.0)
# A lock another writer holds (SQLite's "database is locked" as workers start, a deadlock or a
# lock wait elsewhere) is retried sooner and quietly; an error once it has lasted LOCK_PERSISTS s.
LOCK_RETRY = (0.1, 0.5, 1.0, 2.0)
LOCK_PERSISTS = 30.0
STOP_WAIT = 5.0  # for a tick in flight
LOOK_AHEAD = 100


class Ticker:
    """Tick this process's schedules and the stored ones from a thread with its own connection, until
    ``stop``; a context manager. Without ``enabled`` (``queue_work --no-schedule``) it starts no thread."""

    def __init__(
        self, worker_id: str, enabled: bool = True, *, schedules: Mapping[str, Schedule] | None = None
    ) -> None:
        self.worker_id = worker_id
        self.enabled = enabled
        # The declared schedules to tick (None: all of this code's).
        self.declared = dict(schedules) if schedules is not None else None
        self.statements = 0  # sent by this ticker's thread
        self.ticked = 0
        self._started = 0.0
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None
        # Since when the ticker meets a lock, when it last said so, and when at info (``_locked``).
        self._locked_since: float | None = None
        self._lock_reported = 0.0
        self._lock_said = -math.inf
        # The stored schedules' version last read, and when to read it again (``_stored``).
        self._version: tuple[int, int] | None = None
        self._next_check = 0.0

    def start(self) -> Ticker:
        if not self.enabled or self._thread is not None:
            return self
        # Started without declared schedules too: stored ones may be made at any time.
        declared = schedules.usable(self.declared if self.declared is not None else schedules.all_schedules())
        self._started = time.monotonic()
        self._stopping.clear()
        self._thread = threading.Thread(
            target=self._run, args=(declared,), name=f"dbqueue-ticker-{self.worker_id}", daemon=True
        )
        self._thread.start()
        logger.info("ticker started worker_id=%s schedules=%s", self.worker_id, len(declared))
        return self

    def stop(self) -> None:
        self._stopping.set()
        thread, self._thread = self._thread, None
        if thread is None:
            return
        if thread.is_alive():
            thread.join(STOP_WAIT)
        logger.info(
            "ticker stopped worker_id=%s ticked=%s statements=%s per_minute=%.1f",
            self.worker_id, self.ticked, self.statements, self.queries_per_minute(),
        )  # fmt: skip

    def queries_per_minute(self) -> float:
        minutes = (time.monotonic() - self._started) / 60 if self._started else 0
        return self.statements / minutes if minutes > 0 else 0.0

    def __enter__(self) -> Ticker:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def _count(self, execute: Callable[..., Any], sql: str, params: Any, many: bool, context: Any) -> Any:
        self.statements += 1
        return execute(sql, params, many, context)

    def _run(self, declared: dict[str, Schedule]) -> None:
        connection = connections[alias()]
        errors = 0
        synced = False
        ticking, next_look = dict(declared), 0.0
        try:
            with connection.execute_wrapper(self._count):
                while not self._stopping.is_set():
                    try:
                        if not synced:
                            schedules.sync(declared)
                            synced = True
                        if time.monotonic() >= self._next_check:
                            stored = self._stored(declared)
                            if stored is not None:
                                ticking, next_look = {**stored, **declared}, 0.0
                        if time.monotonic() >= next_look:
                            next_look = time.monotonic() + self.look(ticking)
                        errors, self._locked_since = 0, None
                        delay = min(next_look, self._next_check) - time.monotonic()
                    except DatabaseError as exc:
                        if is_lock(exc):
                            delay = self._locked(exc, errors)
                        else:
                            delay = ERROR_RETRY[min(errors, len(ERROR_RETRY) - 1)]
                            logger.warning(
                                "ticker failed worker_id=%s retry_in=%ss: %s", self.worker_id, delay, error_text(exc)
                            )
                        errors += 1
                        drop_connection()
                    except Exception:
                        # A bug or a job that cannot be enqueued must not end the ticking of the others.
                        delay = ERROR_RETRY[-1]
                        logger.exception("ticker failed worker_id=%s retry_in=%ss", self.worker_id, delay)
                    if delay > 0:
                        self._stopping.wait(delay)
        finally:
            drop_connection()

    def _stored(self, declared: Collection[str]) -> dict[str, Schedule] | None:
        """The stored schedules, read again and written to their rows if their version changed since
        the last read; else None. The version is read again ``STORED_CHECK`` seconds later."""
        seen = stored_schedules.version()
        if seen == self._version:
            self._next_check = time.monotonic() + STORED_CHECK
            return None
        stored = schedules.read_stored(declared)
        schedules.sync(stored)
        if stored or self._version is not None:  # not for a first read that found none
            logger.info("stored schedules read worker_id=%s schedules=%s", self.worker_id, len(stored))
        self._version, self._next_check = seen, time.monotonic() + STORED_CHECK
        return stored

    def _locked(self, exc: DatabaseError, errors: int) -> float:
        """Log a lock met while ticking: info at most once per ``LOCK_PERSISTS`` seconds (workers
        that start together meet one another's), debug while it lasts, an error each
        ``LOCK_PERSISTS`` seconds one persists; return the seconds before the next try."""
        delay = LOCK_RETRY[min(errors, len(LOCK_RETRY) - 1)]
        now = time.monotonic()
        if self._locked_since is None:
            self._locked_since = self._lock_reported = now
            if now - self._lock_said >= LOCK_PERSISTS:
                self._lock_said = now
                logger.info(
                    "ticker waits for a lock worker_id=%s retry_in=%ss: %s", self.worker_id, delay, error_text(exc)
                )
                return delay
        elif now - self._lock_reported >= LOCK_PERSISTS:
            self._lock_reported = now
            logger.error(
                "ticker locked out for %.0fs worker_id=%s retry_in=%ss: %s (another process holds a long "
                "write transaction; on SQLite see dbqueue.W011)",
                now - self._locked_since, self.worker_id, delay, error_text(exc),
            )  # fmt: skip
            return delay
        logger.debug("ticker waits for a lock worker_id=%s retry_in=%ss", self.worker_id, delay)
        return delay

    def look(self, ticking: Mapping[str, Schedule]) -> float:
        """Tick what is due of ``ticking``; return the seconds until the next look."""
        rows = list(
            ScheduleState.objects.filter(name__in=list(ticking), enabled=True)
            .annotate(db_now=DbNow())
            .order_by(F("next_tick").asc(nulls_first=True), "pk")
            .values_list("pk", "name", "next_tick", "db_now")[:LOOK_AHEAD]
        )
        read = time.monotonic()
        due = [(pk, next_tick) for pk, _, next_tick, now in rows if next_tick is None or next_tick <= now]
        if due:
            outcomes = schedules.tick_many(ticking, due)
            self.ticked += outcomes.count(Outcome.ENQUEUED)
            if Outcome.CHANGED in outcomes:
                self._next_check = 0.0  # a stored schedule was edited: read it before the next look
            # Another worker is ticking a due row: look again soon. Else at once (new next ticks).
            if Outcome.TAKEN in outcomes:
                return BUSY_RETRY
            return CHANGED_RETRY if Outcome.CHANGED in outcomes else 0
        if not rows:
            return MAX_SLEEP
        _, _, next_tick, now = rows[0]
        delay: float = (next_tick - now).total_seconds() - (time.monotonic() - read)
        return max(0.0, min(delay, MAX_SLEEP))
