"""Argument types shared by the queue_* commands; each raises ArgumentTypeError with a clear message."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable
from typing import Any

from django_dbqueue import validation
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


def number(
    kind: Callable[[str], float], minimum: float, label: str, maximum: float | None = None
) -> Callable[[str], Any]:
    """A number of ``kind`` (int or float) from ``minimum`` to ``maximum``; ``label`` says what it is."""

    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {label}") from None
        if not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"{text!r} is not {label}")
        if value < minimum:
            raise argparse.ArgumentTypeError(f"{text!r} must be at least {minimum:g}")
        if maximum is not None and value > maximum:
            raise argparse.ArgumentTypeError(f"{text!r} must be at most {_plain(maximum)}")
        return value

    return parse


def _plain(value: float) -> str:
    """``2147483647`` rather than ``2.14748e+09``; ``0.5`` as it is."""
    return str(int(value)) if float(value).is_integer() else f"{value:g}"


def whole_number(minimum: int, maximum: int | None = None) -> Callable[[str], int]:
    return number(int, minimum, "a whole number", maximum)


def seconds(minimum: float = 0, *, whole: bool = False) -> Callable[[str], Any]:
    """Seconds from ``minimum`` to ``validation.MAX_SECONDS`` (about 68 years), the columns' bound."""
    if whole:
        return number(int, minimum, "whole seconds", validation.MAX_SECONDS)
    return number(float, minimum, "seconds", validation.MAX_SECONDS)


def tries(text: str) -> int:
    """Tries, from 1 to ``validation.MAX_TRIES``, the column's bound."""
    value: int = number(int, 1, "a whole number", validation.MAX_TRIES)(text)
    return value


def queue_list(text: str) -> list[str]:
    """Queues in priority order, comma-separated: ``high,default``."""
    queues = [queue.strip() for queue in text.split(",")]
    if not all(queues):
        raise argparse.ArgumentTypeError(f"{text!r} has an empty queue name; write --queue high,default")
    if len(set(queues)) != len(queues):
        raise argparse.ArgumentTypeError(f"{text!r} names a queue twice")
    for queue in queues:
        error = validation.queue_name_error(queue)
        if error is not None:
            raise argparse.ArgumentTypeError(error)
    return queues


def backoff(text: str) -> float | list[float]:
    """Seconds, or one per attempt: ``10`` or ``10,60,300``."""
    try:
        values = [float(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not seconds, or a comma-separated list of seconds") from None
    if not all(math.isfinite(value) for value in values):
        raise argparse.ArgumentTypeError(f"{text!r} is not seconds, or a comma-separated list of seconds")
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
    """Like ``ids``, or the word ``all``."""
    return ALL if text.strip().lower() == ALL else ids(text)


# The largest id a BigAutoField holds: a bigger one is a typo, refused before the database sees it.
MAX_ID = 2**63 - 1


def add_batch_ids(parser: Any) -> None:
    """The positional batch ids of ``queue_retry_batch`` and ``queue_cancel_batch``."""
    parser.add_argument(
        "ids", nargs="+", type=whole_number(1, MAX_ID), metavar="ID", help="Batch ids (see queue_batches)."
    )


def id_words(ids: list[int]) -> str:
    """``id 3`` or ``ids 3, 5-9``."""
    from django_dbqueue.operations import format_ids

    return f"id {ids[0]}" if len(ids) == 1 else f"ids {format_ids(ids)}"
