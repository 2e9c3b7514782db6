"""Backing off the database: a web-like load's latency beside a burst of jobs, with and without
``DBQUEUE["PRESSURE"]``.

A "web" of ``--clients`` psycopg sessions, each sending one short transaction (a SELECT by
primary key and an UPDATE of one row of a 100,000-row table) every ``1 / --rate`` seconds, runs
for the whole round; its latency is read alone for ``--quiet`` seconds, then while ``--workers``
``queue_work`` processes drain a burst of ``--jobs`` no-op jobs enqueued before they start.
Variants alternate within each repeat, on a database of their own, recreated each round:

    .venv/bin/python -m bench.pressure --jobs 100000 --workers 4 --repeat 2 \
        --pressure '{"CLAIM_MS": 5}'

Printed per variant: the web's p50 / p95 / p99 in ms alone and beside the drain, the drain's
jobs/s, and the workers' "backing off" log lines.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import psycopg

from bench.drivers.common import percentile, pg_execute, pg_recreate, pg_settle

DBNAME = "dbqueue_bench_pressure"
ROOT = Path(__file__).resolve().parent.parent
ROWS = 100_000

FILL = """
import django
django.setup()
from django.core.management import call_command
call_command("migrate", verbosity=0)
from django_dbqueue import enqueue_many
from bench.benchapp.jobs import noop
enqueue_many((noop.bind(i) for i in range({jobs})), handles=False)
"""


def recreate_database() -> None:
    pg_recreate(DBNAME)
    pg_execute(
        DBNAME,
        "CREATE TABLE web_item (id int PRIMARY KEY, hits int NOT NULL, body text NOT NULL)",
        f"INSERT INTO web_item SELECT i, 0, md5(i::text) FROM generate_series(1, {ROWS}) i",
        "VACUUM ANALYZE web_item",
    )


def env(pressure: str | None) -> dict[str, str]:
    environment = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "DJANGO_SETTINGS_MODULE": "bench.settings",
        "BENCH_DB": "postgres",
        "BENCH_DBNAME": DBNAME,
    }
    environment.pop("BENCH_PRESSURE", None)
    if pressure:
        environment["BENCH_PRESSURE"] = pressure
    return environment


class Web:
    """``clients`` sessions, each sending a request every ``1 / rate`` s; latencies by phase."""

    def __init__(self, clients: int, rate: float) -> None:
        self.clients = clients
        self.gap = 1 / rate
        self.phase = "quiet"
        self.latencies: dict[str, list[float]] = {"quiet": [], "burst": [], "after": []}
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._client, args=(n,), daemon=True) for n in range(clients)]

    def __enter__(self) -> Web:
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join()

    def _client(self, number: int) -> None:
        rng = random.Random(number)
        with psycopg.connect(f"host=127.0.0.1 user=postgres dbname={DBNAME}", autocommit=True) as conn:
            due = time.monotonic()
            while not self._stop.is_set():
                due += self.gap * rng.uniform(0.5, 1.5)
                item = rng.randint(1, ROWS)
                began = time.monotonic()
                with conn.transaction():
                    conn.execute("SELECT hits, body FROM web_item WHERE id = %s", [item]).fetchone()
                    conn.execute("UPDATE web_item SET hits = hits + 1 WHERE id = %s", [item])
                self.latencies[self.phase].append((time.monotonic() - began) * 1000)
                pause = due - time.monotonic()
                if pause > 0:
                    time.sleep(pause)
                else:
                    due = time.monotonic()  # behind: no catching up in a rush


def figures(values: list[float]) -> dict[str, float]:
    return {"n": len(values), **{f"p{p}": round(percentile(values, p), 2) for p in (50, 95, 99)}}


def one_round(args: argparse.Namespace, pressure: str | None) -> dict[str, object]:
    recreate_database()
    subprocess.run([sys.executable, "-c", FILL.format(jobs=args.jobs)], env=env(pressure), cwd=ROOT, check=True)
    pg_settle(DBNAME)
    logs = [Path(f"/tmp/bench-pressure-{n}.log") for n in range(args.workers)]
    with Web(args.clients, args.rate) as web:
        time.sleep(args.quiet)
        web.phase = "burst"
        command = [sys.executable, "-m", "django", "queue_work", "--sleep", "1", "--skip-checks"]
        processes = [
            subprocess.Popen(command, env=env(pressure), cwd=ROOT, stdout=log.open("wb"), stderr=subprocess.STDOUT)
            for log in logs
        ]
        began = time.monotonic()
        with psycopg.connect(f"host=127.0.0.1 user=postgres dbname={DBNAME}", autocommit=True) as conn:
            while conn.execute("SELECT EXISTS (SELECT FROM dbqueue_job)").fetchone()[0]:
                if time.monotonic() - began > args.max_seconds:
                    break
                time.sleep(0.05)
        drained = time.monotonic() - began
        web.phase = "after"
        for process in processes:
            process.send_signal(signal.SIGTERM)
        for process in processes:
            process.wait(60)
    text = "".join(log.read_text(errors="replace") for log in logs)
    return {
        "pressure": pressure or "off",
        "quiet": figures(web.latencies["quiet"]),
        "burst": figures(web.latencies["burst"]),
        "drain_s": round(drained, 2),
        "jobs_per_s": round(args.jobs / drained),
        "backing_off_lines": text.count("backing off the database"),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--jobs", type=int, default=100_000, help="jobs in the burst (default: 100000)")
    parser.add_argument("--workers", type=int, default=4, help="queue_work processes (default: 4)")
    parser.add_argument("--clients", type=int, default=8, help="web sessions (default: 8)")
    parser.add_argument("--rate", type=float, default=50, help="requests per second per session (default: 50)")
    parser.add_argument("--quiet", type=float, default=10, help="seconds of the web alone first (default: 10)")
    parser.add_argument("--repeat", type=int, default=2, help="rounds of each variant (default: 2)")
    parser.add_argument("--max-seconds", type=float, default=600, help="give a drain up after this long")
    parser.add_argument(
        "--pressure", default='{"CLAIM_MS": 5}', help="DBQUEUE['PRESSURE'] as JSON (default: %(default)s)"
    )
    args = parser.parse_args()
    results: dict[str, list[dict[str, object]]] = {"off": [], args.pressure: []}
    for repeat in range(args.repeat):
        variants = [None, args.pressure] if repeat % 2 == 0 else [args.pressure, None]
        for pressure in variants:
            result = one_round(args, pressure)
            print(json.dumps(result), flush=True)
            results[pressure or "off"].append(result)
    print("\nmedians over rounds (web latency in ms):")
    for name, rounds in results.items():
        burst_p95 = statistics.median(float(r["burst"]["p95"]) for r in rounds)  # type: ignore[index]
        quiet_p95 = statistics.median(float(r["quiet"]["p95"]) for r in rounds)  # type: ignore[index]
        rate = statistics.median(float(r["jobs_per_s"]) for r in rounds)  # type: ignore[arg-type]
        print(f"  pressure={name}: web p95 alone {quiet_p95:.2f}, beside the burst {burst_p95:.2f}; {rate:.0f} jobs/s")


if __name__ == "__main__":
    main()
