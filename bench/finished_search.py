"""The history search on a large table: ten million finished jobs on PostgreSQL, over 7 days
(one partition a day), searched as the admin searches them (``finished.search``, first page).

    .venv/bin/python -m bench.finished_search --load      # once: about 10 minutes on 2 cores
    .venv/bin/python -m bench.finished_search             # the searches: median ms, and EXPLAIN

Rows: 20 job names, 4 queues, 95 % succeeded, 4 % failed, 1 % cancelled (and one job that never
fails: ``job_0``, whose failures are searched too); arguments
``[i % 100000, "eu"]`` and ``{"order_id": i}``. Each search runs 7 times (the first, cold
from the operating system's cache at most, is reported apart); the plans are printed with
``EXPLAIN (ANALYZE, BUFFERS)``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import django
import psycopg

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "bench.settings")
os.environ.setdefault("BENCH_DBNAME", "dbqueue_bench_search")
os.environ.setdefault("BENCH_KEEP_FINISHED", str(24 * 30))
django.setup()

from datetime import timedelta  # noqa: E402

from django.core.management import call_command  # noqa: E402
from django.db import connection  # noqa: E402

from django_dbqueue import finished  # noqa: E402

ROWS = 10_000_000
DAYS = 7


def load(rows: int) -> None:
    with psycopg.connect("host=127.0.0.1 user=postgres dbname=postgres", autocommit=True) as conn:
        name = os.environ["BENCH_DBNAME"]
        conn.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")
        conn.execute(f"CREATE DATABASE {name}")
    call_command("migrate", verbosity=0)
    # The days back from today, as workers would have made them.
    with connection.cursor() as cursor:
        cursor.execute("SELECT (STATEMENT_TIMESTAMP() AT TIME ZONE 'UTC')::date")
        today = cursor.fetchone()[0]
    for back in range(DAYS, 0, -1):
        day = today - timedelta(days=back)
        if day not in finished.partitions():
            finished.add_partition(day)
    finished.add_partitions()
    step = 500_000
    started = time.monotonic()
    for start in range(0, rows, step):
        with connection.cursor() as cursor:
            cursor.execute(
                f"""
                INSERT INTO {finished.TABLE} (job_id, queue, name, payload, priority, outcome, attempts, worker,
                    created_at, started_at, finished_at, duration, exception_class, error)
                SELECT i, 'queue' || (i %% 4), 'app.jobs.job_' || (i %% 20),
                    jsonb_build_object('v', 1, 'args', jsonb_build_array(i %% 100000, 'eu'),
                                       'kwargs', jsonb_build_object('order_id', i)),
                    0, outcome,
                    1, 'host:1:abc', at - interval '2 seconds', at - interval '1 second', at, 0.01,
                    CASE WHEN outcome = 'failed' THEN 'builtins.ValueError' ELSE '' END,
                    CASE WHEN outcome = 'failed' THEN 'ValueError: no' ELSE '' END
                FROM (
                    SELECT i, CASE WHEN i %% 20 = 0 OR i %% 101 < 96 THEN 'succeeded'
                        WHEN i %% 101 < 100 THEN 'failed' ELSE 'cancelled' END AS outcome,
                        date_trunc('day', now() AT TIME ZONE 'UTC') AT TIME ZONE 'UTC'
                        - interval '{DAYS} days' + (i::float8 / %s) * interval '{DAYS} days' AS at
                    FROM generate_series(%s, %s) AS i
                ) AS s
                """,
                [rows, start + 1, min(start + step, rows)],
            )
        print(f"{min(start + step, rows):,} rows, {time.monotonic() - started:.0f} s", flush=True)
    with connection.cursor() as cursor:
        cursor.execute(f"ANALYZE {finished.TABLE}")


SEARCHES = {
    "first page (newest 100)": {},
    "one job name, newest 100": {"name": "app.jobs.job_7"},
    "failed, newest 100": {"outcome": "failed"},
    "one name, failed, last day": {"name": "app.jobs.job_3", "outcome": "failed", "since": "day"},
    "a job that never failed, its failures": {"name": "app.jobs.job_0", "outcome": "failed"},
    'keyword argument {"order_id": 4242424}': {"arguments": '{"order_id": 4242424}'},
    "positional argument [31337]": {"arguments": "[31337]"},
    "one name and a keyword argument": {"name": "app.jobs.job_4", "arguments": '{"order_id": 4242424}'},
}


def measure() -> None:
    with connection.cursor() as cursor:
        cursor.execute(f"SELECT count(*) FROM {finished.TABLE}")
        print(f"{cursor.fetchone()[0]:,} rows in {finished.TABLE}, {len(finished.partitions())} day partitions\n")
        cursor.execute("SELECT STATEMENT_TIMESTAMP()")
        now = cursor.fetchone()[0]
    for label, filters in SEARCHES.items():
        given = {key: (now - timedelta(days=1) if value == "day" else value) for key, value in filters.items()}
        query = finished.search(**given)[:100]
        times = []
        for _ in range(7):
            started = time.perf_counter()
            found = len(list(query.values_list("id", "finished_at", "name", "outcome")))
            times.append((time.perf_counter() - started) * 1000)
        print(f"{label:<42} {statistics.median(times[1:]):7.1f} ms (first {times[0]:.1f} ms)  {found} rows")
        sql, params = query.values_list("id", "finished_at", "name", "outcome").query.sql_with_params()
        with connection.cursor() as cursor:
            cursor.execute(f"EXPLAIN (ANALYZE, BUFFERS, COSTS OFF) {sql}", params)
            plan = [row[0] for row in cursor.fetchall()]
        print("    " + "\n    ".join(plan) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--load", action="store_true", help="fill the table first")
    parser.add_argument("--rows", type=int, default=ROWS)
    args = parser.parse_args()
    if args.load:
        load(args.rows)
    measure()


if __name__ == "__main__":
    main()
