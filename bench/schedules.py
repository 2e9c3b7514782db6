"""What periodic schedules cost the workers: the drain rate of ordinary jobs with 0 and with N
schedules declared, and the scheduler's own statements per minute per worker.

Each repeat drains the same no-op jobs with 4 ``queue_work --stop-when-empty`` processes on
PostgreSQL, once without schedules and once with ``--schedules`` every-minute schedules (their
jobs go to a queue the workers do not serve, so only the ticking is measured); the variants
alternate, so they share the machine's state. Then one worker idles for ``--idle`` seconds with
the schedules declared and reports its ticker's statements (``ticker stopped ... per_minute=``).

    .venv/bin/python bench/schedules.py                        # full: 20,000 jobs, 1,000 schedules, 3 repeats
    .venv/bin/python bench/schedules.py --jobs 2000 --schedules 50 --repeats 1 --idle 20   # a quick look
    .venv/bin/python bench/schedules.py --steady 5 --jobs 40000 --repeats 5   # running workers, rows kept

Without ``--steady`` each drain starts its workers and deletes the schedules' rows first, so it
also measures what a deploy of 1,000 new schedules costs at start (4 workers writing them).
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

import psycopg

ROOT = Path(__file__).resolve().parent.parent
DBNAME = "dbqueue_bench_schedules"
WORKERS = 4

SETUP = """
import django
django.setup()
from django.core.management import call_command
call_command("migrate", verbosity=0)
from django_dbqueue.models import Job, ScheduleState
Job.objects.all().delete()
ScheduleState.objects.all().delete()
from django_dbqueue import enqueue_many
from bench.benchapp.jobs import noop
enqueue_many(noop.bind(i) for i in range({jobs}))
"""


def recreate_database() -> None:
    with psycopg.connect("host=127.0.0.1 user=postgres dbname=postgres", autocommit=True) as conn:
        conn.execute(f"DROP DATABASE IF EXISTS {DBNAME} WITH (FORCE)")
        conn.execute(f"CREATE DATABASE {DBNAME}")


def env(schedules: int) -> dict[str, str]:
    return {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "DJANGO_SETTINGS_MODULE": "bench.settings",
        "BENCH_DB": "postgres",
        "BENCH_DBNAME": DBNAME,
        "BENCH_SCHEDULES": str(schedules) if schedules else "",
    }


def worker(schedules: int, *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "django", "queue_work", "--queue", "default", *args],
        cwd=ROOT,
        env=env(schedules),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def drain(jobs: int, schedules: int) -> float:
    """Jobs per second of 4 workers draining ``jobs`` no-op jobs, startup included."""
    subprocess.run([sys.executable, "-c", SETUP.format(jobs=jobs)], cwd=ROOT, env=env(0), check=True)
    started = time.monotonic()
    processes = [worker(schedules, "--stop-when-empty", "--sleep", "0.05") for _ in range(WORKERS)]
    for process in processes:
        output, _ = process.communicate(timeout=1800)
        if process.returncode != 0:
            raise SystemExit(f"a worker failed:\n{output}")
    return jobs / (time.monotonic() - started)


ENQUEUE = """
import time
import django
django.setup()
from django_dbqueue.models import Job
Job.objects.all().delete()
from django_dbqueue import enqueue_many
from bench.benchapp.jobs import noop
enqueue_many(noop.bind(i) for i in range({jobs}))
print(time.time())
"""


def drain_steady(jobs: int, schedules: int, warm: float) -> float:
    """Jobs per second of 4 running workers that have ticked their schedules for ``warm``
    seconds (the schedules' rows kept from earlier runs, as in a deployment): timed from
    the commit of the enqueue (one transaction) to an empty queue."""
    # -v 0: no line per job (nobody reads the pipe until the end).
    processes = [worker(schedules, "--sleep", "0.05", "-v", "0") for _ in range(WORKERS)]
    try:
        time.sleep(warm)
        enqueue = subprocess.run(
            [sys.executable, "-c", ENQUEUE.format(jobs=jobs)], cwd=ROOT, env=env(0), check=True, capture_output=True
        )
        committed = float(enqueue.stdout.split()[-1])
        with psycopg.connect(f"host=127.0.0.1 user=postgres dbname={DBNAME}", autocommit=True) as conn:
            while conn.execute("SELECT EXISTS (SELECT 1 FROM dbqueue_job WHERE queue = 'default')").fetchone()[0]:
                time.sleep(0.01)
        return jobs / (time.time() - committed)
    finally:
        for process in processes:
            process.terminate()
        for process in processes:
            process.communicate(timeout=120)


def idle_statements(schedules: int, seconds: float) -> str:
    """The ticker's own log line of one worker that idles ``seconds`` with the schedules declared."""
    subprocess.run([sys.executable, "-c", SETUP.format(jobs=0)], cwd=ROOT, env=env(0), check=True)
    output, _ = worker(schedules, "--max-time", str(seconds)).communicate(timeout=seconds + 600)
    found = re.search(r"ticker stopped .*", output)
    return found.group(0) if found else f"no ticker line in:\n{output}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--jobs", type=int, default=20_000)
    parser.add_argument("--schedules", type=int, default=1000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--idle", type=float, default=130.0, help="seconds one worker idles with the schedules")
    parser.add_argument(
        "--steady",
        type=float,
        default=0,
        metavar="SECONDS",
        help="time drains of running workers that ticked for SECONDS first (rows kept), not from their start",
    )
    options = parser.parse_args()
    recreate_database()
    if options.steady:
        # The schedules' rows exist, as after a first deploy.
        subprocess.run([sys.executable, "-c", SETUP.format(jobs=0)], cwd=ROOT, env=env(0), check=True)
        drain_steady(100, options.schedules, options.steady)
    rates: dict[int, list[float]] = {0: [], options.schedules: []}
    for repeat in range(options.repeats):
        # Each variant goes first in turn: the database and the machine drift within a run.
        for count in list(rates)[repeat % 2 :] + list(rates)[: repeat % 2]:
            if options.steady:
                rates[count].append(drain_steady(options.jobs, count, options.steady))
            else:
                rates[count].append(drain(options.jobs, count))
            print(f"repeat {repeat + 1}: {count} schedules: {rates[count][-1]:.0f} jobs/s", flush=True)
    base = statistics.median(rates[0])
    loaded = statistics.median(rates[options.schedules])
    print(f"median jobs/s, {WORKERS} workers, {options.jobs} jobs: 0 schedules {base:.0f}, ", end="")
    print(f"{options.schedules} schedules {loaded:.0f} ({(loaded - base) / base * 100:+.1f} %)")
    print(f"one worker idle {options.idle:g} s with {options.schedules} every-minute schedules:")
    print("  " + idle_statements(options.schedules, options.idle))


if __name__ == "__main__":
    main()
