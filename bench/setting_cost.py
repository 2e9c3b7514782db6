"""What a setting costs the drain: the same no-op jobs drained by one ``queue_work`` process on
PostgreSQL, from each code tree given, and again with settings given as ``BENCH_*`` variables.

Variants alternate within each repeat (each goes first in turn); prints jobs/s (median of the
repeats) and the worker's CPU per job, each as a ratio to the first variant. The history of
finished jobs (``DBQUEUE["KEEP_FINISHED"]``), against the commit before it:

    git worktree add /tmp/before 4fc291a
    .venv/bin/python -m bench.setting_cost --tree before=/tmp/before --tree now=. \\
        --variant now:kept:BENCH_KEEP_FINISHED=24 --repeat 7
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

DBNAME = "dbqueue_bench_setting"


def drain(tree: Path, extra: dict[str, str], jobs: int) -> tuple[float, float]:
    """Jobs/s of one worker draining ``jobs`` no-op jobs (start-up and shut-down taken away) and
    its CPU per job in microseconds, with the environment ``extra``."""
    env = {
        **os.environ, "PYTHONPATH": str(tree), "DJANGO_SETTINGS_MODULE": "bench.settings", "BENCH_DB": "postgres",
        "BENCH_DBNAME": DBNAME, **extra,
    }  # fmt: skip
    recreate_database(DBNAME)
    subprocess.run([sys.executable, "-c", ENQUEUE.format(jobs=jobs)], env=env, cwd=tree, check=True)
    with psycopg.connect("host=127.0.0.1 user=postgres dbname=postgres", autocommit=True) as conn:
        conn.execute("CHECKPOINT")
    worker = [sys.executable, "-m", "django", "queue_work", "--stop-when-empty", "--sleep", "0", "-v", "0"]
    started, cpu = time.monotonic(), _children_cpu()
    subprocess.run(worker, env=env, cwd=tree, check=True)
    total, total_cpu = time.monotonic() - started, _children_cpu() - cpu
    started, cpu = time.monotonic(), _children_cpu()
    subprocess.run(worker, env=env, cwd=tree, check=True)
    idle, idle_cpu = time.monotonic() - started, _children_cpu() - cpu
    return jobs / max(total - idle, 1e-6), (total_cpu - idle_cpu) / jobs * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tree", action="append", required=True, metavar="NAME=PATH", help="a code tree to drain with")
    parser.add_argument(
        "--variant", action="append", default=[], metavar="TREE:LABEL:VAR=VALUE[,VAR=VALUE]",
        help="also drain TREE with these environment variables",
    )  # fmt: skip
    parser.add_argument("--jobs", type=int, default=20000)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    trees = {name: Path(path).resolve() for name, path in (item.split("=", 1) for item in args.tree)}
    variants: list[tuple[str, Path, dict[str, str]]] = [(name, tree, {}) for name, tree in trees.items()]
    for item in args.variant:
        tree_name, label, assignments = item.split(":", 2)
        extra = dict(pair.split("=", 1) for pair in assignments.split(","))
        variants.append((f"{tree_name} {label}", trees[tree_name], extra))
    rates: dict[str, list[float]] = {}
    cpus: dict[str, list[float]] = {}
    for repeat in range(args.repeat):
        shift = repeat % len(variants)
        for label, tree, extra in variants[shift:] + variants[:shift]:
            rate, cpu = drain(tree, extra, args.jobs)
            rates.setdefault(label, []).append(rate)
            cpus.setdefault(label, []).append(cpu)
            print(f"repeat {repeat + 1}: {label}: {rate:,.0f} jobs/s, worker CPU {cpu:.1f} us a job", flush=True)
    print(f"\n{args.jobs:,} no-op jobs, one worker, PostgreSQL; median of {args.repeat}:")
    first_rate = statistics.median(rates[variants[0][0]])
    first_cpu = statistics.median(cpus[variants[0][0]])
    for label, _, _ in variants:
        rate, cpu = statistics.median(rates[label]), statistics.median(cpus[label])
        print(
            f"  {label:<24} {rate:8,.0f} jobs/s  {rate / first_rate - 1:+6.1%}  "
            f"worker CPU {cpu:5.1f} us a job {cpu / first_cpu - 1:+6.1%}"
        )


if __name__ == "__main__":
    main()
