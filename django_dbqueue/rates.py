"""Rate limits: at most N job starts per period, per job (or per key) and per queue.

A limit is a token bucket in a ``FlowLimit`` row (``tokens``, ``updated_at`` by the database's
clock), locked and refilled by the claims that spend it: over any T seconds the starts are at
most ``burst + N * T / period``. A job held back by its own limit is moved to when its bucket
has a token (no try spent); a queue's limit (``DBQUEUE["RATE_LIMITS"]``) caps its claims.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Callable, Sequence
from datetime import datetime, timedelta
from functools import cache
from typing import TYPE_CHECKING, Any

from . import conf, validation
from .validation import Definition

if TYPE_CHECKING:
    from .models import FlowLimit, Job

JOB_PREFIX = "rate:"
QUEUE_PREFIX = "queue-rate:"

_UNITS = {
    **dict.fromkeys(("s", "sec", "second"), 1),
    **dict.fromkeys(("m", "min", "minute"), 60),
    **dict.fromkeys(("h", "hour"), 3600),
    **dict.fromkeys(("d", "day"), 86400),
}
_SPEC = re.compile(r"^\s*(\d+)\s*/\s*(\d*(?:\.\d+)?)\s*([a-z]+?)s?\s*$")


@dataclasses.dataclass(frozen=True)
class Rate:
    """``count`` starts per ``seconds``, at most ``burst`` at once."""

    count: int
    seconds: float
    burst: int

    @property
    def per_second(self) -> float:
        return self.count / self.seconds

    @property
    def text(self) -> str:  # as stored in Job.rate_limit
        return f"{self.count}/{self.seconds:g}/{self.burst}"

    @classmethod
    def from_text(cls, text: str) -> Rate:
        """The rate stored as ``text``; raise ValueError if it cannot be read (a row written by hand)."""
        return cls(*validation.rate_parts(text))


def parse(spec: Any, burst: Any = None) -> Rate:
    """A rate from ``"N/unit"`` (``"100/m"``, ``"20/s"``, ``"10/5s"``, ``"3/day"``); ValueError says what is wrong."""
    if not isinstance(spec, str) or not (match := _SPEC.match(spec.lower())):
        raise ValueError(
            f"a rate limit is written 'N/unit' with unit s, m, h or d (such as '100/m', '20/s', '10/5s'), not {spec!r}"
        )
    count, multiple, unit = int(match[1]), match[2], match[3]
    if unit not in _UNITS:
        raise ValueError(f"unknown unit {unit!r} in rate limit {spec!r}: use s, m, h or d")
    seconds = (float(multiple) if multiple else 1.0) * _UNITS[unit]
    if count < 1 or seconds <= 0:
        raise ValueError(f"a rate limit needs at least one start per period, not {spec!r}")
    if burst is None:
        burst = max(1, count // 10)
    if isinstance(burst, bool) or not isinstance(burst, int) or burst < 1:
        raise ValueError(f"a rate limit's burst must be a whole number of at least 1, not {burst!r}")
    return Rate(count, seconds, burst)


def options_error(definition: Definition) -> str | None:
    """Why the rate options of ``definition`` are wrong, or None."""
    if definition.rate_limit is None:
        if definition.rate_key is not None or definition.rate_burst is not None:
            return "rate_key and rate_burst need a rate_limit"
        return None
    try:
        parse(definition.rate_limit, definition.rate_burst)
    except ValueError as exc:
        return str(exc)
    key = definition.rate_key
    if key is not None and not (callable(key) or (isinstance(key, str) and key)):
        return f"rate_key must be a non-empty str or a callable of the job's arguments, not {key!r}"
    return None


def step_values(definition: Definition, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
    """The rate columns of one call (none if the job has no rate limit)."""
    if definition.rate_limit is None:
        return {}
    key: str | Callable[..., Any] = definition.rate_key or definition.name
    return {
        "rate_key": validation.flow_key(definition.name, "rate_key", key, args, kwargs),
        "rate_limit": parse(definition.rate_limit, definition.rate_burst).text,
    }


def queue_rate(queue: str) -> Rate | None:
    """The limit ``DBQUEUE["RATE_LIMITS"]`` sets on ``queue``, or None."""
    return _queue_rates(_settings_key()).get(queue)


def _settings_key() -> Any:
    limits = conf.get("RATE_LIMITS") or {}
    return tuple(sorted((queue, repr(value)) for queue, value in limits.items()))


@cache
def _queue_rates(_key: Any) -> dict[str, Rate]:
    return {queue: queue_setting(value) for queue, value in (conf.get("RATE_LIMITS") or {}).items()}


def queue_setting(value: Any) -> Rate:
    """A queue's rate from its ``RATE_LIMITS`` value: ``"100/m"`` or ``{"rate": "100/m", "burst": 10}``."""
    if isinstance(value, dict):
        unknown = set(value) - {"rate", "burst"}
        if unknown or "rate" not in value:
            raise ValueError(f"a queue's rate limit is 'N/unit' or {{'rate': 'N/unit', 'burst': n}}, not {value!r}")
        return parse(value["rate"], value.get("burst"))
    return parse(value)


def bucket_key(rate_key: str) -> str:
    """The key of a job rate key's FlowLimit row."""
    return validation.shorten_key(JOB_PREFIX + rate_key)


def queue_bucket(queue: str) -> str:
    return validation.shorten_key(QUEUE_PREFIX + queue)


class Bucket:
    """One bucket's row, locked for the claim's transaction, with its tokens refilled."""

    def __init__(self, row: FlowLimit, rate: Rate) -> None:
        self.row = row
        self.rate = rate
        # A claim that waited for the lock may read an earlier clock than the one stored:
        # the bucket's time never goes back, or the wait would be earned twice.
        now: datetime = row.db_now if row.updated_at is None else max(row.db_now, row.updated_at)
        if row.updated_at is None:
            row.tokens = float(rate.burst)
        else:
            earned = (now - row.updated_at).total_seconds() * rate.per_second
            row.tokens = min(float(rate.burst), row.tokens + earned)
        row.updated_at = now
        self.now = now
        self.held = False

    @property
    def available(self) -> int:
        return int(self.row.tokens + 1e-9)

    def spend(self, count: int) -> None:
        self.row.tokens -= count
        self.save()

    def save(self) -> None:
        self.row.save(update_fields=["tokens", "updated_at", "held_until"])

    def wait(self) -> float:
        """Seconds until the bucket has a whole token again."""
        return max(0.0, (1 - self.row.tokens) / self.rate.per_second)

    def hold(self) -> datetime:
        """When the next job held back by this bucket may start: after those held back before it, at its rate."""
        self.held = True
        first = self.now + timedelta(seconds=self.wait())
        held_until = self.row.held_until
        at = first if held_until is None or held_until < first else held_until
        self.row.held_until = at + timedelta(seconds=1 / self.rate.per_second)
        return at


class Buckets:
    """The buckets of a claim's candidate rows (their ``rate_key``), each locked once by ``claims.flow``."""

    def __init__(self) -> None:
        self.buckets: dict[str, Bucket] = {}

    def needed(self, rows: Sequence[Job]) -> dict[str, str]:
        """``{rate_key: rate_limit}`` of the buckets of ``rows`` not locked yet."""
        return {
            row.rate_key: row.rate_limit
            for row in rows
            if row.rate_key and row.rate_limit and row.rate_key not in self.buckets
        }

    def add(self, key: str, row: FlowLimit, text: str) -> None:
        self.buckets[key] = Bucket(row, Rate.from_text(text))

    def take(self, row: Job) -> bool:
        bucket = self.buckets.get(row.rate_key or "")
        if bucket is None:
            return True
        if bucket.available < 1:
            return False
        bucket.row.tokens -= 1
        return True

    def save(self) -> None:
        for bucket in self.buckets.values():
            bucket.save()

    def wait(self) -> float | None:
        """Seconds until the first bucket that held a job back has a token; None if none did."""
        waits = [bucket.wait() for bucket in self.buckets.values() if bucket.held]
        return min(waits) if waits else None

    def hold_times(self, rows: Sequence[Job]) -> dict[int, datetime]:
        """When each of ``rows``, held back by its bucket, may start."""
        return {row.pk: self.buckets[row.rate_key or ""].hold() for row in rows}


def spent_ceiling(rate: Rate, seconds: float) -> int:
    """The most starts a bucket allows over ``seconds`` (for the docs and the tests)."""
    return rate.burst + math.floor(rate.per_second * seconds)
