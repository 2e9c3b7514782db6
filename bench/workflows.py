"""What dependencies cost a drain: a workflow fanning out to N nodes and in to one, against N plain jobs.

Fills a fresh PostgreSQL database either with N no-op jobs (``enqueue_many``) or with one
workflow (a root, N nodes after it, one sink after them all), then drains it with W
``queue_work`` processes and times the drain, from the queue's resume (the workers started on it
paused) to the table empty. Every 10 ms a sampler reads that, and the sessions waiting on a lock
in ``pg_stat_activity`` (``wait_event_type = 'Lock'``): the release of dependents must not queue
the workers on one row.
Variants alternate within each repeat.

    .venv/bin/python -m bench.workflows --nodes 10000 --workers 1 --workers 4 --repeat 5
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import psycopg

DBNAME = "dbqueue_bench_workflows"
ROOT = Path(__file__).resolve().parent.parent

FILL = """
import django
django.setup()
from django.core.management import call_command
call_command("migrate", verbosity=0)
from django_dbqueue import enqueue_many, pauses, workflow
from bench.benchapp.jobs import noop
# Paused while the workers start: the clock runs from the resume, with every worker up.
pauses.pause("default", force=True)
if {graph}:
    wf = workflow("fan")
    wf.add("root", noop.bind(-1))
    for i in range({nodes}):
        wf.add(f"n{{i}}", noop.bind(i), after=["root"])
    wf.add("sink", noop.bind(-2), after=[f"n{{i}}" for i in range({nodes})])
    wf.enqueue()
else:
    enqueue_many(noop.bind(i) for i in range({nodes} + 2))
"""


def recreate_database() -> None:
    with psycopg.connect("host=127.0.0.1 user=postgres dbname=postgres", autocommit=True) as conn:
        conn.execute(f"DROP DATABASE IF EXISTS {DBNAME} WITH (FORCE)")
        conn.execute(f"CREATE DATABASE {DBNAME}")


def env() -> dict[str, str]:
    return {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "DJANGO_SETTINGS_MODULE": "bench.settings",
        "BENCH_DB": "postgres",
        "BENCH_DBNAME": DBNAME,
    }


class LockWaits:
    """Samples the sessions of the bench database waiting on a lock, every 10 ms, in a thread."""

    def __init__(self) -> None:
        self.emptied: float | None = None  # when the job table was first seen empty (time.monotonic)
        self.samples = 0
        self.waiting = 0  # samples with at least one session waiting on a lock
        self.most = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> LockWaits:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        with psycopg.connect(f"host=127.0.0.1 user=postgres dbname={DBNAME}", autocommit=True) as conn:
            while not self._stop.is_set():
                count, empty = conn.execute(
                    "SELECT count(*), NOT EXISTS (SELECT FROM dbqueue_job) FROM pg_stat_activity "
                    "WHERE datname = %s AND wait_event_type = 'Lock'",
                    [DBNAME],
                ).fetchone()
                if empty and self.emptied is None:
                    self.emptied = time.monotonic()
                self.samples += 1
                self.waiting += bool(count)
                self.most = max(self.most, count)
                time.sleep(0.01)


def drain(graph: bool, nodes: int, workers: int) -> tuple[float, LockWaits]:
    recreate_database()
    subprocess.run([sys.executable, "-c", FILL.format(graph=graph, nodes=nodes)], env=env(), cwd=ROOT, check=True)
    with psycopg.connect("host=127.0.0.1 user=postgres dbname=postgres", autocommit=True) as conn:
        conn.execute("CHECKPOINT")
    # The workers start on the paused queue (all of them up: one row each in the workers table), and
    # the clock runs from the resume (its NOTIFY wakes them) to the table empty, as sampled every
    # 10 ms: not the start-up, nor the idle workers' last poll (while the sink runs alone, the others
    # sleep until they are stopped). A worker that finds nothing while the root runs waits for the
    # nodes it releases (woken by the release's NOTIFY).
    command = [sys.executable, "-m", "django", "queue_work", "--sleep", "1", "-v", "0"]
    processes = [subprocess.Popen(command, env=env(), cwd=ROOT) for _ in range(workers)]
    with psycopg.connect(f"host=127.0.0.1 user=postgres dbname={DBNAME}", autocommit=True) as conn:
        deadline = time.monotonic() + 60
        while conn.execute("SELECT count(*) FROM dbqueue_worker").fetchone()[0] < workers:
            if time.monotonic() > deadline:
                raise SystemExit("the workers did not start")
            time.sleep(0.05)
        time.sleep(0.5)  # past their first claim of the paused queue: asleep, listening
        with LockWaits() as waits:
            began = time.monotonic()
            with conn.transaction():
                conn.execute("DELETE FROM dbqueue_paused_queue WHERE queue = 'default'")
                conn.execute("SELECT pg_notify('dbqueue', 'default')")
            while waits.emptied is None and time.monotonic() < began + 600:
                time.sleep(0.01)
    for process in processes:
        process.send_signal(signal.SIGTERM)
    for process in processes:
        process.wait(30)
    assert waits.emptied is not None, "the queue was not empty after 10 minutes"
    total = waits.emptied - began
    with psycopg.connect(f"host=127.0.0.1 user=postgres dbname={DBNAME}") as conn:
        (left,) = conn.execute("SELECT count(*) FROM dbqueue_job").fetchone()
        (failed,) = conn.execute("SELECT count(*) FROM dbqueue_failed_job").fetchone()
    if left or failed:
        raise SystemExit(f"{left} jobs left and {failed} failed after the drain")
    return (nodes + 2) / max(total, 1e-6), waits


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nodes", type=int, default=10000)
    parser.add_argument("--workers", type=int, action="append")
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    rates: dict[tuple[int, bool], list[float]] = {}
    for workers in args.workers or [1, 4]:
        for repeat in range(args.repeat):
            for graph in (False, True) if repeat % 2 == 0 else (True, False):
                rate, waits = drain(graph, args.nodes, workers)
                rates.setdefault((workers, graph), []).append(rate)
                label = "workflow" if graph else "plain"
                print(
                    f"workers={workers} repeat {repeat + 1}: {label}: {rate:,.0f} jobs/s; samples with a lock "
                    f"wait {waits.waiting}/{waits.samples}, most waiting at once {waits.most}",
                    flush=True,
                )
    print(f"\n{args.nodes:,} nodes (root -> nodes -> sink), {args.nodes + 2:,} plain jobs; median of {args.repeat}:")
    for workers in args.workers or [1, 4]:
        plain, graph = (statistics.median(rates[workers, kind]) for kind in (False, True))
        print(f"  {workers} worker(s): plain {plain:,.0f} jobs/s, workflow {graph:,.0f} jobs/s: {graph / plain:.0%}")


if __name__ == "__main__":
    main()
