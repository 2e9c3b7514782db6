"""The floor under a drain: a hand-written psycopg queue, against django-dbqueue, in one run.

The floor's table holds an id, a queue name and a payload, with the one index a claim needs;
each of P processes repeats one statement that deletes the 10 jobs it claimed last (a no-op
job "ran") and claims the next 10 (``FOR UPDATE SKIP LOCKED``) until it claims none. No retries,
timeouts, heartbeats, history, listener, outcomes or Django: what any queue on PostgreSQL
costs at least. django-dbqueue drains the same number of no-op jobs with P ``queue_work``
processes and with one ``queue_work --concurrency P``; the three alternate in each round, and
each drain is timed from its processes' start to the last one's exit, start-up included.

    .venv/bin/python -m bench.floor --jobs 20000 --processes 4 --rounds 3
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

ROOT = Path(__file__).resolve().parent.parent
FLOOR_DB = "dbqueue_bench_floor"
DBQUEUE_DB = "dbqueue_bench_floor_dbq"
DSN = "host=127.0.0.1 user=postgres dbname={}"
CLAIM = 10
ENV = {
    **os.environ,
    "PYTHONPATH": str(ROOT),
    "DJANGO_SETTINGS_MODULE": "bench.settings",
    "BENCH_DB": "postgres",
    "BENCH_DBNAME": DBQUEUE_DB,
}
FINISH_AND_CLAIM = (
    "WITH done AS (DELETE FROM floor_job WHERE id = ANY(%s)), "
    "claimed AS (UPDATE floor_job SET reserved = true WHERE id IN ("
    " SELECT id FROM floor_job WHERE NOT reserved AND queue = 'default' ORDER BY id LIMIT %s FOR UPDATE SKIP LOCKED"
    ") RETURNING id, payload) SELECT id, payload FROM claimed"
)


def recreate(name: str) -> None:
    with psycopg.connect(DSN.format("postgres"), autocommit=True) as conn:
        conn.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")
        conn.execute(f"CREATE DATABASE {name}")


def floor_worker() -> None:
    """One process of the floor: finish and claim in one statement until nothing is claimed."""
    with psycopg.connect(DSN.format(FLOOR_DB), autocommit=True) as conn:
        done: list[int] = []
        while True:
            rows = conn.execute(FINISH_AND_CLAIM, [done, CLAIM], prepare=True).fetchall()
            if not rows:
                return
            done = [job_id for job_id, _payload in rows]


def floor_fill(jobs: int) -> None:
    with psycopg.connect(DSN.format(FLOOR_DB), autocommit=True) as conn:
        conn.execute("DROP TABLE IF EXISTS floor_job")
        conn.execute(
            "CREATE TABLE floor_job (id bigserial PRIMARY KEY, queue text NOT NULL, payload text NOT NULL, "
            "reserved boolean NOT NULL DEFAULT false)"
        )
        conn.execute("CREATE INDEX floor_job_waiting ON floor_job (queue, id) WHERE NOT reserved")
        conn.execute(
            "INSERT INTO floor_job (queue, payload) SELECT 'default', '{\"args\":[' || i || ']}' "
            "FROM generate_series(1, %s) AS i",
            [jobs],
        )
        conn.execute("VACUUM ANALYZE floor_job")


def timed(commands: list[list[str]], env: dict[str, str]) -> float:
    started = time.perf_counter()
    processes = [subprocess.Popen(command, env=env, cwd=ROOT) for command in commands]
    codes = [process.wait() for process in processes]
    if any(codes):
        raise SystemExit(f"a process exited with {codes}")
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=20_000)
    parser.add_argument("--processes", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        floor_worker()
        return
    recreate(FLOOR_DB)
    recreate(DBQUEUE_DB)
    subprocess.run([sys.executable, "-m", "django", "migrate", "-v", "0"], env=ENV, cwd=ROOT, check=True)
    queue_work = [sys.executable, "-m", "django", "queue_work", "--stop-when-empty", "--sleep", "0.01", "-v", "0"]
    kinds = {
        "floor": [[sys.executable, "-m", "bench.floor", "--worker"]] * args.processes,
        f"queue_work x {args.processes}": [queue_work] * args.processes,
        f"queue_work --concurrency {args.processes}": [[*queue_work, "--concurrency", str(args.processes)]],
    }
    rates: dict[str, list[float]] = {kind: [] for kind in kinds}
    for _ in range(args.rounds):
        for kind, commands in kinds.items():
            if kind == "floor":
                floor_fill(args.jobs)
            else:
                subprocess.run(
                    [sys.executable, "-m", "bench.drivers.dbqueue", "fill", "--count", str(args.jobs)],
                    env=ENV, cwd=ROOT, check=True, capture_output=True,
                )  # fmt: skip
            rates[kind].append(args.jobs / timed(commands, ENV))
    floor = statistics.median(rates["floor"])
    print(f"{args.jobs:,} no-op jobs, {args.processes} processes, medians of {args.rounds} rounds alternating:")
    for kind, values in rates.items():
        median = statistics.median(values)
        shown = ", ".join(f"{value:,.0f}" for value in values)
        print(f"  {kind:28s} {median:9,.0f} jobs/s ({median / floor:.0%} of the floor; rounds: {shown})")


if __name__ == "__main__":
    main()
