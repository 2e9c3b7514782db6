"""django-dbqueue's side of the benchmark; runs in the project's own environment.

python -m bench.drivers.dbqueue COMMAND [ARGS]   (DJANGO_SETTINGS_MODULE=bench.settings, BENCH_DB=...)
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import time
from typing import Any

from bench.drivers.common import emit, latency_run, pg_recreate, pg_settle, timed

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "bench.settings")
BENCH_DB = os.environ.get("BENCH_DB", "postgres")
DBNAME = os.environ.get("BENCH_DBNAME", "dbqueue_bench")


def recreate_database() -> None:
    """Drop and create the benchmark database, then migrate it."""
    if BENCH_DB == "postgres":
        pg_recreate(DBNAME)
    elif BENCH_DB == "mysql":
        import MySQLdb

        from bench.drivers.common import check_name

        check_name(DBNAME)
        conn = MySQLdb.connect(
            host=os.environ.get("BENCH_MYSQL_HOST", "127.0.0.1"),
            port=int(os.environ.get("BENCH_MYSQL_PORT", "3306")),
            user=os.environ.get("BENCH_MYSQL_USER", "root"),
            passwd=os.environ.get("BENCH_MYSQL_PASSWORD", ""),
        )
        cursor = conn.cursor()
        cursor.execute(f"DROP DATABASE IF EXISTS `{DBNAME}`")
        cursor.execute(f"CREATE DATABASE `{DBNAME}` CHARACTER SET utf8mb4")
        conn.close()
    setup_django()
    if BENCH_DB == "sqlite":
        from django.conf import settings

        path = settings.DATABASES["default"]["NAME"]
        for suffix in ("", "-wal", "-shm"):
            if os.path.exists(path + suffix):
                os.remove(path + suffix)
    from django.core.management import call_command

    call_command("migrate", verbosity=0)


def setup_django() -> None:
    import django

    django.setup()


def clear() -> None:
    from django.db import connection

    with connection.cursor() as cursor:
        if BENCH_DB == "sqlite":
            cursor.execute("DELETE FROM dbqueue_job")
        else:
            cursor.execute("TRUNCATE TABLE dbqueue_job")


def settle() -> None:
    """Make every run start alike: fresh statistics, no pending checkpoint."""
    from django.db import connection

    if BENCH_DB == "postgres":
        connection.close()
        pg_settle(DBNAME)
    elif BENCH_DB == "mysql":
        with connection.cursor() as cursor:
            cursor.execute("ANALYZE TABLE dbqueue_job")
            cursor.fetchall()
    else:
        with connection.cursor() as cursor:
            cursor.execute("PRAGMA wal_checkpoint(TRUNCATE)")
            cursor.execute("ANALYZE")


def remaining() -> int:
    from django_dbqueue.models import Job

    return Job.objects.count()


def enqueue_one(count: int) -> dict[str, Any]:
    from bench.benchapp.jobs import noop

    clear()
    seconds = timed(lambda: [noop.enqueue(i) for i in range(count)])
    return {"jobs": count, "seconds": seconds, "jobs_per_s": count / seconds, "stored": remaining()}


def enqueue_bulk(count: int, calls_of: int = 0) -> dict[str, Any]:
    """``enqueue_many`` as a user calls it (handles on), ``calls_of`` jobs per call (0: all in one)."""
    from bench.benchapp.jobs import noop
    from django_dbqueue import enqueue_many

    size = calls_of or count

    def calls() -> None:
        for start in range(0, count, size):
            enqueue_many(noop.bind(i) for i in range(start, min(count, start + size)))

    clear()
    seconds = timed(calls)
    return {"jobs": count, "calls_of": size, "seconds": seconds, "jobs_per_s": count / seconds, "stored": remaining()}


def enqueue_bulk_count(count: int) -> dict[str, Any]:
    """``enqueue_many(..., handles=False)``: no handles, no rows read back (COPY on PostgreSQL)."""
    from bench.benchapp.jobs import noop
    from django_dbqueue import enqueue_many

    clear()
    seconds = timed(lambda: enqueue_many((noop.bind(i) for i in range(count)), handles=False))
    return {"jobs": count, "seconds": seconds, "jobs_per_s": count / seconds, "stored": remaining()}


def enqueue_stream(count: int) -> dict[str, Any]:
    """A generator of ``count`` calls streamed with ``handles=False``: the rate and the growth
    of this process's peak resident memory (after a first batch, rolled back, has warmed it)."""
    import resource

    from django.db import transaction

    from bench.benchapp.jobs import noop
    from django_dbqueue import enqueue_many

    def peak_mb() -> float:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024

    clear()
    with transaction.atomic():
        enqueue_many((noop.bind(i) for i in range(1000)), handles=False)
        transaction.set_rollback(True)
    before = peak_mb()
    seconds = timed(lambda: enqueue_many((noop.bind(i) for i in range(count)), handles=False))
    grown = peak_mb() - before
    stored = remaining()
    clear()
    return {"jobs": count, "seconds": seconds, "jobs_per_s": count / seconds, "rss_growth_mb": grown, "stored": stored}


def fill(count: int) -> dict[str, Any]:
    from bench.benchapp.jobs import noop
    from django_dbqueue import enqueue_many

    clear()
    for start in range(0, count, 10_000):
        enqueue_many(noop.bind(i) for i in range(start, min(count, start + 10_000)))
    settle()
    return {"jobs": remaining()}


def latency(count: int, path: str, gap_min: float, gap_max: float) -> dict[str, Any]:
    from bench.benchapp.jobs import record_start

    return latency_run(lambda tag, at: record_start.enqueue(tag, at), count, path, gap_min=gap_min, gap_max=gap_max)


# -- the claim as the table grows (PostgreSQL) ----------------------------------

FILL_SQL = """
INSERT INTO dbqueue_job (queue, name, payload, priority, attempts, max_tries, retry_after, timeout,
                         available_at, reserved_at, reserved_by, created_at)
SELECT 'default', 'bench.noop', %(payload)s, %(priority)s, %(attempts)s, NULL, %(retry_after)s, NULL,
       {available_at}, {reserved_at}, %(reserved_by)s, statement_timestamp()
FROM generate_series(1, %(count)s)
"""


def insert_rows(count: int, *, kind: str = "waiting", priority: int = 0) -> None:
    """Insert ``count`` rows in one INSERT ... SELECT generate_series: waiting, delayed or reserved."""
    from django.db import connection

    from bench.benchapp.jobs import noop
    from django_dbqueue.rows import prepare

    available_at = {
        "waiting": "statement_timestamp()",
        "delayed": "statement_timestamp() + interval '1 day'",
        # Reserved an hour ago by a worker that is still alive (retry_after of a day).
        "reserved": "statement_timestamp() - interval '1 hour'",
    }[kind]
    reserved_at = "statement_timestamp() - interval '1 hour'" if kind == "reserved" else "NULL"
    params = {
        "payload": prepare(noop.bind(0))[0].payload,
        "priority": priority,
        "attempts": 1 if kind == "reserved" else 0,
        "retry_after": 86_400 if kind == "reserved" else 60,
        "reserved_by": "bench:elsewhere:0" if kind == "reserved" else "",
        "count": count,
    }
    with connection.cursor() as cursor:
        cursor.execute(FILL_SQL.format(available_at=available_at, reserved_at=reserved_at), params)


def time_claims(iterations: int) -> dict[str, Any]:
    """Reserve one job and release it, ``iterations`` times; the claim is timed alone and with the release."""
    from django_dbqueue import claims, lifecycle

    claim_ms: list[float] = []
    cycle_ms: list[float] = []
    for i in range(iterations + 20):
        started = time.perf_counter()
        jobs = claims.reserve_many(["default"], limit=1, worker_id="bench:claim:0")
        claimed = time.perf_counter()
        if not jobs:
            raise RuntimeError("the claim found no job")
        lifecycle.release(jobs[0])
        released = time.perf_counter()
        if i >= 20:  # the first claims warm the caches
            claim_ms.append((claimed - started) * 1000)
            cycle_ms.append((released - started) * 1000)
    return {
        "iterations": iterations,
        "claim_mean_ms": statistics.fmean(claim_ms),
        "claim_p50_ms": statistics.median(claim_ms),
        "claim_max_ms": max(claim_ms),
        "claim_release_mean_ms": statistics.fmean(cycle_ms),
    }


def explain_claim() -> str:
    """EXPLAIN ANALYZE of the claim statement (UPDATE ... WHERE id IN (SELECT ... FOR UPDATE
    SKIP LOCKED) RETURNING), with the claim's own SQL and parameters, rolled back."""
    from django.db import connection, transaction

    from django_dbqueue.claims.plain import claim_params, claim_sql

    with transaction.atomic(), connection.cursor() as cursor:
        cursor.execute(
            "EXPLAIN (ANALYZE, COSTS OFF, TIMING ON) " + claim_sql(connection),
            claim_params("bench:explain:0", "default", 1),
        )
        plan = "\n".join(row[0] for row in cursor.fetchall())
        transaction.set_rollback(True)
    return plan


def claim_growth(iterations: int, sizes: list[int], delayed: int) -> dict[str, Any]:
    """Claim cost with growing tables of waiting jobs, and with delayed or reserved jobs in front."""
    from django.db import connection

    results: dict[str, Any] = {}

    def measure(label: str) -> None:
        connection.close()
        pg_settle(DBNAME)
        plan = explain_claim()
        found = re.search(r"Execution Time: ([0-9.]+) ms", plan)
        results[label] = {
            **time_claims(iterations),
            "rows": remaining(),
            "plan": plan,
            "server_execution_ms": float(found.group(1)) if found else None,
        }

    clear()
    have = 0
    for size in sorted(sizes):
        insert_rows(size - have)
        have = size
        measure(f"waiting_{size}")
    base = min(sizes)
    # "In front": enqueued earlier (smaller ids), then the waiting jobs.
    for label, kind, priority in (
        ("delayed_in_front", "delayed", 0),
        ("delayed_higher_priority", "delayed", 10),
        ("reserved_in_front", "reserved", 0),
    ):
        clear()
        insert_rows(delayed, kind=kind, priority=priority)
        insert_rows(base)
        measure(f"{label}_{delayed}")
        results[f"{label}_{delayed}"]["waiting"] = base
    clear()
    return results


# -- statements per job, counted in-process --------------------------------------


def queries_per_job(count: int, batch: int = 1) -> dict[str, Any]:
    """Drain ``count`` no-op jobs with an in-process Worker and count its statements by kind."""
    from collections import Counter

    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    from django_dbqueue.execution import Defaults
    from django_dbqueue.worker import Worker, WorkerOptions

    fill(count)
    extra: dict[str, Any] = {"batch": batch} if batch > 1 else {}
    options = WorkerOptions(
        queues=["default"], defaults=Defaults(tries=3, timeout=45, backoff=0), sleep=0.01, stop_when_empty=True, **extra
    )
    with CaptureQueriesContext(connection) as captured:
        Worker(options).run()
    kinds = Counter(q["sql"].split(None, 1)[0].upper() for q in captured.captured_queries)
    # The last claim found nothing; one per job otherwise.
    return {
        "jobs": count,
        "batch": batch,
        "statements": len(captured.captured_queries),
        "statements_per_job": len(captured.captured_queries) / count,
        "by_kind": dict(kinds),
        "sample": [q["sql"][:300] for q in captured.captured_queries[:6]],
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument(
        "command",
        choices=[
            "setup",
            "enqueue-one",
            "enqueue-bulk",
            "enqueue-bulk-count",
            "enqueue-stream",
            "fill",
            "remaining",
            "latency",
            "claim",
            "queries-per-job",
        ],
    )
    parser.add_argument("--count", type=int, default=1000)
    parser.add_argument("--path", default="")
    parser.add_argument("--gap-min", type=float, default=0.005)
    parser.add_argument("--gap-max", type=float, default=0.03)
    parser.add_argument("--sizes", default="1000,100000,1000000")
    parser.add_argument("--delayed", type=int, default=100_000)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--calls-of", type=int, default=0, help="enqueue-bulk: jobs per call (0: all in one)")
    args = parser.parse_args()
    if args.command == "setup":
        recreate_database()
        emit({"ok": True})
        return
    setup_django()
    if args.command == "enqueue-one":
        emit(enqueue_one(args.count))
    elif args.command == "enqueue-bulk":
        emit(enqueue_bulk(args.count, args.calls_of))
    elif args.command == "enqueue-bulk-count":
        emit(enqueue_bulk_count(args.count))
    elif args.command == "enqueue-stream":
        emit(enqueue_stream(args.count))
    elif args.command == "fill":
        emit(fill(args.count))
    elif args.command == "remaining":
        emit({"remaining": remaining()})
    elif args.command == "latency":
        emit(latency(args.count, args.path, args.gap_min, args.gap_max))
    elif args.command == "claim":
        emit(claim_growth(args.count, [int(s) for s in args.sizes.split(",")], args.delayed))
    elif args.command == "queries-per-job":
        emit(queries_per_job(args.count, args.batch))


if __name__ == "__main__":
    main()
