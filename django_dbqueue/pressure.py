"""Back off the database: a worker slows its claims while the database is under pressure, so a
burst of jobs does not slow the web requests that share the server.

Off unless ``DBQUEUE["PRESSURE"]`` is set. Two signals, each with a threshold the user sets:
the worker's own claim time (a moving average of the claim statement's round trip, which grows
with the server's CPU, I/O and lock contention), and the sessions waiting on a lock (PostgreSQL,
MariaDB, MySQL; read at most once a second on the claim's connection). Over a threshold, the pause before
each claim doubles (from ``FIRST_PAUSE`` up to ``MAX_PAUSE``); under both, it halves, and ends
below ``LEAST_PAUSE``; so the claims settle near the rate the database serves within the threshold.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any

from django.db import DatabaseError, connections

from . import conf
from .db import alias, error_text

logger = logging.getLogger("django_dbqueue")

# What DBQUEUE["PRESSURE"] may hold, and its defaults.
DEFAULTS: dict[str, Any] = {
    # Milliseconds of a claim's round trip (moving average) above which the worker backs off.
    "CLAIM_MS": 25.0,
    # Sessions waiting on a lock at or above which the worker backs off (not on SQLite); None: not read.
    "LOCK_WAITS": None,
    # The longest pause, in seconds, before one claim.
    "MAX_PAUSE": 2.0,
}
# Weight of the newest claim in the moving average: about the last ten claims count.
SMOOTHING = 0.2
# Seconds: the first pause, and the pause below which backing off ends.
FIRST_PAUSE = 0.01
LEAST_PAUSE = 0.005
# Seconds between two reads of the lock waits (InnoDB's lock tables are a cache that reads closer
# than 0.1 s apart leave stale).
LOCK_CHECK = 1.0

# Sessions waiting on a row or table lock, per server.
_LOCK_WAITS_SQL = {
    "postgresql": "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
    "AND wait_event_type = 'Lock'",
    "mariadb": "SELECT count(*) FROM information_schema.INNODB_LOCK_WAITS",
    "mysql": "SELECT count(*) FROM performance_schema.data_lock_waits",
}


def valid(value: Any) -> bool:
    """Tell whether ``value`` is a valid ``DBQUEUE["PRESSURE"]``: None, or a dict of ``DEFAULTS``' keys."""
    if value is None:
        return True
    if not isinstance(value, dict) or not set(value) <= set(DEFAULTS):
        return False
    claim_ms, lock_waits, max_pause = (value.get(key, DEFAULTS[key]) for key in DEFAULTS)
    numbers = (claim_ms, max_pause) if lock_waits is None else (claim_ms, max_pause, lock_waits)
    if any(isinstance(number, bool) or not isinstance(number, (int, float)) for number in numbers):
        return False
    return claim_ms > 0 and max_pause > 0 and (lock_waits is None or (isinstance(lock_waits, int) and lock_waits >= 1))


@dataclasses.dataclass(frozen=True)
class Limits:
    claim_ms: float
    lock_waits: int | None
    max_pause: float


class Pressure:
    """One worker's back-off: fed each claim's duration, it says how long to pause before the next."""

    def __init__(self, limits: Limits, worker_id: str) -> None:
        self.limits = limits
        self.worker_id = worker_id
        self.pause = 0.0  # seconds to wait before the next claim
        self.claim_ms: float | None = None  # the moving average
        self.lock_waits = 0
        self._locks_read = 0.0

    @classmethod
    def configured(cls, worker_id: str) -> Pressure | None:
        """The back-off the settings ask for; None when ``PRESSURE`` is not set."""
        value = conf.get("PRESSURE")
        if value is None:
            return None
        merged = {**DEFAULTS, **value}
        limits = Limits(float(merged["CLAIM_MS"]), merged["LOCK_WAITS"], float(merged["MAX_PAUSE"]))
        return cls(limits, worker_id)

    def claimed(self, seconds: float) -> None:
        """Take in one claim's round trip and set the next pause."""
        milliseconds = seconds * 1000
        average = milliseconds if self.claim_ms is None else self.claim_ms + SMOOTHING * (milliseconds - self.claim_ms)
        self.claim_ms = average
        if self.limits.lock_waits is not None and time.monotonic() - self._locks_read >= LOCK_CHECK:
            self._locks_read = time.monotonic()
            self.lock_waits = _read_lock_waits()
        over = average > self.limits.claim_ms or (
            self.limits.lock_waits is not None and self.lock_waits >= self.limits.lock_waits
        )
        before = self.pause
        if over:
            self.pause = min(self.limits.max_pause, max(FIRST_PAUSE, before * 2))
        else:
            self.pause = before / 2 if before / 2 >= LEAST_PAUSE else 0.0
        if self.pause and not before:
            logger.warning(
                "backing off the database worker_id=%s claim_ms=%.1f lock_waits=%s",
                self.worker_id,
                average,
                self.lock_waits,
            )
        elif before and not self.pause:
            logger.info("backing off ended worker_id=%s claim_ms=%.1f", self.worker_id, average)

    def text(self) -> str:
        """The back-off as operators read it in the worker's row: "" when none."""
        return f"backing-off={self.pause * 1000:.0f}ms" if self.pause else ""


def _read_lock_waits() -> int:
    """Sessions waiting on a lock (PostgreSQL: of the queue's database; MariaDB, MySQL: of the
    server); 0 on SQLite, whose writers wait in turn, or on an error."""
    connection = connections[alias()]
    server = "mariadb" if getattr(connection, "mysql_is_mariadb", False) else connection.vendor
    if server not in _LOCK_WAITS_SQL:
        return 0
    try:
        with connection.cursor() as cursor:
            cursor.execute(_LOCK_WAITS_SQL[server])
            row = cursor.fetchone()
    except DatabaseError as exc:
        logger.warning("could not read the lock waits: %s", error_text(exc))
        return 0
    return int(row[0]) if row else 0
