"""Argument types shared by the queue_* commands; each raises ArgumentTypeError with a clear message."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable

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


def whole_number(minimum: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"{text!r} must be at least {minimum}")
        return value
    return parse


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
