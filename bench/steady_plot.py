"""Draw the PNG of a steady soak (bench/steady.py) from its CSV.

    .venv/bin/python bench/steady_plot.py bench/results/steady-<UTC>.csv [PNG]

Needs matplotlib (``.venv/bin/pip install matplotlib``): a benchmark-only dependency, not one of
the package's. Panels, against minutes into the steady phase: the claim probe's p50/p99 and the
server's execution time of one claim; enqueue -> start p50/p99; live and dead tuples of
dbqueue_job, with a mark where a vacuum of it ended; sizes of dbqueue_job, of each of its
indexes, of dbqueue_failed_job and the result store; jobs enqueued and processed per second and
the waiting depth. Grey spans: an idle transaction was open.
"""

from __future__ import annotations

import csv
import itertools
import sys
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

IDLE_COLOUR = "#d9d9d9"


def read(csv_path: Path) -> list[dict[str, Any]]:
    def value(text: str) -> Any:
        try:
            return float(text)
        except ValueError:
            return None if text == "" else text

    with open(csv_path, newline="") as rows:
        return [{key: value(text) for key, text in row.items()} for row in csv.DictReader(rows)]


def spans_of(rows: list[dict[str, Any]]) -> list[tuple[float, float]]:
    """The idle transactions the rows saw, from when each opened to when it was to end."""
    last = rows[-1]["t_s"]
    spans = {(row["idle_since_s"], min(row["idle_until_s"], last)) for row in rows if row["idle_since_s"] is not None}
    return sorted(spans)


def series(rows: list[dict[str, Any]], key: str) -> tuple[list[float], list[float]]:
    points = [(row["t_s"] / 60, row[key]) for row in rows if isinstance(row.get(key), float)]
    return [t for t, _ in points], [v for _, v in points]


def line(ax: Any, rows: list[dict[str, Any]], key: str, label: str, **style: Any) -> None:
    ax.plot(*series(rows, key), label=label, linewidth=1.2, **style)


def plot(csv_path: Path, png_path: Path, title: str = "", spans: list[tuple[float, float]] | None = None) -> None:
    """Draw ``csv_path`` to ``png_path``; ``spans``: idle transactions (seconds), else from the CSV."""
    rows = read(csv_path)
    if not rows:
        raise ValueError(f"{csv_path} has no samples")
    last = rows[-1]["t_s"]
    spans = [(begin, min(end, last)) for begin, end in (spans_of(rows) if spans is None else spans) if begin < last]
    fig, axes = plt.subplots(5, 1, figsize=(12, 17), sharex=True, layout="constrained")
    claim, start, tuples, sizes, rates = axes

    line(claim, rows, "claim_p99_ms", "probe p99", color="tab:red")
    line(claim, rows, "claim_p50_ms", "probe p50", color="tab:blue")
    claim.plot(
        *series(rows, "claim_server_ms"), ".", markersize=5, color="tab:gray", label="server execution (1/sample)"
    )
    claim.set_ylabel("claim (ms, log)")
    claim.set_yscale("log")
    claim.set_title("Claim statement, probed in a rolled-back transaction", fontsize=10, loc="left")

    line(start, rows, "start_p99_ms", "p99", color="tab:red")
    line(start, rows, "start_p50_ms", "p50", color="tab:blue")
    start.set_ylabel("enqueue -> start (ms, log)")
    start.set_yscale("log")
    start.set_title("Enqueue to start of the latency jobs", fontsize=10, loc="left")

    line(tuples, rows, "job_dead", "dead", color="tab:red")
    line(tuples, rows, "job_live", "live", color="tab:green")
    vacuumed = [
        b["t_s"] / 60
        for a, b in itertools.pairwise(rows)
        if (b["job_vacuums"] or 0) + (b["job_autovacuums"] or 0) > (a["job_vacuums"] or 0) + (a["job_autovacuums"] or 0)
    ]
    for n, t in enumerate(vacuumed):
        label = "vacuum ran (seen at this sample)" if n == 0 else None
        tuples.axvline(t, color="tab:purple", linestyle="--", linewidth=1.2, label=label)
    tuples.set_ylabel("tuples")
    tuples.set_title("dbqueue_job (pg_stat_user_tables)", fontsize=10, loc="left")

    line(sizes, rows, "job_table_mb", "dbqueue_job (heap)", color="black")
    for key in (key for key in rows[0] if key.startswith("index_mb:")):
        line(sizes, rows, key, key.split(":", 1)[1])
    line(sizes, rows, "failed_total_mb", "dbqueue_failed_job (total)", linestyle="--")
    if any(row["results_total_mb"] for row in rows):
        line(sizes, rows, "results_total_mb", "dbqueue_task_result (total)", linestyle="--")
    sizes.set_ylabel("MB")
    sizes.set_title(
        "Sizes (pg_relation_size; failed jobs and result store: pg_total_relation_size)", fontsize=10, loc="left"
    )

    line(rates, rows, "enqueue_per_s", "enqueued", color="tab:blue")
    line(rates, rows, "processed_per_s", "processed", color="tab:green", linestyle="--")
    rates.set_ylabel("jobs/s")
    rates.set_ylim(bottom=0)
    depth = rates.twinx()
    line(depth, rows, "waiting", "waiting (right)", color="tab:orange")
    depth.set_ylabel("waiting jobs")
    depth.set_ylim(bottom=0)
    rates.set_title("Throughput and waiting depth", fontsize=10, loc="left")
    rates.set_xlabel("minutes into the steady phase")

    for ax in axes:
        for i, (begin, end) in enumerate(spans):
            ax.axvspan(
                begin / 60, end / 60, color=IDLE_COLOUR, zorder=0, label="idle in transaction" if i == 0 else None
            )
        ax.grid(True, alpha=0.3)
        handles, labels = ax.get_legend_handles_labels()
        if ax is rates:
            more = depth.get_legend_handles_labels()
            handles, labels = handles + more[0], labels + more[1]
        # Right of the plot; past the waiting axis's labels on the last panel.
        anchor = (1.07 if ax is rates else 1.01, 1)
        ax.legend(handles, labels, fontsize=8, loc="upper left", bbox_to_anchor=anchor, borderaxespad=0)
    if title:
        fig.suptitle(title, fontsize=11)
    fig.savefig(png_path, dpi=100)
    plt.close(fig)


if __name__ == "__main__":
    source = Path(sys.argv[1])
    plot(source, Path(sys.argv[2]) if len(sys.argv) > 2 else source.with_suffix(".png"), source.stem)
