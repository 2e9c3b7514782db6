"""Terminal output of the queue_* commands: tables that fit 80 columns, short ages and a progress line."""

from __future__ import annotations

import time
from collections.abc import Collection, Sequence
from typing import Any

from django.core.management.base import OutputWrapper

# One column short of 80, so a terminal never wraps a full line.
WIDTH = 79
# Columns between two cells.
GAP = "  "
# A shortened cell keeps at least this many characters.
MIN_CELL = 8
ELLIPSIS = "..."


def shorten(text: str, width: int) -> str:
    """Cut ``text`` to ``width`` characters, marked with ``...``: a dotted name keeps its end (whole
    parts where it can), other text its start."""
    if len(text) <= width:
        return text
    room = width - len(ELLIPSIS)
    if room <= 0:
        return text[:width]
    if "." not in text:
        return text[:room] + ELLIPSIS
    for index, char in enumerate(text):
        if char == "." and len(text) - index - 1 <= room:
            return ELLIPSIS + text[index + 1 :]
    return ELLIPSIS + text[len(text) - room :]


def table(
    headers: Sequence[str],
    rows: Sequence[Sequence[str]],
    *,
    shrink: Collection[int] = (),
    right: Collection[int] = (),
    width: int = WIDTH,
) -> list[str]:
    """Lay out ``rows`` under ``headers`` in ``width``: the widest ``shrink`` column loses a character until
    the table fits (or each is down to ``MIN_CELL``); ``right`` columns are right-aligned."""
    natural = _widths(headers, rows)
    widths = list(natural)
    floor = {index: max(MIN_CELL, len(headers[index])) for index in shrink}
    while _total(widths) > width:
        candidates = [index for index in shrink if widths[index] > floor[index]]
        if not candidates:
            break
        widest = max(candidates, key=lambda index: widths[index])
        widths[widest] -= 1
    cells = _shortened(rows, widths)
    # A dotted name is cut at a dot and often leaves room: give it back to the cut columns.
    for _ in range(2):
        used = _widths(headers, cells)
        cut = [index for index in shrink if used[index] < natural[index]]
        slack = width - _total(used)
        if slack <= 0 or not cut:
            break
        widths = [used[index] + (slack // len(cut) if index in cut else 0) for index in range(len(used))]
        cells = _shortened(rows, widths)
    widths = _widths(headers, cells)

    def line(row: Sequence[str]) -> str:
        padded = [
            cell.rjust(widths[index]) if index in right else cell.ljust(widths[index]) for index, cell in enumerate(row)
        ]
        return GAP.join(padded).rstrip()

    return [line(headers), *(line(row) for row in cells)]


def _widths(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> list[int]:
    return [max([len(header), *(len(row[index]) for row in rows)]) for index, header in enumerate(headers)]


def _total(widths: Sequence[int]) -> int:
    return sum(widths) + len(GAP) * (len(widths) - 1)


def _shortened(rows: Sequence[Sequence[str]], widths: Sequence[int]) -> list[list[str]]:
    return [[shorten(cell, widths[index]) for index, cell in enumerate(row)] for row in rows]


def age(seconds: float | None) -> str:
    """A duration in its largest whole unit: ``3s``, ``4m``, ``2h``, ``5d``; ``-`` for None."""
    if seconds is None:
        return "-"
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{int(seconds // size)}{unit}"
    return f"{int(max(seconds, 0))}s"


def plural(count: int, word: str) -> str:
    """``1 job``, ``3 jobs``."""
    return f"{count} {word}" if count == 1 else f"{count} {word}s"


def is_terminal(stream: Any) -> bool:
    isatty = getattr(stream, "isatty", None)
    return bool(isatty and isatty())


class ProgressLine:
    """A line that rewrites itself on a terminal (``Retrying: 2,000 / 9,000 (22%)``); silent elsewhere."""

    # Seconds between two redraws: a fast run does not spend its time writing.
    EVERY = 0.1

    def __init__(self, stdout: OutputWrapper, total: int, label: str) -> None:
        self.stdout = stdout
        self.total = total
        self.label = label
        self.done = 0
        self.shown = is_terminal(stdout)
        self._drawn_at = 0.0

    def update(self, done: int) -> None:
        self.done = done
        now = time.monotonic()
        if self.shown and (now - self._drawn_at >= self.EVERY or done >= self.total):
            self._drawn_at = now
            self._draw()

    def finish(self) -> None:
        """End the line, so what follows starts on a line of its own."""
        if self.shown:
            self._draw()
            self.stdout.write("")

    def _draw(self) -> None:
        percent = 100 * self.done // self.total if self.total else 100
        self.stdout.write(f"\r{self.label}: {self.done:,} / {self.total:,} ({percent}%)", ending="")
        self.stdout.flush()
