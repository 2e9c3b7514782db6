"""What watching the queue costs a worker: the run history and the workers table's counts.

Drains the same no-op jobs with one ``queue_work --batch 10`` process on
PostgreSQL, from each code tree given (e.g. a checkout of the commit before the
history and the workers table's counts, and this one), with the history on
(the default) and, for trees that have it, off (``DBQUEUE["HISTORY"] = False``).
Variants alternate within each repeat. Prints jobs/s (median of the repeats),
the worker's CPU per job, and the writes the worker added to the history and
workers tables (from ``pg_stat_user_tables``), per minute of draining.

    .venv/bin/python bench/observe_cost.py --tree before=/tmp/before --tree now=. --history-off now --repeat 9
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import psycopg

from bench.results_cost import ENQUEUE, _children_cpu, recreate_database

DBNAME = "dbqueue_bench_observe"


def env(tree: Path, history: bool) -> dict[str, str]:
    return {
        **os.environ,
        "PYTHONPATH": str(tree),
        "DJANGO_SETTINGS_MODULE": "bench.settings",
        "BENCH_DB": "postgres",
        "BENCH_DBNAME": DBNAME,
        "BENCH_HISTORY": "1" if history else "0",
    }


def writes() -> int:
    """Rows inserted and updated so far in the history and workers tables."""
    with psycopg.connect(f"host=127.0.0.1 user=postgres dbname={DBNAME}", autocommit=True) as conn:
        row = conn.execute(
            "SELECT coalesce(sum(n_tup_ins + n_tup_upd), 0) FROM pg_stat_user_tables "
            "WHERE relname IN ('dbqueue_history', 'dbqueue_worker')"
        ).fetchone()
    return int(row[0]) if row else 0


def drain(tree: Path, history: bool, jobs: int) -> tuple[float, float, float]:
    """Jobs/s of one worker draining ``jobs`` no-op jobs (start-up excluded), its CPU per
    job in microseconds, and the writes to the history and workers tables per minute."""
    recreate_database(DBNAME)
    subprocess.run([sys.executable, "-c", ENQUEUE.format(jobs=jobs)], env=env(tree, history), cwd=tree, check=True)
    with psycopg.connect("host=127.0.0.1 user=postgres dbname=postgres", autocommit=True) as conn:
        conn.execute("CHECKPOINT")
    before = writes()
    worker = [sys.executable, "-m", "django", "queue_work", "--stop-when-empty", "--sleep", "0", "-v", "0"]
    started, cpu = time.monotonic(), _children_cpu()
    subprocess.run(worker, env=env(tree, history), cwd=tree, check=True)
    total, total_cpu = time.monotonic() - started, _children_cpu() - cpu
    time.sleep(0.6)  # the statistics collector's report of the worker's writes
    added = writes() - before
    started, cpu = time.monotonic(), _children_cpu()
    subprocess.run(worker, env=env(tree, history), cwd=tree, check=True)
    idle, idle_cpu = time.monotonic() - started, _children_cpu() - cpu
    return jobs / max(total - idle, 1e-6), (total_cpu - idle_cpu) / jobs * 1e6, added / total * 60


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tree", action="append", required=True, metavar="NAME=PATH", help="a code tree to drain with")
    parser.add_argument(
        "--history-off", action="append", default=[], metavar="NAME", help="also drain NAME with HISTORY off"
    )
    parser.add_argument("--jobs", type=int, default=20000)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    trees = {name: Path(path).resolve() for name, path in (item.split("=", 1) for item in args.tree)}
    variants = [(name, tree, True) for name, tree in trees.items()]
    variants += [(name, trees[name], False) for name in args.history_off]
    found: dict[str, list[tuple[float, float, float]]] = {}
    for repeat in range(args.repeat):
        shift = repeat % len(variants)
        for name, tree, history in variants[shift:] + variants[:shift]:
            label = f"{name} history={'on' if history else 'off'}"
            rate, cpu, per_minute = drain(tree, history, args.jobs)
            found.setdefault(label, []).append((rate, cpu, per_minute))
            print(
                f"repeat {repeat + 1}: {label}: {rate:,.0f} jobs/s, CPU {cpu:.1f} us a job, "
                f"{per_minute:.0f} writes a minute",
                flush=True,
            )
    print(f"\n{args.jobs:,} no-op jobs, one worker (--batch 10), PostgreSQL; median of {args.repeat}:")
    first = None
    for label, runs in found.items():
        rate = statistics.median(run[0] for run in runs)
        cpu = statistics.median(run[1] for run in runs)
        per_minute = statistics.median(run[2] for run in runs)
        first = first or rate
        print(
            f"  {label:<24} {rate:8,.0f} jobs/s  {rate / first - 1:+6.1%}  worker CPU {cpu:5.1f} us a job  "
            f"history+workers writes {per_minute:5.0f} a minute"
        )


if __name__ == "__main__":
    main()
