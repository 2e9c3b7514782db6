"""Bar charts as inline SVG, drawn on the server: no JavaScript, nothing fetched. Colours are CSS
classes (``dbq-<name>``) styled with the admin's variables, so a chart reads in its light and dark themes."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from django.utils.html import escape
from django.utils.safestring import SafeString, mark_safe

# Room around the plot, in the SVG's own units: the y labels on the left, the x labels below.
LEFT, RIGHT, TOP, BOTTOM = 40, 8, 10, 20


@dataclass(frozen=True)
class Series:
    """One stacked layer of a bar chart: a value per bar, drawn with the class ``dbq-<css>``."""

    label: str
    css: str
    values: Sequence[float]


def nice_ceiling(value: float) -> int:
    """The smallest of 1, 2, 3, 4, 5, 6, 8, 10, 20, 30 ... at or above ``value`` (1 for 0)."""
    if value <= 1:
        return 1
    power = 10 ** math.floor(math.log10(value))
    return int(next(step * power for step in (1, 2, 3, 4, 5, 6, 8, 10) if step * power >= value))


def _number(value: float) -> str:
    return f"{value:.1f}".rstrip("0").rstrip(".")


def _totals(series: Sequence[Series], count: int) -> list[float]:
    return [sum(layer.values[index] for layer in series) for index in range(count)]


def _opening(css: str, width: int, height: int, title: str, series: Sequence[Series]) -> list[str]:
    """The ``<svg>`` tag and its title: the chart's title and each layer's sum, for tooltips and screen readers."""
    label = escape(f"{title}: " + ", ".join(f"{sum(layer.values):g} {layer.label}" for layer in series))
    return [
        f'<svg class="{css}" viewBox="0 0 {width} {height}" width="{width}" height="{height}" '
        f'role="img" aria-label="{label}" xmlns="http://www.w3.org/2000/svg">',
        f"<title>{label}</title>",
    ]


def _stack(
    series: Sequence[Series], index: int, x: float, width: float, bottom: float, scale: float, least: float = 0.0
) -> list[str]:
    """Bar ``index``'s layers stacked up from ``bottom``: each ``scale`` units high per job, at least ``least``."""
    rects = []
    for layer in series:
        if (value := layer.values[index]) > 0:
            size = max(value * scale, least)
            bottom -= size
            rects.append(
                f'<rect class="dbq-{escape(layer.css)}" x="{x:.2f}" y="{bottom:.2f}" width="{width:.2f}" '
                f'height="{size:.2f}"/>'
            )
    return rects


def bar_chart(
    labels: Sequence[str],
    series: Sequence[Series],
    *,
    title: str,
    ticks: Sequence[tuple[int, str]] = (),
    width: int = 560,
    height: int = 150,
    empty: str = "No runs recorded",
) -> SafeString:
    """Draw stacked bars, one per label, with a y axis from 0 and the x labels of ``ticks``
    (bar index, text). Each bar's tooltip names its label and values."""
    count = len(labels)
    totals = _totals(series, count)
    top = nice_ceiling(max(totals, default=0))
    plot_width = width - LEFT - RIGHT
    plot_height = height - TOP - BOTTOM
    slot = plot_width / max(count, 1)
    gap = min(1.0, slot * 0.2)
    parts = _opening("dbq-chart", width, height, title, series)
    # A line half way only where it is a whole number of jobs.
    for fraction in (0.0, 0.5, 1.0) if top % 2 == 0 else (0.0, 1.0):
        y = TOP + plot_height * (1 - fraction)
        parts.append(f'<line class="dbq-grid" x1="{LEFT}" x2="{width - RIGHT}" y1="{y:.1f}" y2="{y:.1f}"/>')
        parts.append(
            f'<text class="dbq-axis" x="{LEFT - 4}" y="{y + 3.5:.1f}" text-anchor="end">'
            f"{_number(top * fraction)}</text>"
        )
    for index, label in enumerate(labels):
        x = LEFT + index * slot + gap / 2
        tip = escape(label + ": " + ", ".join(f"{layer.values[index]:g} {layer.label}" for layer in series))
        bar = [f"<g><title>{tip}</title>"]
        # An invisible full-height target, so a bar of 0 has a tooltip too.
        bar.append(f'<rect class="dbq-hit" x="{x:.2f}" y="{TOP}" width="{slot - gap:.2f}" height="{plot_height}"/>')
        bar += _stack(series, index, x, slot - gap, TOP + plot_height, plot_height / top)
        bar.append("</g>")
        parts.append("".join(bar))
    parts.append(
        f'<line class="dbq-baseline" x1="{LEFT}" x2="{width - RIGHT}" y1="{TOP + plot_height}" '
        f'y2="{TOP + plot_height}"/>'
    )
    for index, text in ticks:
        x = LEFT + (index + 0.5) * slot
        parts.append(f'<text class="dbq-axis" x="{x:.1f}" y="{height - 5}" text-anchor="middle">{escape(text)}</text>')
    if not any(totals):
        parts.append(
            f'<text class="dbq-empty" x="{LEFT + plot_width / 2:.1f}" y="{TOP + plot_height / 2:.1f}" '
            f'text-anchor="middle">{escape(empty)}</text>'
        )
    parts.append("</svg>")
    return mark_safe("".join(parts))  # every text above is escaped


def sparkline(series: Sequence[Series], *, title: str, width: int = 120, height: int = 22) -> SafeString:
    """Draw small stacked bars without axes, scaled to their own highest bar."""
    count = len(series[0].values) if series else 0
    top = max(_totals(series, count), default=0) or 1
    slot = width / max(count, 1)
    parts = _opening("dbq-spark", width, height, title, series)
    parts.append(f'<line class="dbq-baseline" x1="0" x2="{width}" y1="{height - 0.5}" y2="{height - 0.5}"/>')
    for index in range(count):
        # At least a pixel, so a single failure among thousands still shows.
        parts += _stack(series, index, index * slot, max(slot - 0.4, 0.4), height, height / top, least=1.0)
    parts.append("</svg>")
    return mark_safe("".join(parts))  # every text above is escaped
