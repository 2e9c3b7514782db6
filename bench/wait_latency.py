"""How soon ``handle.wait()`` in another process returns after a job's outcome commits (PostgreSQL).

Three processes: this one enqueues, one by one, ``--jobs`` no-op jobs that keep their results
(``DBQUEUE["RESULTS"]``), each available 0.2 s after its enqueue so that the waiter is already
in ``wait()``; a waiter process (``python -m bench.wait_latency waiter``) is handed each job's
id and calls ``get_job(id).wait()``, printing ``time.time()`` as it returns; one ``queue_work``
process runs the jobs. The latency of a job is that time less its result record's
``finished_at``, set by the database's clock in the outcome's transaction (so the commit is
inside the figure; same host, same clock). Prints p50, p95 and max; the issue's target is 50 ms.
See docs/performance.md, "Waiting for a result".

    python -m bench.wait_latency [--jobs 200] [--listen on|off]
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
DBNAME = "dbqueue_bench_wait"
# Seconds between an enqueue and its job's availability: the waiter is listening by then.
DELAY = 0.2


def environment(listen: bool) -> dict[str, str]:
    return {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "DJANGO_SETTINGS_MODULE": "bench.settings",
        "BENCH_DB": "postgres",
        "BENCH_DBNAME": DBNAME,
        "BENCH_RESULTS": "1",
        "BENCH_LISTEN": "1" if listen else "0",
    }


def recreate_database() -> None:
    with psycopg.connect("host=127.0.0.1 user=postgres dbname=postgres", autocommit=True) as conn:
        conn.execute(f"DROP DATABASE IF EXISTS {DBNAME} WITH (FORCE)")
        conn.execute(f"CREATE DATABASE {DBNAME}")


def setup_django(listen: bool) -> None:
    os.environ.update(environment(listen))
    import django
    from django.conf import settings
    from django.test import override_settings

    django.setup()
    if not listen:
        # For this process alone (the waiter's choice): wait() polls.
        override_settings(DBQUEUE={**settings.DBQUEUE, "LISTEN": False}).enable()


def waiter() -> None:
    """Wait for each job id read from stdin; print the id and the time ``wait()`` returned."""
    setup_django(os.environ.get("BENCH_LISTEN") != "0")
    from django_dbqueue import get_job

    print("ready", flush=True)
    for line in sys.stdin:
        handle = get_job(int(line))
        handle.wait(timeout=30)
        returned = time.time()
        print(f"{handle.id} {returned!r} {handle.status}", flush=True)


def percentile(values: list[float], share: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(share * (len(ordered) - 1)))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("role", nargs="?", default="main", choices=["main", "waiter"])
    parser.add_argument("--jobs", type=int, default=200)
    parser.add_argument("--listen", choices=["on", "off"], default="on", help="LISTEN on PostgreSQL (default on)")
    args = parser.parse_args()
    if args.role == "waiter":
        waiter()
        return
    listen = args.listen == "on"
    recreate_database()
    env = environment(listen)
    subprocess.run([sys.executable, "-m", "django", "migrate", "-v", "0"], env=env, cwd=ROOT, check=True)
    setup_django(listen)
    from bench.benchapp.jobs import noop
    from django_dbqueue.models import TaskResultRecord, record_id

    python = [sys.executable, "-m"]
    worker = subprocess.Popen([*python, "django", "queue_work", "--sleep", "0.05", "-v", "0"], env=env, cwd=ROOT)
    wait = subprocess.Popen(
        [*python, "bench.wait_latency", "waiter"], env=env, cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE
    )
    assert wait.stdin is not None and wait.stdout is not None
    latencies: list[float] = []
    try:
        assert wait.stdout.readline().strip() == b"ready"
        for i in range(args.jobs):
            handle = noop.using(delay=DELAY).enqueue(i)
            wait.stdin.write(f"{handle.id}\n".encode())
            wait.stdin.flush()
            job_id, returned, status = wait.stdout.readline().decode().split()
            assert int(job_id) == handle.id and status == "succeeded", (job_id, status)
            finished = TaskResultRecord.objects.get(pk=record_id(handle.id)).finished_at
            latencies.append(float(returned) - finished.timestamp())
    finally:
        wait.stdin.close()
        for process in (wait, worker):
            process.terminate()
            try:
                process.wait(10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
    ms = [value * 1000 for value in latencies]
    print(
        f"{len(ms)} jobs, LISTEN {args.listen}: from the outcome's finished_at to wait() returning in another "
        f"process: p50 {percentile(ms, 0.5):.1f} ms, p95 {percentile(ms, 0.95):.1f} ms, max {max(ms):.1f} ms "
        f"(mean {statistics.mean(ms):.1f} ms, min {min(ms):.1f} ms)"
    )


if __name__ == "__main__":
    main()
