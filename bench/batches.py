"""What a batch costs: enqueueing its members, and draining them, against the same plain jobs.

    .venv/bin/python bench/batches.py                    # PostgreSQL: 10,000 jobs, 4 workers, median of 3
    .venv/bin/python bench/batches.py --repeat 5 --parts drain
    BENCH_DB=sqlite .venv/bin/python bench/batches.py     # or BENCH_DB=mysql (bench/settings.py)

(1) enqueue: ``batch(*calls).enqueue()`` against ``enqueue_many(calls)`` of the
    same N no-op jobs (``bench.noop``, 1,000 rows an INSERT), timed in this
    process; the calls are built before the clock starts.
(2) drain: N members of one batch against N plain jobs of the same function,
    drained by W ``queue_work --sleep 0.01`` processes. The jobs are enqueued to
    a queue no worker serves; once every worker has started (its QueueWorker row
    is written), one UPDATE moves them to ``default``, and the clock runs from
    its commit until the job table is empty (checked every 10 ms): the workers'
    start-up is not in the figure.

Within a repeat the two variants take turns going first. Each measurement starts
from empty tables and, on PostgreSQL, a VACUUM ANALYZE and a CHECKPOINT.

On PostgreSQL the drain also reports:
- the UPDATEs of the batch row (``pg_stat_user_tables.n_tup_upd`` of
  ``dbqueue_batch``, read before and after with no other session open): a worker
  moves the counters once per statement that ends members, so members per update
  shows how often the batch row's lock is taken (once per worker round trip, not
  once per member);
- lock waits, sampled: the sessions of the benchmark database waiting for a lock
  (``pg_stat_activity.wait_event_type = 'Lock'``) at each 10 ms check, averaged.

The database is the benchmark's own, ``dbqueue_bench_batches`` (BENCH_DBNAME),
dropped and created at the start; never a database named test*.
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
os.environ.setdefault("BENCH_DBNAME", "dbqueue_bench_batches")
os.environ.setdefault("BENCH_DB", "postgres")
os.environ["DJANGO_SETTINGS_MODULE"] = "bench.settings"
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.drivers import dbqueue as driver  # noqa: E402 - reads BENCH_DB and BENCH_DBNAME on import
from bench.drivers.common import conninfo  # noqa: E402

BENCH_DB = driver.BENCH_DB
DBNAME = driver.DBNAME
DB_LABEL = {"postgres": "PostgreSQL", "mysql": "MariaDB/MySQL", "sqlite": "SQLite"}[BENCH_DB]
WORKER_ENV = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"}
# The queue jobs wait in until every worker has started.
HOLD = "bench-hold"
CHECK = 0.01


# -- the database ---------------------------------------------------------------


def clear() -> None:
    """Empty the queue's tables (jobs, batches, failed jobs)."""
    from django.db import connection

    tables = ["dbqueue_job", "dbqueue_batch", "dbqueue_failed_job"]
    with connection.cursor() as cursor:
        if BENCH_DB == "postgres":
            cursor.execute(f"TRUNCATE TABLE {', '.join(tables)}")
        else:
            for table in tables:
                cursor.execute(f"DELETE FROM {table}" if BENCH_DB == "sqlite" else f"TRUNCATE TABLE {table}")


def pg_batch_updates() -> int:
    """UPDATEs of dbqueue_batch rows so far, once every other session ended (a session's
    statistics reach pg_stat_* when it ends)."""
    import psycopg
    from django.db import connection

    connection.close()
    with psycopg.connect(conninfo("postgres"), autocommit=True) as conn:
        for _ in range(200):
            row = conn.execute("SELECT count(*) FROM pg_stat_activity WHERE datname = %s", (DBNAME,)).fetchone()
            if row and row[0] == 0:
                break
            time.sleep(0.05)
        else:
            raise RuntimeError(f"sessions on {DBNAME} did not end within 10 s")
    with psycopg.connect(conninfo(DBNAME), autocommit=True) as conn:
        row = conn.execute("SELECT n_tup_upd FROM pg_stat_user_tables WHERE relname = 'dbqueue_batch'").fetchone()
    return int(row[0]) if row else 0


# -- (1) enqueue --------------------------------------------------------------


def calls(jobs: int, queue: str = "default") -> list[Any]:
    from bench.benchapp.jobs import noop

    job = noop if queue == "default" else noop.using(queue=queue)
    return [job.bind(i) for i in range(jobs)]


def enqueue(kind: str, prepared: list[Any]) -> None:
    """Store ``prepared`` calls as the members of one batch (``kind="batch"``) or with enqueue_many."""
    from django_dbqueue import batch, enqueue_many

    if kind == "batch":
        batch(*prepared, name="bench").enqueue(batch_size=1000)
    else:
        enqueue_many(prepared, batch_size=1000)


def timed_enqueue(kind: str, jobs: int) -> float:
    """Seconds to enqueue ``jobs`` no-op jobs (see ``enqueue``), from empty tables."""
    from django_dbqueue.models import Job

    clear()
    driver.settle()
    prepared = calls(jobs)
    started = time.perf_counter()
    enqueue(kind, prepared)
    seconds = time.perf_counter() - started
    stored = Job.objects.count()
    if stored != jobs:
        raise RuntimeError(f"{kind}: {stored} jobs stored, not {jobs}")
    return seconds


# -- (2) drain ----------------------------------------------------------------


class Workers:
    """``count`` queue_work processes on the default queue, started and registered on entering
    the ``with``, stopped (SIGTERM, by their ids) on leaving it."""

    def __init__(self, count: int, extra: list[str], log: Path) -> None:
        self.count, self.extra, self.log = count, extra, log
        self.procs: list[subprocess.Popen[bytes]] = []

    def __enter__(self) -> Workers:
        from django_dbqueue.models import QueueWorker

        argv = [sys.executable, "-m", "django", "queue_work", "--sleep", str(CHECK), "-v", "0", *self.extra]
        self.out = open(self.log, "wb")
        self.procs = [
            subprocess.Popen(argv, cwd=ROOT, env=WORKER_ENV, stdout=self.out, stderr=subprocess.STDOUT)
            for _ in range(self.count)
        ]
        deadline = time.monotonic() + 120
        while QueueWorker.objects.count() < self.count:
            if time.monotonic() > deadline or self.exited():
                self.__exit__()
                raise RuntimeError(f"the workers did not all start:\n{self.tail()}")
            time.sleep(0.05)
        return self

    def __exit__(self, *exc: object) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in self.procs:
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self.out.close()

    def exited(self) -> bool:
        return any(proc.poll() is not None for proc in self.procs)

    def tail(self) -> str:
        self.out.flush()
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-10:])


def drain(kind: str, jobs: int, workers: int, extra: list[str], log: Path) -> dict[str, Any]:
    """Drain ``jobs`` no-op jobs (the members of one batch, or plain) with started workers;
    return the seconds, and on PostgreSQL the batch row's UPDATEs and the lock-wait samples."""
    from django.db import connection

    from django_dbqueue.models import Job, JobBatch

    clear()
    enqueue(kind, calls(jobs, queue=HOLD))
    driver.settle()
    postgres = BENCH_DB == "postgres"
    before = pg_batch_updates() if postgres else 0
    waiting: list[int] = []
    with Workers(workers, extra, log) as started, connection.cursor() as cursor:
        cursor.execute("UPDATE dbqueue_job SET queue = %s WHERE queue = %s", ["default", HOLD])
        begun = time.monotonic()  # in autocommit: the jobs can be claimed from here
        while True:
            if postgres:
                cursor.execute(
                    "SELECT EXISTS (SELECT 1 FROM dbqueue_job), (SELECT count(*) FROM pg_stat_activity "
                    "WHERE datname = current_database() AND wait_event_type = 'Lock')"
                )
                left, locked = cursor.fetchone()
                waiting.append(int(locked))
            else:
                cursor.execute("SELECT EXISTS (SELECT 1 FROM dbqueue_job)")
                (left,) = cursor.fetchone()
            if not left:
                break
            if time.monotonic() - begun > 600 or started.exited():
                raise RuntimeError(f"{kind}: the drain did not end:\n{started.tail()}")
            time.sleep(CHECK)
        seconds = time.monotonic() - begun
    if kind == "batch":
        row = JobBatch.objects.get()
        if row.finished_at is None or row.pending or row.failed or row.total != jobs:
            raise RuntimeError(f"the batch did not finish cleanly: {row.state}, {row.done} of {row.total} done")
    if Job.objects.exists():
        raise RuntimeError(f"{kind}: jobs left after the drain")
    result: dict[str, Any] = {"seconds": seconds}
    if postgres:
        result["updates"] = pg_batch_updates() - before
        result["lock_waits"] = statistics.fmean(waiting) if waiting else 0.0
    return result


# -- the run ------------------------------------------------------------------


def turns(repeat: int, kinds: list[str]) -> list[str]:
    """The variants in this repeat's order: each goes first in turn (the machine's state drifts)."""
    shift = repeat % len(kinds)
    return kinds[shift:] + kinds[:shift]


def rate(jobs: int, seconds: float) -> float:
    return jobs / max(seconds, 1e-6)


def run_enqueue(args: argparse.Namespace, say: Callable[[str], None]) -> None:
    kinds = ["enqueue_many", "batch"]
    for kind in kinds:  # the first enqueue of each kind warms this process's code paths and caches
        timed_enqueue(kind, min(args.jobs, 500))
    seconds: dict[str, list[float]] = {kind: [] for kind in kinds}
    for repeat in range(args.repeat):
        for kind in turns(repeat, kinds):
            seconds[kind].append(timed_enqueue(kind, args.jobs))
        say(
            f"repeat {repeat + 1}: enqueue_many {rate(args.jobs, seconds['enqueue_many'][-1]):,.0f} jobs/s, "
            f"batch {rate(args.jobs, seconds['batch'][-1]):,.0f} jobs/s, "
            f"batch/enqueue_many {seconds['enqueue_many'][-1] / seconds['batch'][-1]:.2f}"
        )
    plain, members = statistics.median(seconds["enqueue_many"]), statistics.median(seconds["batch"])
    say(f"\n(1) enqueue {args.jobs:,} no-op jobs in this process, {DB_LABEL}; median of {args.repeat}:")
    say(f"  enqueue_many(calls)      {rate(args.jobs, plain):9,.0f} jobs/s  {plain:7.3f} s")
    say(
        f"  batch(*calls).enqueue()  {rate(args.jobs, members):9,.0f} jobs/s  {members:7.3f} s  "
        f"batch/enqueue_many {plain / members:.2f}"
    )


def run_drain(args: argparse.Namespace, say: Callable[[str], None]) -> None:
    kinds = ["plain", "batch"]
    extra = ["--batch", str(args.worker_batch)] if args.worker_batch else []
    results: dict[str, list[dict[str, Any]]] = {kind: [] for kind in kinds}
    with tempfile.TemporaryDirectory() as folder:
        log = Path(folder) / "workers.log"
        for repeat in range(args.repeat):
            parts = []
            for kind in turns(repeat, kinds):
                result = drain(kind, args.jobs, args.workers, extra, log)
                results[kind].append(result)
                parts.append(f"{kind} {rate(args.jobs, result['seconds']):,.0f} jobs/s ({result['seconds']:.2f} s)")
                if kind == "batch" and "updates" in result:
                    parts.append(f"batch row updates {result['updates']:,}")
            ratio = results["plain"][-1]["seconds"] / results["batch"][-1]["seconds"]
            say(f"repeat {repeat + 1}: {', '.join(parts)}, batch/plain {ratio:.2f}")

    def middle(kind: str, key: str) -> float:
        return statistics.median(result[key] for result in results[kind])

    plain, members = middle("plain", "seconds"), middle("batch", "seconds")
    batch_option = f" --batch {args.worker_batch}" if args.worker_batch else ""
    say(
        f"\n(2) drain {args.jobs:,} no-op jobs with {args.workers} started workers "
        f"(queue_work --sleep {CHECK}{batch_option}), {DB_LABEL}; median of {args.repeat}:"
    )
    say(f"  plain jobs               {rate(args.jobs, plain):9,.0f} jobs/s  {plain:7.3f} s")
    say(
        f"  members of one batch     {rate(args.jobs, members):9,.0f} jobs/s  {members:7.3f} s  "
        f"batch/plain {plain / members:.2f}"
    )
    if BENCH_DB == "postgres":
        updates = middle("batch", "updates")
        say(
            f"  batch row UPDATEs in the drain: {updates:,.0f}, {args.jobs / max(updates, 1):.1f} members an update "
            "(the finish is one of them)"
        )
        say(
            "  sessions waiting for a lock, mean of the 10 ms samples: "
            f"plain {middle('plain', 'lock_waits'):.2f}, batch {middle('batch', 'lock_waits'):.2f}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--jobs", type=int, default=10_000, help="jobs (members) per measurement (default: 10000)")
    parser.add_argument("--workers", type=int, default=4, help="worker processes per drain (default: 4)")
    parser.add_argument("--repeat", type=int, default=3, help="repeats; medians are reported (default: 3)")
    parser.add_argument(
        "--worker-batch", type=int, default=0, help="queue_work --batch N in the drains (default: queue_work's own)"
    )
    parser.add_argument("--parts", default="enqueue,drain", help="enqueue, drain or enqueue,drain (default: both)")
    args = parser.parse_args()
    parts = {part.strip() for part in args.parts.split(",") if part.strip()}
    if not parts or parts - {"enqueue", "drain"}:
        parser.error("--parts takes enqueue, drain or enqueue,drain")
    if min(args.jobs, args.workers, args.repeat) < 1 or args.worker_batch < 0:
        parser.error("--jobs, --workers and --repeat must be at least 1")

    def say(text: str) -> None:
        print(text, flush=True)

    driver.recreate_database()
    say(f"{DB_LABEL} ({DBNAME}): {args.jobs:,} jobs, {args.workers} workers, {args.repeat} repeats")
    if "enqueue" in parts:
        run_enqueue(args, say)
    if "drain" in parts:
        if "enqueue" in parts:
            say("")
        run_drain(args, say)


if __name__ == "__main__":
    main()
