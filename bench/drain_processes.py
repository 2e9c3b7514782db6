"""Drain N no-op jobs with P separate ``queue_work`` processes, rounds alternating between the
process counts; print jobs/s, the workers' CPU, the rest of the machine's CPU (the server's, mostly)
and the database's own counters per job (``pg_stat_database``): where four processes lose to two.

    .venv/bin/python -m bench.drain_processes --jobs 100000 --rounds 2 --processes 2,4
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
from typing import Any

import psycopg

ROOT = Path(__file__).resolve().parent.parent
DBNAME = "dbqueue_bench_processes"
ENV = {
    **os.environ,
    "PYTHONPATH": str(ROOT),
    "DJANGO_SETTINGS_MODULE": "bench.settings",
    "BENCH_DB": "postgres",
    "BENCH_DBNAME": DBNAME,
}
COUNTERS = ("xact_commit", "blks_hit", "tup_fetched", "tup_returned")


def busy_seconds() -> float:
    """CPU seconds the whole machine has spent busy (every core), from /proc/stat."""
    with open("/proc/stat") as stat:
        ticks = [int(value) for value in stat.readline().split()[1:]]
    return (sum(ticks) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK")


def counters() -> tuple[int, ...]:
    with psycopg.connect(f"host=127.0.0.1 user=postgres dbname={DBNAME}", autocommit=True) as conn:
        row = conn.execute(f"SELECT {', '.join(COUNTERS)} FROM pg_stat_database WHERE datname = %s", [DBNAME])
        return tuple(row.fetchone())


def driver(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "bench.drivers.dbqueue", *args], env=ENV, cwd=ROOT, check=True)


def drain(processes: int, jobs: int) -> dict[str, float]:
    driver("fill", "--count", str(jobs))
    before, busy, usage = counters(), busy_seconds(), resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.perf_counter()
    command = [sys.executable, "-m", "django", "queue_work", "--stop-when-empty", "--sleep", "0.01", "-v", "0"]
    workers = [subprocess.Popen(command, env=ENV, cwd=ROOT) for _ in range(processes)]
    for worker in workers:
        worker.wait()
    seconds = time.perf_counter() - started
    after, busy, done = counters(), busy_seconds() - busy, resource.getrusage(resource.RUSAGE_CHILDREN)
    worker_cpu = done.ru_utime - usage.ru_utime + done.ru_stime - usage.ru_stime
    result = {
        "jobs/s": jobs / seconds,
        "seconds": seconds,
        "worker CPU s": worker_cpu,
        "other CPU s": busy - worker_cpu,
    }
    result.update({f"{name}/job": (b - a) / jobs for name, a, b in zip(COUNTERS, before, after, strict=True)})
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=100_000)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--processes", default="2,4")
    args = parser.parse_args()
    counts = [int(part) for part in args.processes.split(",")]
    with psycopg.connect("host=127.0.0.1 user=postgres dbname=postgres", autocommit=True) as conn:
        conn.execute(f"DROP DATABASE IF EXISTS {DBNAME} WITH (FORCE)")
        conn.execute(f"CREATE DATABASE {DBNAME}")
    subprocess.run([sys.executable, "-m", "django", "migrate", "-v", "0"], env=ENV, cwd=ROOT, check=True)
    results: dict[int, list[dict[str, float]]] = {count: [] for count in counts}
    for _ in range(args.rounds):
        for count in counts:
            results[count].append(drain(count, args.jobs))
    for count in counts:
        runs: list[dict[str, Any]] = results[count]
        medians = {key: statistics.median(run[key] for run in runs) for key in runs[0]}
        print(
            f"{count} processes, {args.jobs:,} jobs, median of {args.rounds}: "
            + ", ".join(f"{key} {value:,.3f}" for key, value in medians.items())
        )


if __name__ == "__main__":
    main()
