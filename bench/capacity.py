"""Capacity of one PostgreSQL server: worker "hosts" in network namespaces drain a queue through a
TCP hop each; jobs/s, the database's CPU per 1,000 jobs, server connections, claim p50 / p99.

Not a test: it measures and prints (issue 31). Each host is a network namespace joined to this
machine by a veth pair (tests/network.py's ``Host``); a ``socat`` relay on this machine's end of
the pair forwards its connections to the server (or to a PgBouncer with --pgbouncer PORT), so
every query of a host's workers crosses a real TCP link. On every host run --processes
``queue_work`` processes (with --threads T, one pool of T threads each). Each configuration
fills a fresh queue (``dbqueue_bench_capacity``) paused, starts every worker, and times from the
resume to the empty table; meanwhile a sampler reads every 20 ms the server's connections
(``pg_stat_activity``) and times the real claim statement, rolled back (bench/steady.py's
``Probe``). The database's CPU is the postmaster's and its children's ticks (``/proc``: a
backend that exits is counted in the postmaster's ``cutime``), the machine's from ``/proc/stat``.

Needs root (network namespaces), ``ip`` and ``socat``:

    .venv/bin/python -m bench.capacity --hosts 1 2 4 --processes 1 --kind noop --jobs 20000
    .venv/bin/python -m bench.capacity --hosts 1 2 4 --processes 1 --threads 32 --kind wait --seconds 10
    .venv/bin/python -m bench.capacity --hosts 4 --threads 250 --kind wait --wait 1 --pgbouncer 6432

With --pgbouncer the workers reach the server through that PgBouncer (transaction pooling) and
poll instead of LISTENing (``DBQUEUE["LISTEN"] = False``, bench/settings.py's BENCH_LISTEN=0).
Jobs in flight are the rows reserved, sampled with the connections.

On one machine the hosts share its cores with the server: the run shows the method and where a
small server bends, not what more machines would add; on real hosts run the same workers and
read the same statistics (the capacity note, docs/capacity.md, says how).
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
DBNAME = "dbqueue_bench_capacity"
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "bench.settings")
os.environ["BENCH_DB"] = "postgres"
os.environ["BENCH_DBNAME"] = DBNAME
sys.path.insert(0, str(ROOT))

import django  # noqa: E402
import psycopg  # noqa: E402

from bench.drivers.common import conninfo, percentile, pg_recreate  # noqa: E402
from tests.network import Host, namespaces_usable  # noqa: E402

TICKS = os.sysconf("SC_CLK_TCK")
FILL = """
import django
django.setup()
from django.core.management import call_command
call_command("migrate", verbosity=0)
from django_dbqueue import enqueue_many, pauses
from bench.benchapp.jobs import noop
from bench.benchapp.waiting_jobs import wait_sync
pauses.pause("default", force=True)
job = noop if "{kind}" == "noop" else wait_sync
enqueue_many((job.bind(i) for i in range({jobs})), handles=False)
"""


def pids(*pgrep: str) -> list[int]:
    return [int(pid) for pid in subprocess.run(["pgrep", *pgrep], capture_output=True, text=True).stdout.split()]


def postgres_ticks() -> int:
    """CPU ticks of the PostgreSQL server: its postmaster, its children, and the children it reaped."""
    [postmaster] = pids("-o", "-x", "postgres")
    total = 0
    for pid in [postmaster, *pids("-P", str(postmaster))]:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except (FileNotFoundError, ProcessLookupError):
            continue
        utime, stime, cutime, cstime = (int(fields[i]) for i in (11, 12, 13, 14))
        total += utime + stime + (cutime + cstime if pid == postmaster else 0)
    return total


def machine_ticks() -> tuple[int, int]:
    """(busy, all) ticks of every core, from /proc/stat."""
    values = [int(v) for v in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    idle = values[3] + values[4]
    return sum(values) - idle, sum(values)


class Relay:
    """A socat on this machine's end of a host's veth pair, forwarding to the server."""

    def __init__(self, host: Host, target_port: int) -> None:
        if host.forwarder is not None:
            host.forwarder.close()  # Python's relay: socat's costs the machine less
        self.port = 15432
        self.process = subprocess.Popen(
            [
                "socat",
                f"TCP-LISTEN:{self.port},bind={host.outside_ip},fork,reuseaddr",
                f"TCP:127.0.0.1:{target_port},nodelay",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        time.sleep(0.2)

    def close(self) -> None:
        self.process.terminate()
        self.process.wait(10)


class Sampler(threading.Thread):
    """Every 20 ms: the server's connections to the bench database, the jobs in flight (reserved
    rows), and one claim probe."""

    def __init__(self) -> None:
        super().__init__(daemon=True)
        from bench.steady import Probe

        self.probe = Probe()
        self.connections: list[int] = []
        self.in_flight: list[int] = []
        self.done = threading.Event()
        self.emptied: float | None = None

    def run(self) -> None:
        from django.db import connection

        began = time.monotonic()
        with psycopg.connect(conninfo(DBNAME), autocommit=True) as conn:
            while not self.done.is_set():
                count, empty, running = conn.execute(
                    "SELECT count(*), NOT EXISTS (SELECT FROM dbqueue_job), "
                    "(SELECT count(*) FROM dbqueue_job WHERE reserved_at IS NOT NULL) FROM pg_stat_activity "
                    "WHERE datname = current_database()"
                ).fetchone()
                self.connections.append(int(count))
                if not empty:
                    self.in_flight.append(int(running))
                if empty and self.emptied is None:
                    self.emptied = time.monotonic()
                self.probe.run(time.monotonic() - began)
                time.sleep(0.02)
        connection.close()


def one_run(args: argparse.Namespace, hosts: list[Host], relays: list[Relay], jobs: int) -> dict[str, Any]:
    pg_recreate(DBNAME)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "BENCH_WAIT_SECONDS": str(args.wait)}
    if args.pgbouncer:
        env["BENCH_LISTEN"] = "0"
    subprocess.run([sys.executable, "-c", FILL.format(kind=args.kind, jobs=jobs)], env=env, cwd=ROOT, check=True)
    with psycopg.connect(conninfo(DBNAME), autocommit=True) as conn:
        conn.execute("VACUUM ANALYZE")
        conn.execute("CHECKPOINT")
    command = [sys.executable, "-m", "django", "queue_work", "--sleep", "0.05", "-v", "0", "--skip-checks"]
    if args.threads > 1:
        command += ["--threads", str(args.threads)]
    processes = []
    for host, relay in zip(hosts, relays, strict=True):
        host_env = {**env, "BENCH_PGHOST": host.outside_ip, "BENCH_PGPORT": str(relay.port)}
        processes += [subprocess.Popen([*host.prefix, *command], env=host_env, cwd=ROOT) for _ in range(args.processes)]
    with psycopg.connect(conninfo(DBNAME), autocommit=True) as conn:
        deadline = time.monotonic() + 120
        while conn.execute("SELECT count(*) FROM dbqueue_worker").fetchone()[0] < len(processes):
            if time.monotonic() > deadline:
                raise SystemExit("the workers did not start")
            time.sleep(0.05)
        time.sleep(0.5)
        sampler = Sampler()
        database_before, machine_before = postgres_ticks(), machine_ticks()
        began = time.monotonic()
        sampler.start()
        conn.execute("DELETE FROM dbqueue_paused_queue")
        conn.execute("SELECT pg_notify('dbqueue', 'default')")
        while sampler.emptied is None and time.monotonic() - began < 600:
            time.sleep(0.01)
        seconds = (sampler.emptied or time.monotonic()) - began
        database_after, machine_after = postgres_ticks(), machine_ticks()
        sampler.done.set()
        sampler.join(10)
    for process in processes:
        process.send_signal(signal.SIGTERM)
    for process in processes:
        process.wait(60)
    claims = [ms for _, ms in sampler.probe.times]
    busy = (machine_after[0] - machine_before[0]) / max(1, machine_after[1] - machine_before[1])
    database_seconds = (database_after - database_before) / TICKS
    return {
        "jobs_per_s": jobs / seconds,
        "db_cpu_s_per_1000": database_seconds / jobs * 1000,
        "db_cores": database_seconds / seconds,
        "machine_busy": busy,
        "connections": max(sampler.connections, default=0),
        "in_flight_max": max(sampler.in_flight, default=0),
        "in_flight_p50": percentile(sampler.in_flight, 50) if sampler.in_flight else 0,
        "claim_p50_ms": percentile(claims, 50),
        "claim_p99_ms": percentile(claims, 99),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hosts", type=int, nargs="+", default=[1, 2, 4], help="host counts (default: 1 2 4)")
    parser.add_argument("--processes", type=int, default=1, help="queue_work processes per host (default: 1)")
    parser.add_argument("--threads", type=int, default=1, help="--threads of each process (default: 1)")
    parser.add_argument("--kind", choices=["noop", "wait"], default="noop", help="no-op jobs, or sleeps (--wait)")
    parser.add_argument("--wait", type=float, default=0.05, help="seconds a wait job sleeps (default: 0.05)")
    parser.add_argument("--jobs", type=int, default=20_000, help="no-op jobs per run (default: 20000)")
    parser.add_argument("--seconds", type=float, default=10, help="wait jobs: about this long a run (default: 10)")
    parser.add_argument("--repeat", type=int, default=3, help="runs per configuration; medians (default: 3)")
    parser.add_argument("--pgbouncer", type=int, default=None, help="relay to a PgBouncer on this port")
    args = parser.parse_args()
    usable, why = namespaces_usable()
    if not usable:
        raise SystemExit(f"network namespaces are not usable here: {why}")
    django.setup()
    print(
        f"{'hosts':>5} {'procs':>5} {'thr':>4} {'jobs/s':>8} {'db cpu s/1k':>11} {'db cores':>8} "
        f"{'busy':>5} {'conns':>5} {'claim p50':>9} {'p99 ms':>7} {'in flight p50':>13} {'max':>5}"
    )
    for count in args.hosts:
        slots = count * args.processes * args.threads
        jobs = args.jobs if args.kind == "noop" else int(slots / args.wait * args.seconds)
        hosts = [Host(("127.0.0.1", 5432)).start() for _ in range(count)]
        relays = [Relay(host, args.pgbouncer or 5432) for host in hosts]
        try:
            runs = [one_run(args, hosts, relays, jobs) for _ in range(args.repeat)]
        finally:
            for relay in relays:
                relay.close()
            for host in hosts:
                host.stop()
        median = {key: statistics.median(run[key] for run in runs) for key in runs[0]}
        print(
            f"{count:>5} {args.processes:>5} {args.threads:>4} {median['jobs_per_s']:>8.0f} "
            f"{median['db_cpu_s_per_1000']:>11.3f} {median['db_cores']:>8.2f} {median['machine_busy']:>5.0%} "
            f"{median['connections']:>5.0f} {median['claim_p50_ms']:>9.2f} {median['claim_p99_ms']:>7.2f} "
            f"{median['in_flight_p50']:>13.0f} {median['in_flight_max']:>5.0f}",
            flush=True,
        )


if __name__ == "__main__":
    main()
