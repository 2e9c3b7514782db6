"""Steady soak: hold a share of the measured capacity for a set time and record how the queue ages.

Not a test: it measures, draws and checks counts (issue 31). Run from the repository root
(PostgreSQL at 127.0.0.1:5432, or BENCH_PGHOST/BENCH_PGPORT/BENCH_PGUSER):

    .venv/bin/python bench/steady.py                      # one hour at 70 % of capacity
    .venv/bin/python bench/steady.py --duration 90 --idle-every 30 --idle-for 20 --sample-every 5 \
        --fill 5000 --calibrate 30

It needs matplotlib in the project's environment (``.venv/bin/pip install matplotlib``): a
benchmark-only dependency, not one of the package's (bench/steady_plot.py draws the PNG).

1. Capacity. On a database of its own (``dbqueue_steady``, --database; created, migrated and
   dropped at the end unless --keep, by bench/soak.py's ``own_database``), --fill no-op jobs
   (``bench.noop``) are drained by --workers separate ``queue_work`` processes, timed from the
   moment they are all started (bench/batches.py's ``drain`` and ``Workers``, so with the same
   ``--sleep 0.01`` as the benchmark's drains). That figure is not the capacity to take a share
   of: it starts from a vacuumed table and ends before many dead rows pile up, with the machine
   to the workers alone. On the 2-core machine the soak was written on, 70 % of a drain's
   figure (4,081 of 5,831 jobs/s) was held for 15 s, then the claim slowed as dead rows piled up between two
   vacuums and a backlog of 110,000 jobs grew in 90 s: a soak of a collapse, not of a steady
   state. So the capacity is then measured sustained: fresh workers run for --calibrate seconds
   (default 60, one vacuum interval) while the producer enqueues no-op jobs at the drain's rate,
   more than they can take, with the soak's vacuums (below) running; capacity = jobs that left
   the table / seconds. The share is taken of that. --rate skips both.
2. Steady phase, --duration seconds: a producer process (forked, so its enqueues do not share a
   GIL with the probe) enqueues --share x capacity jobs/s every 100 ms with
   ``enqueue_many(..., handles=False)``. It keeps to the cumulative schedule (jobs due =
   rate x elapsed), so a slow batch is made up by the next. One job in --latency-every is a
   ``bench.latency`` job, which appends when it started to BENCH_LATENCY_FILE (enqueue -> start
   latency); one in --fail-every fails for good: a ``bench.noop`` call stored with an argument too
   many (a ``JobCall`` built without ``bind``'s check, as a row stored by older code), which the
   worker moves to ``dbqueue_failed_job`` at its first attempt (PayloadError is permanent). The
   benchmark's settings (bench/settings.py) are used rather than tests.settings, because the
   latency job is the benchmark's and the benchapp has no failing job. Fresh workers run the
   whole phase.
3. Idle in transaction: every --idle-every seconds a session runs ``BEGIN ISOLATION LEVEL
   REPEATABLE READ; SELECT txid_current()`` (a snapshot and an xid: both hold back the horizon
   below which vacuum may remove dead rows), stays idle --idle-for seconds, then rolls back.
4. Sampling, every --sample-every seconds, one CSV row (bench/results/steady-<UTC>.csv): the
   claim's time seen by a probe that runs the real claim statement (``claim_sql`` /
   ``claim_params`` of django_dbqueue.claims.plain, in the shape a worker would take now:
   ``shape``, so bounded while claims are slow, docs/flow.md; in a transaction rolled back, so it
   claims nothing) every --probe-every seconds, p50/p99/max of the interval, only the statement
   timed; the server's own execution time of one full claim, the scan form
   (bench/drivers/dbqueue.py's ``explain_claim``, EXPLAIN ANALYZE rolled back) per sample;
   enqueue -> start p50/p99 of the latency jobs that started in the interval; jobs enqueued and
   processed per second; waiting, delayed and reserved jobs; ``pg_stat_user_tables`` live and
   dead tuples and (auto)vacuum counts of dbqueue_job and dbqueue_failed_job;
   ``pg_relation_size`` of dbqueue_job and of each of its indexes; ``pg_total_relation_size`` of
   dbqueue_failed_job and of the result store (dbqueue_task_result); sessions idle in transaction
   and the age in xids of the oldest snapshot or xid (``backend_xmin``/``backend_xid``). A line
   is printed every minute. A probe's rolled-back UPDATE leaves one dead row version per probe
   (20 a second by default): small beside the jobs' own, and counted in the dead tuples like any
   claim's.
5. The end: the producer stops, then the workers (SIGTERM, each finishes its job); every job
   enqueued in the steady phase must have succeeded (the workers' own count in
   ``dbqueue_history``), failed (a ``dbqueue_failed_job`` row) or still be in the table, not
   reserved; each latency job left a line or is still waiting; each failing job failed. The PNG
   (bench/results/steady-<UTC>.png) stacks, against minutes: the claim's p50/p99 and the server
   time; enqueue -> start p50/p99; dead and live tuples of dbqueue_job with the vacuums; table
   and index sizes; enqueue and processing rates with the waiting depth. Shaded: an idle
   transaction was open. ``python bench/steady_plot.py CSV`` draws it again from the CSV.

Vacuum: on a server that runs autovacuum, the soak leaves it alone. This one may run without
(``autovacuum = off``); then the soak stands in for it, as bench/soak.py does, with ``VACUUM
ANALYZE dbqueue_job, dbqueue_failed_job`` from a thread every --vacuum-every seconds (default 60,
autovacuum's default naptime: a queue table of a few hundred live rows passes autovacuum's
threshold of 50 + 20 % dead rows within any minute of this load, so autovacuum would visit it
at each naptime). The vacuum still runs while an idle transaction is open; it cannot remove
what that transaction may see, which is what the soak is meant to show.

Ctrl-C ends the steady phase early; the counts are checked and the PNG drawn all the same
(the producer ignores SIGINT so that no batch is cut in half; the workers stop on it as on
SIGTERM). Exit code 0 when the phase ran its course, the counts add up and the workers stayed
up, 1 otherwise.
"""

from __future__ import annotations

import argparse
import csv
import multiprocessing
import os
import re
import signal
import sys
import tempfile
import threading
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.steady_plot import plot  # noqa: E402 - needs ROOT on sys.path; fails early without matplotlib

# The producer enqueues this often (seconds).
TICK = 0.1
# The probe's claim takes no job: a worker id no worker has.
PROBE_WORKER = "bench:steady-probe:0"
QUEUE = "default"
# Stand-in for autovacuum when the server runs without it (see the docstring).
VACUUM_SQL = "VACUUM ANALYZE dbqueue_job, dbqueue_failed_job"
# The extra argument of the failing calls (a no-op job takes one).
FAIL_ARGUMENT = "an argument too many"
# Words in the workers' log that mean a job was in trouble.
TROUBLE = ("reclaimed", "reservation lost", "giving up", "worker process died")


def positive(kind: type) -> Any:
    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        if value <= 0:
            raise argparse.ArgumentTypeError(f"{text} is not above 0")
        return value

    return parse


def share(text: str) -> float:
    value = positive(float)(text)
    if value > 1:
        raise argparse.ArgumentTypeError(f"{text} is not a share between 0 and 1")
    return value


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add = parser.add_argument
    add("--duration", type=positive(float), default=3600, help="seconds of the steady phase (default: 3600)")
    add("--share", type=share, default=0.7, help="share of the capacity to enqueue (default: 0.7)")
    add("--rate", type=positive(float), help="jobs/s to enqueue, instead of share x measured capacity")
    add("--fill", type=positive(int), default=20_000, help="jobs of the first capacity drain (default: 20000)")
    add(
        "--calibrate",
        type=positive(float),
        default=60,
        help="seconds the capacity is measured against an overload (default: 60, one --vacuum-every)",
    )
    add("--workers", type=positive(int), default=2, help="queue_work processes (default: 2)")
    add("--idle-every", type=positive(float), default=300, help="seconds between idle transactions (default: 300)")
    add("--idle-for", type=positive(float), default=120, help="seconds an idle transaction stays open (default: 120)")
    add("--sample-every", type=positive(float), default=10, help="seconds between two samples (default: 10)")
    add("--probe-every", type=positive(float), default=0.05, help="seconds between two claim probes (default: 0.05)")
    add("--latency-every", type=positive(int), default=50, help="one job in N records its start (default: 50)")
    add("--fail-every", type=positive(int), default=100, help="one job in N fails for good (default: 100)")
    add(
        "--vacuum-every",
        type=float,
        default=None,
        help="seconds between two VACUUM ANALYZE by the soak; 0: never "
        "(default: 60 when the server's autovacuum is off, else 0)",
    )
    add("--database", default="dbqueue_steady", help="database to create and drop (default: dbqueue_steady)")
    add("--keep", action="store_true", help="keep the database, the worker log and the latency file")
    args = parser.parse_args()
    if args.database.startswith("test") or args.database in {"exp1", "postgres"}:
        parser.error(f"the soak never uses the database {args.database!r}")
    if args.idle_for >= args.idle_every:
        parser.error("--idle-for must be shorter than --idle-every")
    if args.fail_every < 2:
        parser.error("--fail-every must be at least 2 (job 1 of every N fails)")
    if args.vacuum_every is not None and args.vacuum_every < 0:
        parser.error("--vacuum-every must be 0 (never) or more")
    return args


# -- the producer (a forked process) ---------------------------------------------


def calls(start: int, stop: int, latency_every: int, fail_every: int) -> tuple[list[Any], list[int]]:
    """Calls number ``start`` to ``stop`` (latency, failing or no-op jobs; 0: none of that kind),
    and how many of each kind: no-op, latency, failing."""
    from bench.benchapp.jobs import noop, record_start
    from django_dbqueue import JobCall

    now = time.time()
    made = []
    kinds = [0, 0, 0]
    for i in range(start, stop):
        if latency_every and i % latency_every == 0:
            made.append(record_start.bind(i, now))
            kinds[1] += 1
        elif fail_every and i % fail_every == 1:
            # Not through bind(), which refuses it: the worker's own check fails it for good.
            made.append(JobCall(noop, (i, FAIL_ARGUMENT), {}))
            kinds[2] += 1
        else:
            made.append(noop.bind(i))
            kinds[0] += 1
    return made, kinds


def produce(rate: float, latency_every: int, fail_every: int, counts: Any, stop: Any) -> None:
    """Enqueue ``rate`` jobs/s every TICK until ``stop`` is set; ``counts``: noop, latency, failing."""
    from django.db import connections

    from django_dbqueue import enqueue_many

    # Ctrl-C reaches the whole process group: the main process stops this one, between batches.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    started = time.monotonic()
    sent = 0
    ticks = 0
    try:
        while not stop.is_set():
            due = int(rate * (time.monotonic() - started))
            if due > sent:
                made, kinds = calls(sent, due, latency_every, fail_every)
                enqueue_many(made, handles=False)
                with counts.get_lock():
                    for kind, count in enumerate(kinds):
                        counts[kind] += count
                sent = due
            ticks += 1
            stop.wait(max(0.0, started + ticks * TICK - time.monotonic()))
    finally:
        connections.close_all()


class Producer:
    """``produce`` in a forked process (its enqueues share no GIL with the probe), started on
    entering the ``with`` and stopped on leaving it; ``counts``: no-op, latency, failing."""

    def __init__(self, rate: float, latency_every: int = 0, fail_every: int = 0) -> None:
        fork = multiprocessing.get_context("fork")
        self.stop = fork.Event()
        self.counts = fork.Array("q", 3)
        self.process = fork.Process(
            target=produce,
            args=(rate, latency_every, fail_every, self.counts, self.stop),
            name="steady-producer",
        )
        self.stuck = False

    def __enter__(self) -> Producer:
        from django.db import connections

        connections.close_all()  # the child must not share this process's connection
        self.process.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.process.join(30)
        if self.process.is_alive():
            self.stuck = True
            self.process.terminate()
            self.process.join()

    def enqueued(self) -> int:
        with self.counts.get_lock():
            return sum(self.counts)


# -- the sessions of the main process ------------------------------------------------


class IdleTransaction:
    """A session that every ``every`` seconds opens a transaction holding a snapshot and an
    xid, leaves it idle ``hold`` seconds, then rolls it back; ``spans`` lists when."""

    def __init__(self, dbname: str, every: float, hold: float) -> None:
        import psycopg

        from bench.drivers.common import conninfo

        self.conn = psycopg.connect(conninfo(dbname), autocommit=True)
        self.every, self.hold = every, hold
        self.next_open = every
        self.since: float | None = None
        self.spans: list[tuple[float, float]] = []

    def tick(self, t: float) -> None:
        if self.since is None and t >= self.next_open:
            self.conn.execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
            self.conn.execute("SELECT txid_current()")
            self.since = t
            self.next_open += self.every
        elif self.since is not None and t >= self.since + self.hold:
            self.close(t)

    def close(self, t: float) -> None:
        if self.since is not None:
            self.conn.execute("ROLLBACK")
            self.spans.append((self.since, t))
            self.since = None

    def until(self) -> float | None:
        return None if self.since is None else self.since + self.hold


class Vacuums(threading.Thread):
    """``VACUUM_SQL`` every ``every`` seconds, on a session of its own, until ``stop()``."""

    def __init__(self, dbname: str, every: float) -> None:
        super().__init__(name="steady-vacuum", daemon=True)
        self.dbname, self.every = dbname, every
        self.done = 0
        self.stopping = threading.Event()

    def run(self) -> None:
        import psycopg

        from bench.drivers.common import conninfo

        with psycopg.connect(conninfo(self.dbname), autocommit=True) as conn:
            while not self.stopping.wait(self.every):
                conn.execute(VACUUM_SQL)
                self.done += 1

    def stop(self) -> None:
        self.stopping.set()
        self.join(timeout=120)


class Probe:
    """The real claim, timed alone, in a transaction that is rolled back: the statement a worker's
    claim would take now (``claims.plain.shape``: the one scan, the walk, or, while claims are slow,
    the bounded scan with a full one every second), fed back as a worker's claims are."""

    def __init__(self) -> None:
        self.times: list[tuple[float, float]] = []  # (seconds into the phase, ms)

    def run(self, t: float) -> None:
        from django.db import connection, transaction

        from django_dbqueue.claims import plain

        walk, bound = plain.shape(QUEUE)
        sql = plain.claim_sql(connection, walk=walk, clear=plain.clears_unique_keys(QUEUE))
        params = plain.claim_params(PROBE_WORKER, QUEUE, 1, walk=walk, bound=bound)
        with transaction.atomic(), connection.cursor() as cursor:
            # Opens the transaction (BEGIN goes with it), so only the claim is timed.
            cursor.execute("SET LOCAL statement_timeout = '10s'")
            started = time.perf_counter()
            cursor.execute(sql, params)
            rows = cursor.fetchall()
            elapsed = time.perf_counter() - started
            transaction.set_rollback(True)
        plain.timed(QUEUE, walk, elapsed)
        plain.noted(QUEUE, plain.from_claim(connection.alias, rows), 1)
        self.times.append((t, elapsed * 1000))


class LatencyFile:
    """The lines latency jobs append (tag, enqueued at, started at), read as they come."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.offset = 0
        self.times: list[tuple[float, float]] = []  # (started at, time.time(); ms)

    def read(self) -> list[float]:
        """The latencies (ms) of the lines added since the last read."""
        try:
            with open(self.path, "rb") as lines:
                lines.seek(self.offset)
                chunk = lines.read()
        except FileNotFoundError:
            return []
        complete = chunk[: chunk.rfind(b"\n") + 1]
        self.offset += len(complete)
        fresh = []
        for line in complete.decode().splitlines():
            _, enqueued, started = line.split()
            fresh.append((float(started), (float(started) - float(enqueued)) * 1000))
        self.times.extend(fresh)
        return [ms for _, ms in fresh]


# -- the sample --------------------------------------------------------------------


def job_indexes() -> list[str]:
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT c.relname FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid "
            "WHERE i.indrelid = 'dbqueue_job'::regclass ORDER BY c.relname"
        )
        return [row[0] for row in cursor.fetchall()]


def columns(indexes: list[str]) -> list[str]:
    return [
        "t_s",
        "utc",
        "enqueued",
        "enqueue_per_s",
        "processed_per_s",
        "waiting",
        "delayed",
        "reserved",
        "probes",
        "claim_p50_ms",
        "claim_p99_ms",
        "claim_max_ms",
        "claim_server_ms",
        "started",
        "start_p50_ms",
        "start_p99_ms",
        "job_live",
        "job_dead",
        "job_vacuums",
        "job_autovacuums",
        "job_last_autovacuum",
        "failed_live",
        "failed_dead",
        "job_table_mb",
        *(f"index_mb:{name}" for name in indexes),
        "failed_total_mb",
        "results_total_mb",
        "idle_in_transaction",
        "horizon_age_xids",
        "idle_since_s",
        "idle_until_s",
        "soak_vacuums",
    ]


def database_figures(indexes: list[str]) -> dict[str, Any]:
    """Counts, statistics and sizes of the queue's tables, and the sessions that hold back vacuum."""
    from django.db import connection

    from bench.drivers.dbqueue import explain_claim
    from django_dbqueue.models import Job

    mb = 1024 * 1024
    row: dict[str, Any] = {
        "waiting": Job.objects.waiting().count(),
        "delayed": Job.objects.delayed().count(),
        "reserved": Job.objects.reserved().count(),
    }
    found = re.search(r"Execution Time: ([0-9.]+) ms", explain_claim())
    row["claim_server_ms"] = float(found.group(1)) if found else ""
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT relname, n_live_tup, n_dead_tup, vacuum_count, autovacuum_count, last_autovacuum "
            "FROM pg_stat_user_tables WHERE relname IN ('dbqueue_job', 'dbqueue_failed_job')"
        )
        stats = {name: rest for name, *rest in cursor.fetchall()}
        live, dead, vacuums, autovacuums, last = stats["dbqueue_job"]
        row.update(job_live=live, job_dead=dead, job_vacuums=vacuums, job_autovacuums=autovacuums)
        row["job_last_autovacuum"] = last.isoformat(timespec="seconds") if last else ""
        row["failed_live"], row["failed_dead"] = stats["dbqueue_failed_job"][:2]
        cursor.execute(
            "SELECT pg_relation_size('dbqueue_job'), pg_total_relation_size('dbqueue_failed_job'), "
            "COALESCE(pg_total_relation_size(to_regclass('dbqueue_task_result')), 0)"
        )
        table, failed, results = cursor.fetchone()
        row.update(job_table_mb=table / mb, failed_total_mb=failed / mb, results_total_mb=results / mb)
        cursor.execute(
            "SELECT c.relname, pg_relation_size(c.oid) FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid "
            "WHERE i.indrelid = 'dbqueue_job'::regclass"
        )
        sizes = dict(cursor.fetchall())
        row.update({f"index_mb:{name}": sizes.get(name, 0) / mb for name in indexes})
        cursor.execute(
            "SELECT count(*) FILTER (WHERE state IN ('idle in transaction', 'idle in transaction (aborted)')), "
            "COALESCE(max(greatest(age(backend_xmin), age(backend_xid))), 0) "
            "FROM pg_stat_activity WHERE datname = current_database()"
        )
        row["idle_in_transaction"], row["horizon_age_xids"] = cursor.fetchone()
    return row


def quantiles(values: list[float]) -> tuple[Any, Any]:
    from bench.drivers.common import percentile

    return (percentile(values, 50), percentile(values, 99)) if values else ("", "")


# -- the phases ----------------------------------------------------------------------


def measure_capacity(args: argparse.Namespace, log: Path) -> tuple[float, float]:
    """Jobs/s of ``args.workers`` workers: draining --fill jobs with the machine to themselves
    (bench/batches.py's drain), then sustained for --calibrate seconds against a producer that
    enqueues faster than that (see the docstring)."""
    from bench import batches
    from bench.drivers.dbqueue import DBNAME, settle
    from django_dbqueue.models import Job

    drained = args.fill / batches.drain("plain", args.fill, args.workers, [], log)["seconds"]
    settle()
    vacuums = Vacuums(DBNAME, args.vacuum_every) if args.vacuum_every else None
    with batches.Workers(args.workers, [], log), Producer(drained) as producer:
        if vacuums:
            vacuums.start()
        time.sleep(args.calibrate)
        sustained = (producer.enqueued() - Job.objects.count()) / args.calibrate
        if vacuums:
            vacuums.stop()
    batches.clear()
    print(
        f"capacity of {args.workers} workers: a drain of {args.fill} jobs {drained:,.0f} jobs/s; sustained for "
        f"{args.calibrate:g} s against {drained:,.0f} jobs/s enqueued {sustained:,.0f} jobs/s",
        flush=True,
    )
    return drained, sustained


def history_totals() -> dict[str, int]:
    from django.db.models import Sum

    from django_dbqueue.models import JobHistory

    totals = JobHistory.objects.aggregate(succeeded=Sum("succeeded"), failed=Sum("failed"), started=Sum("started"))
    return {key: value or 0 for key, value in totals.items()}


class Steady:
    """The steady phase: producer, workers, probe, idle transactions, vacuums and samples."""

    def __init__(self, args: argparse.Namespace, rate: float, csv_path: Path, latency: Path, log: Path) -> None:
        self.args, self.rate, self.csv_path, self.log = args, rate, csv_path, log
        self.latency = LatencyFile(latency)
        self.rows: list[dict[str, Any]] = []
        self.producer = Producer(rate, args.latency_every, args.fail_every)
        self.problems: list[str] = []

    def run(self) -> float:
        """Run the phase; return its seconds."""
        from django.db import connections

        from bench import batches
        from bench.drivers.dbqueue import DBNAME

        args = self.args
        indexes = job_indexes()
        with batches.Workers(args.workers, [], self.log) as workers, open(self.csv_path, "w", newline="") as out:
            with self.producer:
                began, self.began_wall = time.monotonic(), time.time()
                vacuums = Vacuums(DBNAME, args.vacuum_every) if args.vacuum_every else None
                if vacuums:
                    vacuums.start()
                idle = IdleTransaction(DBNAME, args.idle_every, args.idle_for)
                probe = Probe()
                writer = csv.DictWriter(out, fieldnames=columns(indexes))
                writer.writeheader()
                last = {"t": 0.0, "enqueued": 0, "in_table": 0, "probes": 0}
                next_sample, next_line, probes = args.sample_every, 60.0, 0
                try:
                    while (t := time.monotonic() - began) < args.duration:
                        if workers.exited() or not self.producer.process.is_alive():
                            who = "a worker" if workers.exited() else "the producer"
                            self.problems.append(f"{who} stopped at {t:.0f} s")
                            break
                        idle.tick(t)
                        probe.run(t)
                        probes += 1
                        if t >= next_sample:
                            row = self.sample(t, last, probe, idle, vacuums, indexes)
                            writer.writerow(row)
                            out.flush()
                            next_sample += args.sample_every
                            if t >= next_line:
                                self.say(row)
                                next_line += 60
                        time.sleep(max(0.0, began + probes * args.probe_every - time.monotonic()))
                except KeyboardInterrupt:
                    self.problems.append(f"interrupted at {time.monotonic() - began:.0f} s of {args.duration:g}")
                    connections.close_all()  # a query may have been cut short
                finally:
                    seconds = time.monotonic() - began
                    idle.close(seconds)
                    idle.conn.close()
                    if vacuums:
                        vacuums.stop()
                self.idle_spans = idle.spans
                self.probe_times = probe.times
        if self.producer.stuck:
            self.problems.append("the producer did not stop within 30 s")
        codes = [proc.returncode for proc in workers.procs]
        if any(codes):
            self.problems.append(f"worker exit codes {codes}")
        return seconds

    def sample(
        self,
        t: float,
        last: dict[str, Any],
        probe: Probe,
        idle: IdleTransaction,
        vacuums: Vacuums | None,
        indexes: list[str],
    ) -> dict[str, Any]:
        from django_dbqueue.models import Job

        enqueued = self.producer.enqueued()
        in_table = Job.objects.count()
        span = t - last["t"]
        claims = [ms for _, ms in probe.times[last["probes"] :]]
        starts = self.latency.read()
        row = {
            "t_s": round(t, 2),
            "utc": datetime.now(UTC).isoformat(timespec="seconds"),
            "enqueued": enqueued,
            "enqueue_per_s": (enqueued - last["enqueued"]) / span,
            # Processed: left the table (succeeded or failed) since the last sample.
            "processed_per_s": ((enqueued - in_table) - (last["enqueued"] - last["in_table"])) / span,
            "probes": len(claims),
            "claim_max_ms": max(claims) if claims else "",
            "started": len(starts),
            "idle_since_s": "" if idle.since is None else round(idle.since, 2),
            "idle_until_s": "" if idle.since is None else round(idle.until() or 0, 2),
            "soak_vacuums": vacuums.done if vacuums else 0,
            **database_figures(indexes),
        }
        row["claim_p50_ms"], row["claim_p99_ms"] = quantiles(claims)
        row["start_p50_ms"], row["start_p99_ms"] = quantiles(starts)
        last.update(t=t, enqueued=enqueued, in_table=in_table, probes=len(probe.times))
        self.rows.append(row)
        return row

    @staticmethod
    def say(row: dict[str, Any]) -> None:
        def ms(value: Any) -> str:
            return f"{value:.2f}" if value != "" else "-"

        print(
            f"{row['t_s'] / 60:5.1f} min: enqueue {row['enqueue_per_s']:6.0f}/s, done {row['processed_per_s']:6.0f}/s, "
            f"waiting {row['waiting']:5d}; claim p99 {ms(row['claim_p99_ms'])} ms, "
            f"start p99 {ms(row['start_p99_ms'])} ms; dead {row['job_dead']:6d}, live {row['job_live']:5d}; "
            f"job table {row['job_table_mb']:.2f} MB; idle in txn {row['idle_in_transaction']}",
            flush=True,
        )


# -- the end -----------------------------------------------------------------------


def check_counts(steady: Steady, history_before: dict[str, int], log: Path) -> dict[str, Any]:
    """Every job enqueued in the phase succeeded, failed or is still in the table; add problems."""
    from django_dbqueue.models import FailedJob, Job

    noop, latency, failing = list(steady.producer.counts)
    enqueued = noop + latency + failing
    after = history_totals()
    succeeded = after["succeeded"] - history_before["succeeded"]
    figures = {
        "enqueued": enqueued,
        "succeeded": succeeded,
        "failed": FailedJob.objects.count(),
        "left": Job.objects.count(),
        "left_reserved": Job.objects.reserved().count(),
        "history_failed": after["failed"] - history_before["failed"],
    }
    problems = steady.problems
    if succeeded + figures["failed"] + figures["left"] != enqueued:
        problems.append(
            f"succeeded {succeeded} + failed {figures['failed']} + left {figures['left']} "
            f"= {succeeded + figures['failed'] + figures['left']}, enqueued {enqueued}"
        )
    if figures["left_reserved"]:
        problems.append(f"{figures['left_reserved']} jobs still reserved after the workers stopped")
    failing_left = Job.objects.filter(payload__contains=FAIL_ARGUMENT).count()
    if figures["failed"] != failing - failing_left:
        problems.append(f"{figures['failed']} failed jobs, expected {failing - failing_left} ({failing} enqueued)")
    if figures["history_failed"] != figures["failed"]:
        problems.append(f"the workers counted {figures['history_failed']} failures, {figures['failed']} stored")
    strays = FailedJob.objects.exclude(name="bench.noop", exception_class__endswith="PayloadError").count()
    if strays:
        problems.append(f"{strays} failed jobs are not the failing no-op calls")
    steady.latency.read()
    latency_left = Job.objects.filter(name="bench.latency").count()
    if len(steady.latency.times) != latency - latency_left:
        problems.append(f"{len(steady.latency.times)} latency lines, expected {latency - latency_left}")
    text = log.read_text(errors="replace")
    problems.extend(f"{word!r} in the worker log" for word in TROUBLE if word in text)
    return figures


def window(times: list[tuple[float, float]], start: float, end: float) -> str:
    from bench.drivers.common import percentile

    values = [ms for t, ms in times if start <= t < end]
    return f"{percentile(values, 99):.2f} ms (n={len(values)})" if values else "-"


def summary(steady: Steady, capacity: tuple[float, float] | None, seconds: float, figures: dict[str, Any]) -> None:
    rows = steady.rows
    first, final = rows[0], rows[-1]
    if capacity:
        print(f"\ncapacity {capacity[1]:,.0f} jobs/s sustained ({capacity[0]:,.0f} in a drain); ", end="")
    else:
        print("\ncapacity not measured (--rate); ", end="")
    print(
        f"target {steady.rate:,.0f} jobs/s, held {figures['enqueued'] / seconds:,.0f} jobs/s over {seconds:.0f} s; "
        f"enqueued {figures['enqueued']}: succeeded {figures['succeeded']}, failed {figures['failed']}, "
        f"left {figures['left']} (reserved {figures['left_reserved']})"
    )
    part = max(steady.args.sample_every, seconds / 10)
    middle = seconds / 2 - part / 2
    start_times = [(started - steady.began_wall, ms) for started, ms in steady.latency.times]
    for label, times in (("claim p99", steady.probe_times), ("enqueue->start p99", start_times)):
        print(
            f"{label:>20}: start {window(times, 0, part)}, middle {window(times, middle, middle + part)}, "
            f"end {window(times, seconds - part, seconds + 1)}"
        )
    dead = max(rows, key=lambda row: row["job_dead"])
    print(f"max dead tuples of dbqueue_job: {dead['job_dead']} at {dead['t_s'] / 60:.1f} min")

    def job_mb(row: dict[str, Any]) -> float:
        return float(row["job_table_mb"]) + sum(v for k, v in row.items() if k.startswith("index_mb:"))

    biggest = max(job_mb(row) for row in rows)
    print(
        f"dbqueue_job with its indexes: {job_mb(first):.2f} MB -> {job_mb(final):.2f} MB (max {biggest:.2f}); "
        f"dbqueue_failed_job {first['failed_total_mb']:.2f} MB -> {final['failed_total_mb']:.2f} MB; "
        f"idle transactions {len(steady.idle_spans)}"
    )


def main() -> int:
    args = parse_args()
    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
    scratch = Path(tempfile.gettempdir())
    latency_path = scratch / f"dbqueue-steady-{os.getpid()}.latency"
    log = scratch / f"dbqueue-steady-{os.getpid()}.log"
    # Read on import by bench.settings and bench/batches.py (the workers' environment).
    os.environ.update(
        BENCH_DB="postgres",
        BENCH_DBNAME=args.database,
        DJANGO_SETTINGS_MODULE="bench.settings",
        BENCH_LATENCY_FILE=str(latency_path),
    )
    from bench.drivers.dbqueue import settle, setup_django
    from bench.soak import own_database

    setup_django()
    from django.db import connection

    RESULTS.mkdir(parents=True, exist_ok=True)
    csv_path, png_path = RESULTS / f"steady-{stamp}.csv", RESULTS / f"steady-{stamp}.png"
    with own_database(args.database, args.keep):
        with connection.cursor() as cursor:
            cursor.execute("SHOW autovacuum")
            autovacuum = cursor.fetchone()[0] == "on"
        if args.vacuum_every is None:
            args.vacuum_every = 0 if autovacuum else 60
        capacity = None if args.rate else measure_capacity(args, log)
        rate = args.rate or args.share * (capacity[1] if capacity else 0)
        settle()  # the capacity phase's dead rows gone, fresh statistics
        print(
            f"steady: {rate:,.0f} jobs/s for {args.duration:g} s, {args.workers} workers; idle transaction "
            f"every {args.idle_every:g} s for {args.idle_for:g} s; autovacuum {'on' if autovacuum else 'off'}, "
            + (
                f"VACUUM ANALYZE by the soak every {args.vacuum_every:g} s"
                if args.vacuum_every
                else "no VACUUM by the soak"
            ),
            flush=True,
        )
        before = history_totals()
        steady = Steady(args, rate, csv_path, latency_path, log)
        seconds = steady.run()
        figures = check_counts(steady, before, log)
        if steady.rows:
            summary(steady, capacity, seconds, figures)
            title = (
                f"dbqueue steady soak {stamp}: {rate:,.0f} jobs/s"
                + (f" ({args.share:.0%} of {capacity[1]:,.0f})" if capacity else "")
                + f", {args.workers} workers, idle txn {args.idle_for:g} s every {args.idle_every:g} s"
            )
            plot(csv_path, png_path, title, steady.idle_spans)
            print(f"CSV {csv_path}\nPNG {png_path}")
        else:
            steady.problems.append("no sample was taken")
    if steady.problems:
        print("FAILED:\n  " + "\n  ".join(steady.problems))
        print(f"worker log: {log}")
        return 1
    print("OK: every job enqueued succeeded, failed or is still waiting")
    if args.keep:
        print(f"worker log: {log}; latency file: {latency_path}")
    else:
        log.unlink(missing_ok=True)
        latency_path.unlink(missing_ok=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
