"""The autoscaler's queries (``django_dbqueue.scaling``) on a million waiting jobs, on PostgreSQL:
their time and their plans (docs/howto/autoscaling.md).

    .venv/bin/python -m bench.keda_explain              # fill the scratch database, then measure
    .venv/bin/python -m bench.keda_explain --no-load    # measure the rows already there

The scratch database is ``dbqueue_bench_keda`` (dropped and made again by a load). Rows, inserted
with ``enqueue_many(..., handles=False)``: 1,000 jobs in ``default``, reserved by a claim; then
1,000,000 waiting jobs in ``default``, 10,000 delayed by an hour, 10,000 waiting in ``emails``,
and 100,000 waiting in ``reports``, which is paused. Then ``ANALYZE``.

Each query runs 7 times with a plain cursor, as KEDA sends it (one literal statement): the median
of the last 6 in ms, the first apart; then ``EXPLAIN (ANALYZE, BUFFERS)``. Then the table is
vacuumed, as autovacuum would, and everything runs again: an index-only scan of pages that are
all-visible reads no heap page.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from datetime import timedelta

import django
import psycopg

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "bench.settings")
os.environ.setdefault("BENCH_DBNAME", "dbqueue_bench_keda")
django.setup()

from django.core.management import call_command  # noqa: E402
from django.db import connection  # noqa: E402

from bench.benchapp.jobs import noop  # noqa: E402
from bench.main import machine  # noqa: E402
from django_dbqueue import claims, pauses  # noqa: E402
from django_dbqueue.enqueue import enqueue_many  # noqa: E402
from django_dbqueue.scaling import IN_FLIGHT_SQL, WAITING_SQL, scaler_query  # noqa: E402

WAITING = 1_000_000
RESERVED = 1_000
DELAYED = 10_000
OTHER = 10_000
PAUSED = 100_000
# KEDA needs no more than targetQueryValue x maxReplicaCount: 100 x 10 here.
CAP = 1_000
QUEUES = ["default", "emails"]
RUNS = 7


def load() -> None:
    with psycopg.connect("host=127.0.0.1 user=postgres dbname=postgres", autocommit=True) as conn:
        name = os.environ["BENCH_DBNAME"]
        conn.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")
        conn.execute(f"CREATE DATABASE {name}")
    call_command("migrate", verbosity=0)
    started = time.monotonic()
    enqueue_many((noop.bind(i) for i in range(RESERVED)), handles=False)
    reserved = claims.reserve_many(["default"], limit=RESERVED, worker_id="bench:1:keda")
    assert len(reserved) == RESERVED, len(reserved)
    enqueue_many((noop.bind(i) for i in range(WAITING)), handles=False)
    enqueue_many((noop.using(delay=timedelta(hours=1)).bind(i) for i in range(DELAYED)), handles=False)
    enqueue_many((noop.using(queue="emails").bind(i) for i in range(OTHER)), handles=False)
    enqueue_many((noop.using(queue="reports").bind(i) for i in range(PAUSED)), handles=False)
    pauses.pause("reports", force=True)
    with connection.cursor() as cursor:
        cursor.execute("ANALYZE dbqueue_job")
    print(f"loaded in {time.monotonic() - started:.0f} s\n", flush=True)


# The plain count a reader would write first: no ORDER BY, no cap, paused queues left in.
PLAIN = (
    "SELECT count(*) FROM dbqueue_job WHERE queue IN ('default', 'emails') "
    "AND reserved_at IS NULL AND NOT blocked AND available_at <= STATEMENT_TIMESTAMP()"
)


def unordered(sql: str) -> str:
    """``sql`` without the ORDER BY that makes the planner read the claim's index in order."""
    return sql.replace("\n  ORDER BY queue, priority DESC, available_at, id", "")


QUERIES = {
    f"WAITING_SQL, LIMIT {CAP:,} (the one for KEDA)": scaler_query(WAITING_SQL, QUEUES, limit=CAP),
    "WAITING_SQL, LIMIT ALL (waiting_count without a limit)": scaler_query(WAITING_SQL, QUEUES, limit=None),
    # Past the reservations, so that its waiting part runs too.
    f"IN_FLIGHT_SQL, LIMIT {RESERVED + CAP:,}": scaler_query(IN_FLIGHT_SQL, QUEUES, limit=RESERVED + CAP),
    f"WAITING_SQL of the paused queue alone, LIMIT {CAP:,}": scaler_query(WAITING_SQL, ["reports"], limit=CAP),
    "plain count(*), no ORDER BY, no cap": PLAIN,
    f"WAITING_SQL without its ORDER BY, LIMIT {CAP:,}": unordered(scaler_query(WAITING_SQL, QUEUES, limit=CAP)),
    f"the same, the paused queue alone, LIMIT {CAP:,}": unordered(scaler_query(WAITING_SQL, ["reports"], limit=CAP)),
}


def measure() -> None:
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT count(*) FILTER (WHERE reserved_at IS NULL AND NOT blocked AND available_at <= now()), "
            "count(*) FILTER (WHERE reserved_at IS NOT NULL), count(*) FILTER (WHERE available_at > now()), "
            "(SELECT count(*) FROM dbqueue_job WHERE queue IN (SELECT queue FROM dbqueue_paused_queue)), "
            "count(*), pg_size_pretty(pg_relation_size('dbqueue_job')), "
            "pg_size_pretty(pg_relation_size('dbqueue_job_waiting')) FROM dbqueue_job"
        )
        waiting, reserved, delayed, paused, rows, table, index = cursor.fetchone()
    print(
        f"{rows:,} rows ({table}; dbqueue_job_waiting {index}): {waiting:,} available ({paused:,} of them in "
        f"a paused queue), {reserved:,} reserved, {delayed:,} delayed\n"
    )
    for label, sql in QUERIES.items():
        times = []
        with connection.cursor() as cursor:
            for _ in range(RUNS):
                started = time.perf_counter()
                cursor.execute(sql)
                (count,) = cursor.fetchone()
                times.append((time.perf_counter() - started) * 1000)
            cursor.execute(f"EXPLAIN (ANALYZE, BUFFERS) {sql}")
            plan = [row[0] for row in cursor.fetchall()]
        print(f"{label}: {count:,}, {statistics.median(times[1:]):.2f} ms (first {times[0]:.2f} ms)")
        print("    " + "\n    ".join(plan) + "\n", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--no-load", action="store_true", help="measure the rows already loaded")
    args = parser.parse_args()
    info = machine()
    print(f"{info['cpu_model']}, {info['nproc']} cores; {info['postgresql'].split(' on ')[0]}")
    if not args.no_load:
        load()
    print("== after ANALYZE\n")
    measure()
    with connection.cursor() as cursor:
        cursor.execute("VACUUM (ANALYZE) dbqueue_job")
    print("== after VACUUM (ANALYZE)\n")
    measure()


if __name__ == "__main__":
    main()
