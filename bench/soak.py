"""Soak: worker processes drain 50,000 jobs of mixed outcomes on PostgreSQL; the counts must add up.

Not a test: it prints figures. It enqueues jobs that succeed, fail once then
succeed, or fail for good (tests/testapp/jobs.py: record, fail_once,
always_fail), runs ``queue_work --concurrency 4`` until the queue is empty,
then checks that deleted + failed == enqueued exactly, that each kind of job
made exactly the attempts it should, and reports the resident memory (VmRSS)
of each worker process at its start, after a warm-up, at the end and at its
peak, and the elapsed time.

Run from the repository root (PostgreSQL at 127.0.0.1:5432, or PGHOST/PGPORT/PGUSER):

    .venv/bin/python bench/soak.py [--jobs 50000] [--concurrency 4]

It uses tests.settings on a database of its own (``dbqueue_soak``, or
--database), which it creates, migrates and drops at the end (--keep keeps it).
Exit code 0 when every check holds, 1 otherwise.

The job table is analyzed after the enqueue, as autovacuum would soon do: on a
table bulk-loaded without statistics the planner sorts every waiting row at
each claim (80 ms a claim with 28,000 jobs waiting). When the server runs
without autovacuum, the soak stands in for it during the drain with a
``VACUUM ANALYZE`` of the job table every --vacuum-every seconds.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
# One job in ten fails once then succeeds, one in ten fails for good (tries=2).
KINDS = ("succeed",) * 8 + ("fail_once", "fail_for_good")
# Share of the jobs after which the "warm" memory figure is taken.
WARM_SHARE = 0.1


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--jobs", type=int, default=50_000, help="jobs to enqueue (default: 50000)")
    parser.add_argument("--concurrency", type=int, default=4, help="worker processes (default: 4)")
    parser.add_argument(
        "--database", default="dbqueue_soak", help="database to create and drop (default: dbqueue_soak)"
    )
    parser.add_argument("--max-seconds", type=float, default=1800, help="give up after this long (default: 1800)")
    parser.add_argument(
        "--vacuum-every",
        type=float,
        default=None,
        help="seconds between two VACUUM ANALYZE of the job table during the drain "
        "(default: 30 when the server's autovacuum is off, else never)",
    )
    parser.add_argument("--keep", action="store_true", help="keep the database and the worker log")
    args = parser.parse_args()
    if args.database.startswith("test"):
        parser.error("the soak never uses a database whose name starts with 'test'")
    return args


def setup_django(database: str) -> None:
    os.environ.update(
        {
            "DJANGO_SETTINGS_MODULE": "tests.settings",
            "DBQUEUE_TEST_DB": "postgres",
            "PGDATABASE": database,
        }
    )
    os.environ.pop("DBQUEUE_TEST_USE_TEST_DB", None)
    sys.path.insert(0, str(ROOT))
    import django

    django.setup()


@contextmanager
def own_database(name: str, keep: bool) -> Iterator[None]:
    """Create ``name`` (dropping a leftover first), migrate it, and drop it afterwards."""
    import psycopg
    from django.core.management import call_command
    from django.db import connections
    from psycopg import sql

    settings = connections["default"].settings_dict
    server = {"host": settings["HOST"], "port": settings["PORT"], "user": settings["USER"], "dbname": "postgres"}

    def admin(statement: sql.Composed) -> None:
        with psycopg.connect(**server, autocommit=True) as conn:
            conn.execute(statement)

    admin(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name)))
    admin(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    try:
        call_command("migrate", verbosity=0)
        yield
    finally:
        connections.close_all()
        if not keep:
            admin(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name)))


def enqueue(total: int) -> dict[str, int]:
    from django_dbqueue import enqueue_many
    from tests.testapp import jobs

    counts = dict.fromkeys(KINDS, 0)
    calls = []
    for i in range(total):
        kind = KINDS[i % len(KINDS)]
        counts[kind] += 1
        if kind == "succeed":
            calls.append(jobs.record.bind(f"s{i}"))
        elif kind == "fail_once":
            calls.append(jobs.fail_once.bind(f"o{i}"))
        else:
            calls.append(jobs.always_fail.bind(f"f{i}"))
    for start in range(0, total, 5000):
        enqueue_many(calls[start : start + 5000])
    return counts


def children_of(pid: int) -> list[int]:
    result = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                result.append(int(entry.name))
    return sorted(result)


def rss_mb(pid: int) -> float | None:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    match = re.search(r"^VmRSS:\s+(\d+) kB", status, re.MULTILINE)
    return int(match.group(1)) / 1024 if match else None


class Memory:
    """VmRSS of each worker process: first sample, warm sample, last sample, peak."""

    def __init__(self) -> None:
        self.figures: dict[int, dict[str, float]] = {}

    def sample(self, pids: list[int], label: str | None = None) -> None:
        for pid in pids:
            rss = rss_mb(pid)
            if rss is None:
                continue
            figures = self.figures.setdefault(pid, {"start": rss, "peak": rss})
            figures["peak"] = max(figures["peak"], rss)
            figures["end"] = rss
            if label:
                figures[label] = rss


def vacuum_analyze() -> None:
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute("VACUUM ANALYZE dbqueue_job")


def drain(args: argparse.Namespace, total: int, log_path: Path) -> tuple[float, Memory, list[int], int]:
    """Run the workers until the queue is empty; return the seconds, the memory, the first pids, the exit code."""
    from django_dbqueue.models import Job

    memory = Memory()
    environment = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"}
    with open(log_path, "wb") as log:
        started = time.monotonic()
        supervisor = subprocess.Popen(
            [sys.executable, "-m", "django", "queue_work", "--concurrency", str(args.concurrency), "--sleep", "0.05"],
            cwd=ROOT,
            env=environment,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        try:
            while len(children_of(supervisor.pid)) < args.concurrency:
                if time.monotonic() - started > 30 or supervisor.poll() is not None:
                    raise RuntimeError(f"the workers did not start; see {log_path}")
                time.sleep(0.05)
            first = children_of(supervisor.pid)
            memory.sample(first)
            warm = False
            vacuumed = time.monotonic()
            while True:
                if args.vacuum_every and time.monotonic() - vacuumed >= args.vacuum_every:
                    vacuum_analyze()
                    vacuumed = time.monotonic()
                remaining = Job.objects.count()
                pids = children_of(supervisor.pid)
                if not warm and remaining <= total * (1 - WARM_SHARE):
                    memory.sample(pids, "warm")
                    warm = True
                else:
                    memory.sample(pids)
                if remaining == 0:
                    break
                if time.monotonic() - started > args.max_seconds:
                    raise RuntimeError(f"{remaining} jobs left after {args.max_seconds:.0f} s; see {log_path}")
                time.sleep(0.5)
            elapsed = time.monotonic() - started
            memory.sample(children_of(supervisor.pid), "end")
            supervisor.send_signal(signal.SIGTERM)
            code = supervisor.wait(timeout=120)
        finally:
            if supervisor.poll() is None:
                for pid in children_of(supervisor.pid):
                    os.kill(pid, signal.SIGKILL)
                supervisor.kill()
                supervisor.wait()
    return elapsed, memory, first, code


def check(counts: dict[str, int], log: str) -> tuple[list[str], dict[str, Any]]:
    """Return the failed checks and the figures."""
    from django.db.models import Count

    from django_dbqueue.models import FailedJob, Job
    from tests.testapp.models import Attempt, Run

    total = sum(counts.values())
    outcomes = {name: len(re.findall(rf" outcome={name} ", log)) for name in ("succeeded", "released", "failed")}
    figures: dict[str, Any] = {
        "left": Job.objects.count(),
        "deleted": outcomes["succeeded"],
        "runs": Run.objects.count(),
        "failed": FailedJob.objects.count(),
        "outcomes": outcomes,
        "attempts": dict(
            Attempt.objects.values("attempt").annotate(n=Count("id")).order_by("attempt").values_list("attempt", "n")
        ),
    }
    problems = []
    expect = {
        "left": 0,
        "deleted": counts["succeed"] + counts["fail_once"],
        "runs": counts["succeed"] + counts["fail_once"],
        "failed": counts["fail_for_good"],
    }
    for key, value in expect.items():
        if figures[key] != value:
            problems.append(f"{key}: {figures[key]}, expected {value}")
    if figures["deleted"] + figures["failed"] != total:
        problems.append(f"deleted + failed = {figures['deleted'] + figures['failed']}, enqueued {total}")
    # fail_once: attempts 1 and 2; always_fail (tries=2): two attempts, recorded as attempt 0.
    expected_attempts = {0: 2 * counts["fail_for_good"], 1: counts["fail_once"], 2: counts["fail_once"]}
    if figures["attempts"] != {k: v for k, v in expected_attempts.items() if v}:
        problems.append(f"attempts {figures['attempts']}, expected {expected_attempts}")
    wrong_failures = FailedJob.objects.exclude(name="tests.testapp.jobs.always_fail", attempts=2).count()
    if wrong_failures:
        problems.append(f"{wrong_failures} failed jobs are not always_fail after 2 attempts")
    expected_released = counts["fail_once"] + counts["fail_for_good"]
    if outcomes["released"] != expected_released:
        problems.append(f"{outcomes['released']} released outcomes, expected {expected_released}")
    for text in ("reclaimed", "reservation lost", "giving up", "worker process died", "Traceback"):
        if text in log:
            problems.append(f"{text!r} in the worker log")
    return problems, figures


def main() -> int:
    args = parse_args()
    setup_django(args.database)
    from django.db import connection

    log_path = Path(tempfile.gettempdir()) / f"dbqueue-soak-{os.getpid()}.log"
    with own_database(args.database, args.keep):
        server = connection.cursor().connection.info.server_version
        print(
            f"soak: {args.jobs} jobs on PostgreSQL {server // 10000}.{server % 10000}, "
            f"queue_work --concurrency {args.concurrency}, database {args.database}",
            flush=True,
        )
        enqueue_started = time.monotonic()
        counts = enqueue(args.jobs)
        print(
            f"enqueued in {time.monotonic() - enqueue_started:.1f} s: {counts['succeed']} succeed, "
            f"{counts['fail_once']} fail once then succeed, {counts['fail_for_good']} fail for good",
            flush=True,
        )
        vacuum_analyze()
        with connection.cursor() as cursor:
            cursor.execute("SHOW autovacuum")
            autovacuum = cursor.fetchone()[0] == "on"
        if args.vacuum_every is None:
            args.vacuum_every = 0 if autovacuum else 30
        print(
            f"job table analyzed; server autovacuum {'on' if autovacuum else 'off'}; "
            + (
                f"VACUUM ANALYZE of the job table every {args.vacuum_every:g} s during the drain"
                if args.vacuum_every
                else "no VACUUM by the soak during the drain"
            ),
            flush=True,
        )
        elapsed, memory, first, code = drain(args, args.jobs, log_path)
        log = log_path.read_text(errors="replace")
        problems, figures = check(counts, log)
    attempts = sum(figures["outcomes"].values())
    print(
        f"drained in {elapsed:.1f} s: {args.jobs / elapsed:.0f} jobs/s, {attempts / elapsed:.0f} attempts/s; "
        f"supervisor exit code {code}"
    )
    print(
        f"deleted {figures['deleted']} + failed {figures['failed']} = {figures['deleted'] + figures['failed']} "
        f"(enqueued {args.jobs}); left in the queue {figures['left']}; Run rows {figures['runs']}; "
        f"outcomes {figures['outcomes']}; attempt rows {figures['attempts']}"
    )
    print("worker RSS (MB):   pid   start    warm     end    peak   end-warm")
    for pid, values in sorted(memory.figures.items()):
        note = "" if pid in first else "  (a replacement)"
        warm = values.get("warm", values["start"])
        print(
            f"              {pid:>7} {values['start']:7.1f} {warm:7.1f} {values['end']:7.1f} "
            f"{values['peak']:7.1f} {values['end'] - warm:+9.1f}{note}"
        )
    if len(memory.figures) != args.concurrency:
        problems.append(f"{len(memory.figures)} worker processes seen, expected {args.concurrency}: some were replaced")
    if code != 0:
        problems.append(f"the supervisor exited with {code}")
    if problems:
        print("FAILED:\n  " + "\n  ".join(problems))
        print(f"worker log: {log_path}")
        return 1
    print("OK: every count adds up")
    if not args.keep:
        log_path.unlink()
    else:
        print(f"worker log: {log_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
