"""Helpers every driver shares. Standard library only, except psycopg where PostgreSQL is used."""

from __future__ import annotations

import json
import os
import random
import sys
import time
from collections.abc import Callable
from typing import Any

PGHOST = os.environ.get("BENCH_PGHOST", "127.0.0.1")
PGPORT = os.environ.get("BENCH_PGPORT", "5432")
PGUSER = os.environ.get("BENCH_PGUSER", "postgres")
RESULT_PREFIX = "BENCH_RESULT "


def conninfo(dbname: str) -> str:
    return f"host={PGHOST} port={PGPORT} user={PGUSER} dbname={dbname}"


def check_name(dbname: str) -> None:
    if not dbname or dbname.startswith("test") or dbname in {"postgres", "template0", "template1", "mysql"}:
        raise SystemExit(f"refusing to drop or create database {dbname!r}: not a benchmark database")


def pg_recreate(dbname: str) -> None:
    """Drop and create a PostgreSQL database of the benchmark (never test*)."""
    import psycopg

    check_name(dbname)
    with psycopg.connect(conninfo("postgres"), autocommit=True) as conn:
        conn.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = %s AND pid <> pg_backend_pid()",
            (dbname,),
        )
        conn.execute(f'DROP DATABASE IF EXISTS "{dbname}"')
        conn.execute(f'CREATE DATABASE "{dbname}"')


def pg_execute(dbname: str, *statements: str) -> list[Any]:
    """Run statements in autocommit on ``dbname``; return the first row of the last one."""
    import psycopg

    row = None
    with psycopg.connect(conninfo(dbname), autocommit=True) as conn:
        for statement in statements:
            cursor = conn.execute(statement)
            row = cursor.fetchone() if cursor.description else None
    return list(row) if row else []


def pg_settle(dbname: str) -> None:
    """After a fill: VACUUM ANALYZE and CHECKPOINT, so every system starts from the same state."""
    pg_execute(dbname, "VACUUM ANALYZE", "CHECKPOINT")


def emit(result: dict[str, Any]) -> None:
    """Hand a result to the orchestrator (one JSON line on stdout)."""
    sys.stdout.write(RESULT_PREFIX + json.dumps(result) + "\n")
    sys.stdout.flush()


def timed(action: Callable[[], Any]) -> float:
    started = time.perf_counter()
    action()
    return time.perf_counter() - started


def percentile(values: list[float], p: float) -> float:
    """The p-th percentile (0-100), linear interpolation between closest ranks."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    k = (len(ordered) - 1) * p / 100
    low = int(k)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (k - low)


def latency_run(
    enqueue: Callable[[int, float], Any], count: int, path: str, *, gap_min: float, gap_max: float, wait: float = 30.0
) -> dict[str, Any]:
    """Enqueue ``count`` latency jobs one at a time with random gaps; read back when each started.

    ``enqueue(tag, enqueued_at)`` stores one job that appends ``tag enqueued_at started``
    to ``path`` when it starts (a worker on the same host, so time.time() is one clock).
    The enqueue time is taken before the enqueue call, so the latency includes the commit.
    """
    rng = random.Random(7)
    for tag in range(count):
        enqueue(tag, time.time())
        time.sleep(rng.uniform(gap_min, gap_max))
    deadline = time.monotonic() + wait
    rows: dict[int, tuple[float, float]] = {}
    while time.monotonic() < deadline:
        rows = read_latency_file(path)
        if len(rows) >= count:
            break
        time.sleep(0.05)
    latencies = [(started - enqueued) * 1000 for enqueued, started in rows.values()]
    return {
        "jobs": count,
        "started": len(rows),
        "p50_ms": percentile(latencies, 50),
        "p95_ms": percentile(latencies, 95),
        "p99_ms": percentile(latencies, 99),
        "max_ms": max(latencies) if latencies else float("nan"),
        "gap_ms": [gap_min * 1000, gap_max * 1000],
    }


def read_latency_file(path: str) -> dict[int, tuple[float, float]]:
    rows: dict[int, tuple[float, float]] = {}
    try:
        with open(path) as lines:
            for line in lines:
                parts = line.split()
                if len(parts) == 3:
                    rows[int(parts[0])] = (float(parts[1]), float(parts[2]))
    except FileNotFoundError:
        pass
    return rows
