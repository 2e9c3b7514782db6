"""Argument types shared by the queue_* commands; each raises ArgumentTypeError with a clear message."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable
from typing import Any

from django_dbqueue.operations import parse_ids

# A century: more is a typo, and the database's date arithmetic overflows long before timedelta's.
MAX_HOURS = 100 * 365 * 24
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


def number(kind: Callable[[str], float], minimum: float, label: str) -> Callable[[str], Any]:
    """A number of ``kind`` (int or float) of at least ``minimum``; ``label`` says what it is."""

    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {label}") from None
        if not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"{text!r} is not {label}")
        if value < minimum:
            raise argparse.ArgumentTypeError(f"{text!r} must be at least {minimum:g}")
        return value

    return parse


def whole_number(minimum: int) -> Callable[[str], int]:
    return number(int, minimum, "a whole number")


def queue_list(text: str) -> list[str]:
    """Queues in priority order, comma-separated: ``high,default``."""
    queues = [queue.strip() for queue in text.split(",")]
    if not all(queues):
        raise argparse.ArgumentTypeError(f"{text!r} has an empty queue name; write --queue high,default")
    if len(set(queues)) != len(queues):
        raise argparse.ArgumentTypeError(f"{text!r} names a queue twice")
    if any(len(queue) > 100 for queue in queues):
        raise argparse.ArgumentTypeError("queue names are at most 100 characters")
    return queues


def backoff(text: str) -> float | list[float]:
    """Seconds, or one per attempt: ``10`` or ``10,60,300``."""
    try:
        values = [float(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not seconds, or a comma-separated list of seconds") from None
    if any(value < 0 for value in values):
        raise argparse.ArgumentTypeError(f"{text!r} has a negative delay")
    return values[0] if len(values) == 1 else values


def queue_name(text: str) -> str:
    name = text.strip()
    if not name:
        raise argparse.ArgumentTypeError("the queue name is empty")
    if len(name) > 100:
        raise argparse.ArgumentTypeError("queue names are at most 100 characters")
    return name


def ids(text: str) -> str:
    """An id, a range or a comma-separated list (``3``, ``5-9``, ``12,14``), checked and returned as written."""
    try:
        parse_ids([text])
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def ids_or_all(text: str) -> str:
    """Like ``ids``, or the word ``all``."""
    return ALL if text.strip().lower() == ALL else ids(text)
