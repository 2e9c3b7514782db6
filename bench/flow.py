"""What flow control costs the claim, on PostgreSQL (issue 12's benchmarks b, c and d).

    .venv/bin/python bench/flow.py            # all three
    .venv/bin/python bench/flow.py keys       # (b) 20,000 jobs over 1,000 concurrency keys, 4 workers
    .venv/bin/python bench/flow.py saturated  # (c) 100,000 jobs of saturated keys in front of 1,000 others
    .venv/bin/python bench/flow.py delayed    # (d) 100,000 delayed jobs of higher priority in front of 1,000

(a), the drain of jobs that use none of it, is ``bench/results_cost.py`` with a
tree from before flow control and this one. Each part recreates its own
database (``dbqueue_bench_flow``). Claim times are measured around
``claims.claim`` (in the workers, through ``BENCH_CLAIM_TIMES``), so they
include the round trips and the commit.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psycopg

ROOT = Path(__file__).resolve().parent.parent
DBNAME = "dbqueue_bench_flow"
ENV = {
    **os.environ,
    "PYTHONPATH": str(ROOT),
    "DJANGO_SETTINGS_MODULE": "bench.settings",
    "BENCH_DB": "postgres",
    "BENCH_DBNAME": DBNAME,
}


def recreate_database() -> None:
    with psycopg.connect("host=127.0.0.1 user=postgres dbname=postgres", autocommit=True) as conn:
        conn.execute(f"DROP DATABASE IF EXISTS {DBNAME} WITH (FORCE)")
        conn.execute(f"CREATE DATABASE {DBNAME}")


def setup_django() -> None:
    os.environ.update(ENV)
    sys.path.insert(0, str(ROOT))
    import django

    django.setup()
    from django.core.management import call_command

    call_command("migrate", verbosity=0)


def percentiles(values: list[float]) -> str:
    values = sorted(values)
    p50 = statistics.median(values)
    p95 = values[min(len(values) - 1, int(len(values) * 0.95))]
    return f"p50 {p50 * 1000:.2f} ms, p95 {p95 * 1000:.2f} ms ({len(values):,} claims)"


def keys(jobs: int = 20000, key_count: int = 1000, workers: int = 4) -> None:
    """(b) Drain ``jobs`` no-op jobs spread over ``key_count`` keys (limit 1) with ``workers`` processes."""
    recreate_database()
    enqueue = (
        "import django; django.setup()\n"
        "from django.core.management import call_command; call_command('migrate', verbosity=0)\n"
        "from django_dbqueue import enqueue_many\n"
        "from bench.benchapp.jobs import keyed\n"
        f"enqueue_many(keyed.bind(i, i % {key_count}) for i in range({jobs}))\n"
    )
    subprocess.run([sys.executable, "-c", enqueue], env=ENV, cwd=ROOT, check=True)
    with tempfile.TemporaryDirectory() as folder:
        times = Path(folder) / "claims.txt"
        argv = [sys.executable, "-m", "django", "queue_work", "--queue", "bench-keyed"]
        argv += ["--stop-when-empty", "--sleep", "0", "-v", "0"]
        started = time.monotonic()
        procs = [subprocess.Popen(argv, env={**ENV, "BENCH_CLAIM_TIMES": str(times)}, cwd=ROOT) for _ in range(workers)]
        for proc in procs:
            proc.wait()
        elapsed = time.monotonic() - started
        claim_times = [float(line) for line in times.read_text().split()]
    print(
        f"(b) {jobs:,} jobs over {key_count:,} keys (limit 1), {workers} workers: "
        f"{jobs / elapsed:,.0f} jobs/s (worker start-up included); claim {percentiles(claim_times)}"
    )


def _insert(cursor: psycopg.Cursor, count: int, priority: int, *, delay: str = "0", key: str | None = None) -> None:
    cursor.execute(
        "INSERT INTO dbqueue_job (queue, name, payload, priority, attempts, given_back, cancel, exceptions, "
        "retry_after, available_at, created_at, reserved_by, unique_until_start, blocked, concurrency_key, "
        "concurrency_limit) "
        "SELECT 'default', 'bench.noop', '{\"v\":1,\"args\":[0],\"kwargs\":{}}', %s, 0, 0, 0, 0, 60, "
        f"now() + interval '{delay} seconds', now(), '', false, false, "
        "CASE WHEN %s::text IS NULL THEN NULL ELSE %s || (n %% 100) END, "
        "CASE WHEN %s::text IS NULL THEN NULL ELSE 1 END "
        "FROM generate_series(1, %s) AS n",
        [priority, key, key, key, count],
    )


def _explain(sql: str, params: list[object]) -> str:
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute("BEGIN")
        cursor.execute(f"EXPLAIN (ANALYZE, COSTS OFF, TIMING OFF, SUMMARY ON) {sql}", params)
        plan = "\n".join("      " + row[0] for row in cursor.fetchall())
        cursor.execute("ROLLBACK")
    return plan


def saturated(claims_count: int = 300) -> None:
    """(c) Claim one job at a time with 100,000 waiting jobs of 100 saturated keys in front of 1,000 others."""
    recreate_database()
    setup_django()
    from django.db import connection

    from django_dbqueue import claims
    from django_dbqueue.models import Job

    with connection.cursor() as cursor:
        _insert(cursor, 100_000, 10, key="k")
        # The running job of each key: reserved a moment ago, so every key is at its limit.
        cursor.execute(
            "UPDATE dbqueue_job SET reserved_at = now(), attempts = 1 "
            "WHERE id IN (SELECT min(id) FROM dbqueue_job GROUP BY concurrency_key)"
        )
        _insert(cursor, 1_000, 0)
        cursor.execute("ANALYZE dbqueue_job")
    claims.use_flow_claim("default")
    times = []
    for _ in range(claims_count):
        started = time.perf_counter()
        (job,) = claims.reserve_many(["default"], limit=1)
        times.append(time.perf_counter() - started)
        assert job.concurrency_key is None
    blocked = Job.objects.filter(blocked=True).count()
    print(
        f"(c) 100,000 jobs of 100 saturated keys (priority 10) in front of 1,000 without keys: first claim "
        f"{times[0] * 1000:.0f} ms (it blocks {blocked:,} rows); then {percentiles(times[1:])}"
    )
    from django.db import transaction

    with transaction.atomic():
        queryset = claims.plain.candidates(connection.alias, "default", 1 + claims.flow.FLOW_LOOKAHEAD)
        sql, params = queryset.select_for_update(skip_locked=True).query.sql_with_params()
    print("    EXPLAIN ANALYZE of the flow claim's candidate query:\n" + _explain(sql, list(params)))


def delayed(claims_count: int = 300) -> None:
    """(d) Claim one job at a time with 100,000 delayed jobs of a higher priority in front of 1,000 waiting:
    the one-scan statement, the priority walk, and ``claims.claim``, which takes the walk once a scan was slow."""
    recreate_database()
    setup_django()
    from django.db import connection

    from django_dbqueue import claims

    with connection.cursor() as cursor:
        _insert(cursor, 100_000, 10, delay="3600")
        _insert(cursor, 1_000, 0)
        cursor.execute("ANALYZE dbqueue_job")
    results: dict[str, list[float]] = {"one scan": [], "priority walk": [], "claims.claim": []}
    with connection.cursor() as cursor:
        for _ in range(claims_count):
            for name, walk in (("one scan", False), ("priority walk", True)):
                started = time.perf_counter()
                cursor.execute(
                    claims.plain.claim_sql(connection, walk=walk),
                    claims.plain.claim_params("w", "default", 1, walk=walk),
                )
                cursor.fetchall()
                results[name].append(time.perf_counter() - started)
            started = time.perf_counter()
            claims.reserve_many(["default"], limit=1)
            results["claims.claim"].append(time.perf_counter() - started)
    for name, times in results.items():
        print(
            f"(d) 100,000 delayed jobs (priority 10) in front of 1,000 waiting (priority 0), {name}: "
            f"{percentiles(times)}"
        )
    for name, walk in (("one scan", False), ("priority walk", True)):
        plan = _explain(
            claims.plain.claim_sql(connection, walk=walk), claims.plain.claim_params("w", "default", 1, walk=walk)
        )
        print(f"    EXPLAIN ANALYZE, {name}:\n{plan}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("parts", nargs="*", metavar="{keys,saturated,delayed}", default=[])
    args = parser.parse_args()
    parts = args.parts or ["keys", "saturated", "delayed"]
    # Each part in a process of its own: Django is set up once per process.
    if len(parts) > 1:
        for part in parts:
            subprocess.run([sys.executable, __file__, part], check=True)
        return
    {"keys": keys, "saturated": saturated, "delayed": delayed}[parts[0]]()


if __name__ == "__main__":
    main()
