"""What keeping results costs a worker, and what handles cost when results are off.

Drains the same no-op jobs with one ``queue_work --batch 10`` process on
PostgreSQL, from each code tree given (e.g. a checkout of the commit before job
handles, and this one), with results off, and with results on for trees that
have them; variants alternate within each repeat, so they share the machine's
state. Prints jobs/s per variant (median of the repeats) and the cost per job.

    .venv/bin/python bench/results_cost.py --tree before=/tmp/before --tree now=. --results now
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

import psycopg

DBNAME = "dbqueue_bench_results"

ENQUEUE = """
import django
django.setup()
from django.core.management import call_command
call_command("migrate", verbosity=0)
from django_dbqueue import enqueue_many
from bench.benchapp.jobs import noop
enqueue_many(noop.bind(i) for i in range({jobs}))
"""


def recreate_database(name: str = DBNAME) -> None:
    with psycopg.connect("host=127.0.0.1 user=postgres dbname=postgres", autocommit=True) as conn:
        conn.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")
        conn.execute(f"CREATE DATABASE {name}")


def env(tree: Path, results: bool) -> dict[str, str]:
    return {
        **os.environ,
        "PYTHONPATH": str(tree),
        "DJANGO_SETTINGS_MODULE": "bench.settings",
        "BENCH_DB": "postgres",
        "BENCH_DBNAME": DBNAME,
        "BENCH_RESULTS": "1" if results else "",
    }


def drain(tree: Path, results: bool, jobs: int) -> tuple[float, float]:
    """Jobs/s of one worker draining ``jobs`` no-op jobs (its start-up, about a second, excluded),
    and the worker process's CPU time per job in microseconds (less exposed to a shared
    host's noise than the wall clock; the database server's share is not in it)."""
    recreate_database()
    subprocess.run([sys.executable, "-c", ENQUEUE.format(jobs=jobs)], env=env(tree, results), cwd=tree, check=True)
    # Every drain starts from a clean checkpoint: one falling inside a drain cost it up to a fifth.
    with psycopg.connect("host=127.0.0.1 user=postgres dbname=postgres", autocommit=True) as conn:
        conn.execute("CHECKPOINT")
    worker = [sys.executable, "-m", "django", "queue_work", "--stop-when-empty", "--sleep", "0", "-v", "0"]
    started, cpu = time.monotonic(), _children_cpu()
    subprocess.run(worker, env=env(tree, results), cwd=tree, check=True)
    total, total_cpu = time.monotonic() - started, _children_cpu() - cpu
    # Start-up and shut-down of an empty worker, to take away.
    started, cpu = time.monotonic(), _children_cpu()
    subprocess.run(worker, env=env(tree, results), cwd=tree, check=True)
    idle, idle_cpu = time.monotonic() - started, _children_cpu() - cpu
    return jobs / max(total - idle, 1e-6), (total_cpu - idle_cpu) / jobs * 1e6


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tree", action="append", required=True, metavar="NAME=PATH", help="a code tree to drain with")
    parser.add_argument(
        "--results", action="append", default=[], metavar="NAME", help="also drain NAME with results on"
    )
    parser.add_argument("--jobs", type=int, default=20000)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    trees = {name: Path(path).resolve() for name, path in (item.split("=", 1) for item in args.tree)}
    variants = [(name, tree, False) for name, tree in trees.items()]
    variants += [(name, trees[name], True) for name in args.results]
    rates: dict[str, list[float]] = {}
    cpus: dict[str, list[float]] = {}
    for repeat in range(args.repeat):
        # Each variant goes first in turn: the machine's state drifts within a run.
        shift = repeat % len(variants)
        for name, tree, results in variants[shift:] + variants[:shift]:
            label = f"{name} results={'on' if results else 'off'}"
            rate, cpu = drain(tree, results, args.jobs)
            rates.setdefault(label, []).append(rate)
            cpus.setdefault(label, []).append(cpu)
            print(f"repeat {repeat + 1}: {label}: {rate:,.0f} jobs/s, worker CPU {cpu:.1f} us a job", flush=True)
    print(f"\n{args.jobs:,} no-op jobs, one worker (--batch 10), PostgreSQL; median of {args.repeat}:")
    order = [f"{name} results={'on' if results else 'off'}" for name, _, results in variants]
    medians = {label: statistics.median(rates[label]) for label in order}
    first = next(iter(medians.values()))
    first_cpu = statistics.median(cpus[order[0]])
    for label, rate in medians.items():
        cpu = statistics.median(cpus[label])
        print(
            f"  {label:<28} {rate:8,.0f} jobs/s  {rate / first - 1:+6.1%}  {1000 / rate:.3f} ms per job  "
            f"worker CPU {cpu:5.1f} us a job {cpu / first_cpu - 1:+6.1%}"
        )


if __name__ == "__main__":
    main()
