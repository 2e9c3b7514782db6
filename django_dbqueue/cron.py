"""When a schedule ticks: cron expressions (by ``cronsim``, with Debian cron's rules for
daylight-saving time) and plain intervals, in a time zone, and what to do with the ticks that
passed while no worker ticked.
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import math
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import NamedTuple
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from cronsim import CronSim, CronSimError
from django.conf import settings

# Cron's shorthands, as the five fields they stand for.
SHORTHANDS = {
    "@yearly": "0 0 1 1 *",
    "@annually": "0 0 1 1 *",
    "@monthly": "0 0 1 * *",
    "@weekly": "0 0 * * 0",
    "@daily": "0 0 * * *",
    "@midnight": "0 0 * * *",
    "@hourly": "0 * * * *",
}
# A tick enqueued at most this many seconds late is on time; a later one was missed and the
# schedule's ``missed`` policy applies.
ON_TIME = 10.0
# Missed ticks counted one by one before the latest is found by iterating backwards.
COUNT_MISSED = 1000


class Missed(enum.StrEnum):
    """What to do with the ticks that passed while no worker ticked: one run for the latest, or none."""

    ONCE = "once"
    SKIP = "skip"


class Plan(NamedTuple):
    """What a tick does: the tick to run (None: none), the next tick, and the ticks not run."""

    run: datetime | None
    next_tick: datetime
    skipped: int


@dataclasses.dataclass(frozen=True, kw_only=True)
class Timing:
    """A cron expression (or ``every`` so many seconds) read in a time zone."""

    cron: str | None = None
    every: int | None = None
    timezone: str | None = None  # None: settings.TIME_ZONE
    missed: Missed = Missed.ONCE
    # Seconds each tick comes after the expression's time (a stored schedule's jitter, ``offset``).
    offset: int = 0

    @property
    def expression(self) -> str:
        """As declared, with the offset: a change of either moves the next tick."""
        expression = self.cron if self.cron is not None else f"every {self.every}s"
        return f"{expression} +{self.offset}s" if self.offset else expression

    @property
    def timezone_name(self) -> str:
        return self.timezone or getattr(settings, "TIME_ZONE", None) or "UTC"

    @property
    def zone(self) -> ZoneInfo:
        return ZoneInfo(self.timezone_name)

    def expression_error(self) -> str | None:
        """Why the cron expression cannot be used, or None."""
        if self.cron is None:
            return None
        try:
            next(CronSim(_fields(self.cron), datetime.now(UTC)))
        except CronSimError as exc:
            return f"{exc} in {self.cron!r}"
        except StopIteration:
            return f"{self.cron!r} never matches a date"
        return None

    def timezone_error(self) -> str | None:
        try:
            ZoneInfo(self.timezone_name)
        except (ZoneInfoNotFoundError, ValueError):
            return f"{self.timezone_name!r} is not a time zone known to zoneinfo"
        return None

    def ticks(self, after: datetime) -> Iterator[datetime]:
        """The ticks strictly after ``after``, in UTC."""
        shift = timedelta(seconds=self.offset)
        for tick in self._ticks(after - shift):
            yield tick + shift

    def _ticks(self, after: datetime) -> Iterator[datetime]:
        if self.every is not None:
            step = self.every
            seconds = math.floor(after.timestamp()) // step * step + step
            while True:
                yield datetime.fromtimestamp(seconds, UTC)
                seconds += step
        last = after.astimezone(UTC)
        for tick in CronSim(_fields(self.cron or ""), after.astimezone(self.zone)):
            # In UTC: aware times of one zone compare by wall clock (autumn's repeated hour).
            moment = tick.astimezone(UTC)
            if moment > last:
                last = moment
                yield moment

    def next_after(self, moment: datetime) -> datetime:
        return next(self.ticks(moment))

    def latest_until(self, moment: datetime) -> datetime:
        """The last tick at or before ``moment``."""
        shift = timedelta(seconds=self.offset)
        return self._latest_until(moment - shift) + shift

    def _latest_until(self, moment: datetime) -> datetime:
        if self.every is not None:
            return datetime.fromtimestamp(math.floor(moment.timestamp()) // self.every * self.every, UTC)
        start = (moment + timedelta(microseconds=1)).astimezone(self.zone)
        return next(CronSim(_fields(self.cron or ""), start, reverse=True)).astimezone(UTC)

    def plan(self, due: datetime, now: datetime) -> Plan:
        """What a tick at ``now`` does with the tick ``due`` (at or before ``now``)."""
        if (now - due).total_seconds() <= ON_TIME:
            return Plan(due, self.next_after(due), 0)
        # Missed: ``due`` and every tick after it up to now.
        missed = 0
        latest = due
        if self.every is not None:
            latest = self.latest_until(now)
            missed = round((latest - due).total_seconds()) // self.every
        for tick in self.ticks(latest):
            if tick > now:
                break
            latest, missed = tick, missed + 1
            if missed >= COUNT_MISSED:
                latest = self.latest_until(now)
                break
        missed += 1  # ``due`` itself
        run: datetime | None = latest
        if self.missed is Missed.SKIP and (now - latest).total_seconds() > ON_TIME:
            run = None
        return Plan(run, self.next_after(now), missed - (run is not None))


def _fields(cron: str) -> str:
    return SHORTHANDS.get(cron.strip().lower(), cron)


def offset(name: str, jitter: int) -> int:
    """A schedule's own offset from 0 to ``jitter`` seconds, the same at every tick and on every host
    (from the name's SHA-256), so schedules that share an expression do not all tick in one second."""
    if jitter <= 0:
        return 0
    return int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "big") % (jitter + 1)
