"""Argument types of the queue_* commands (and the health view's query): each refuses a bad value
with an ArgumentTypeError that says why."""

from __future__ import annotations

import argparse
import datetime as dt
import math
from collections.abc import Callable
from typing import Any

from django.utils import dateparse, timezone

from django_dbqueue import validation
from django_dbqueue.operations import parse_ids

# A century: more is a typo, and the database's date arithmetic overflows long before timedelta's.
MAX_HOURS = 100 * 365 * 24
MAX_ID = validation.MAX_ID
ALL = "all"


def hours(text: str) -> float:
    """Hours, more than 0: ``24``, ``0.5``."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of hours") from None
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"{text!r} must be more than 0 hours")
    if value > MAX_HOURS:
        raise argparse.ArgumentTypeError(f"{text!r} is more than {MAX_HOURS} hours (a century)")
    return value


def number(
    kind: Callable[[str], float], minimum: float, label: str, maximum: int | None = None
) -> Callable[[str], Any]:
    """A finite number of ``kind`` (int or float) from ``minimum`` to ``maximum``; ``label`` names it."""

    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            value = math.nan
        if not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"{text!r} is not {label}")
        if value < minimum:
            raise argparse.ArgumentTypeError(f"{text!r} must be at least {minimum:g}")
        if maximum is not None and value > maximum:
            raise argparse.ArgumentTypeError(f"{text!r} must be at most {maximum}")
        return value

    return parse


def whole_number(minimum: int, maximum: int | None = None) -> Callable[[str], int]:
    return number(int, minimum, "a whole number", maximum)


def seconds(minimum: float = 0, *, whole: bool = False) -> Callable[[str], Any]:
    """Seconds from ``minimum`` to ``validation.MAX_SECONDS`` (about 68 years), the columns' bound."""
    return number(int if whole else float, minimum, "whole seconds" if whole else "seconds", validation.MAX_SECONDS)


tries = whole_number(1, validation.MAX_TRIES)


def whole_number_range(minimum: int, maximum: int) -> Callable[[str], tuple[int, int]]:
    """Two whole numbers from ``minimum`` to ``maximum``, comma-separated, in either order: ``2,16``
    and ``16,2`` are the same range, returned as ``(2, 16)``."""

    def parse(text: str) -> tuple[int, int]:
        try:
            values = [int(part) for part in text.split(",")]
        except ValueError:
            values = []
        if len(values) != 2:
            raise argparse.ArgumentTypeError(f"{text!r} is not two whole numbers MIN,MAX such as 2,16")
        low, high = sorted(values)
        if low < minimum:
            raise argparse.ArgumentTypeError(f"{text!r}: each number must be at least {minimum}")
        if high > maximum:
            raise argparse.ArgumentTypeError(f"{text!r}: each number must be at most {maximum}")
        return low, high

    return parse


def queue_list(text: str) -> list[str]:
    """Queues in priority order, comma-separated: ``high,default``."""
    queues = [queue.strip() for queue in text.split(",")]
    if not all(queues):
        raise argparse.ArgumentTypeError(f"{text!r} has an empty queue name; write --queue high,default")
    if len(set(queues)) != len(queues):
        raise argparse.ArgumentTypeError(f"{text!r} names a queue twice")
    return [queue_name(queue) for queue in queues]


def backoff(text: str) -> float | list[float] | str:
    """Seconds, or one per attempt: ``10`` or ``10,60,300``; or ``exponential``."""
    if text.strip() == "exponential":
        return "exponential"
    try:
        values = [float(part) for part in text.split(",")]
    except ValueError:
        values = [math.nan]
    if not all(math.isfinite(value) for value in values):
        raise argparse.ArgumentTypeError(
            f"{text!r} is not seconds, or a comma-separated list of seconds, or 'exponential'"
        )
    if any(value < 0 for value in values):
        raise argparse.ArgumentTypeError(f"{text!r} has a negative delay")
    if any(value > validation.MAX_SECONDS for value in values):
        raise argparse.ArgumentTypeError(f"{text!r} has a delay over {validation.MAX_SECONDS} seconds")
    return values[0] if len(values) == 1 else values


def queue_name(text: str) -> str:
    """A valid queue name: letters, digits and ``_ . : -``, at most 100 characters."""
    name = text.strip()
    error = validation.queue_name_error(name)
    if error is not None:
        raise argparse.ArgumentTypeError(error)
    return name


def ids(text: str) -> str:
    """An id, a range or a comma-separated list (``3``, ``5-9``, ``12,14``), checked and returned as written."""
    try:
        parse_ids([text])
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def ids_or_all(text: str) -> str:
    return ALL if text.strip().lower() == ALL else ids(text)


def moment(text: str) -> dt.datetime:
    """A date or a date and time, ISO 8601: ``2026-12-01``, ``2026-12-01T14:30``, ``2026-12-01 14:30+01:00``;
    without an offset, in the current time zone (``TIME_ZONE``); a date alone is its midnight."""
    value = text.strip()
    try:
        parsed = dateparse.parse_datetime(value)
        day = dateparse.parse_date(value) if parsed is None else None
    except ValueError:  # well formed, but no such day or time (2026-02-30)
        raise argparse.ArgumentTypeError(f"{text!r} is no such date or time") from None
    if parsed is None and day is None:
        raise argparse.ArgumentTypeError(f"{text!r} is not a date or time like 2026-12-01 or 2026-12-01T14:30")
    moment = parsed if parsed is not None else dt.datetime.combine(day, dt.time())  # type: ignore[arg-type]
    return moment if timezone.is_aware(moment) else timezone.make_aware(moment)


def text(label: str) -> Callable[[str], str]:
    """Text that is not blank; ``label`` names it in the refusal."""

    def parse(value: str) -> str:
        if not value.strip():
            raise argparse.ArgumentTypeError(f"{label} is empty")
        return value

    return parse
