"""CPU instructions of a single ``enqueue()``, on both sides of the wire, counted by callgrind.

Wall-clock figures of a single enqueue swing 10-20 % between runs; instruction
counts do not. A throwaway PostgreSQL 15 cluster runs under valgrind's callgrind
(each backend writes its own count when it exits), with one database per tree
given, migrated by that tree, and one for pgqueuer if ``bench/run`` installed it.
Each variant's client process, itself under callgrind, enqueues a no-op job N
times one by one; the figures per enqueue are the differences between N = 100
and N = 100 + ``--calls`` divided by ``--calls`` (connection and interpreter
start-up cancel out): the server's (the backend serving that client) and the
client's (the enqueueing Python process). Needs valgrind and
/usr/lib/postgresql/15/bin; run as root, the cluster runs as the postgres user.
One run with one tree takes about 2 minutes. ``--enqueue many`` (``many-nohandles``):
one ``enqueue_many`` of N jobs with handles (without) instead, the figures per job.

    .venv/bin/python bench/pg_instructions.py --tree before=/tmp/before --tree now=.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
PGQUEUER = ROOT / "bench" / ".venvs" / "pgqueuer" / "bin" / "python"
PGBIN = Path("/usr/lib/postgresql/15/bin")
BASE = 100

MIGRATE = """
import django
django.setup()
from django.core.management import call_command
call_command("migrate", verbosity=0)
"""

OURS = """
import os, sys
import django
django.setup()
from django.db import connection
from bench.benchapp.jobs import noop
from django_dbqueue import enqueue_many
mode, count = os.environ["BENCH_ENQUEUE"], int(sys.argv[1])
if mode == "one":
    for i in range(count):
        noop.enqueue(i)
else:  # one enqueue_many of ``count`` jobs, with handles or without
    enqueue_many([noop.bind(i) for i in range(count)], handles=mode == "many")
with connection.cursor() as cursor:
    cursor.execute("SELECT pg_backend_pid()")
    print(cursor.fetchone()[0])
"""

THEIRS = """
import asyncio, sys
import asyncpg
from pgqueuer import AsyncpgDriver, Queries

async def main(dsn, count):
    connection = await asyncpg.connect(dsn)
    queries = Queries(AsyncpgDriver(connection))
    for i in range(count):
        await queries.enqueue("noop", str(i).encode(), 0)
    print(await connection.fetchval("SELECT pg_backend_pid()"))
    await connection.close()

asyncio.run(main(sys.argv[1], int(sys.argv[2])))
"""


# initdb refuses to run as root: root runs the cluster as the postgres user.
OS_USER = "postgres" if os.geteuid() == 0 else None
GROUPS: list[str] | None = [] if OS_USER else None


def start_cluster(tmp: Path, port: int) -> subprocess.Popen[bytes]:
    if OS_USER:
        shutil.chown(tmp, OS_USER, OS_USER)
    initdb = [str(PGBIN / "initdb"), "-D", str(tmp / "data"), "-A", "trust", "-U", "postgres", "-E", "UTF8"]
    as_postgres: dict[str, Any] = {"user": OS_USER, "group": OS_USER, "extra_groups": GROUPS}
    subprocess.run([*initdb, "--locale=C", "--no-sync"], cwd=tmp, check=True, capture_output=True, **as_postgres)
    valgrind = ["valgrind", "--tool=callgrind", f"--callgrind-out-file={tmp}/cg.%p"]
    server = [str(PGBIN / "postgres"), "-D", str(tmp / "data"), "-p", str(port), "-k", str(tmp)]
    settings = ["-c", "listen_addresses=127.0.0.1", "-c", "autovacuum=off"]
    with open(tmp / "server.log", "wb") as log:
        postmaster = subprocess.Popen([*valgrind, *server, *settings], cwd=tmp, stdout=log, stderr=log, **as_postgres)
    import psycopg

    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        if postmaster.poll() is not None:
            raise SystemExit(f"PostgreSQL under valgrind exited:\n{(tmp / 'server.log').read_text()[-2000:]}")
        try:
            psycopg.connect(f"host=127.0.0.1 port={port} user=postgres dbname=postgres").close()
            return postmaster
        except psycopg.OperationalError:
            time.sleep(1)
    raise SystemExit("PostgreSQL under valgrind did not accept connections in 180 s")


def backend_total(path: Path) -> int:
    """The instructions of a backend, from its callgrind file (written when it exits)."""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if path.exists():
            for line in path.read_text().splitlines():
                if line.startswith(("summary:", "totals:")):
                    return int(line.split()[1])
        time.sleep(0.5)
    raise SystemExit(f"no callgrind totals in {path}")


def measure(tmp: Path, command: list[str], env: dict[str, str], cwd: Path, count: int) -> tuple[int, int]:
    """(server, client) instructions of one client process enqueueing ``count`` jobs."""
    valgrind = ["valgrind", "--tool=callgrind", f"--callgrind-out-file={tmp}/client.%p"]
    done = subprocess.run([*valgrind, *command, str(count)], env=env, cwd=cwd, capture_output=True, text=True)
    collected = re.search(r"Collected : (\d+)", done.stderr)
    if done.returncode or not collected:
        raise SystemExit(f"client failed:\n{done.stdout}\n{done.stderr[-3000:]}")
    backend = int(done.stdout.strip().splitlines()[-1])
    return backend_total(tmp / f"cg.{backend}"), int(collected.group(1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tree", action="append", required=True, help="LABEL=PATH of a django-dbqueue checkout")
    parser.add_argument("--calls", type=int, default=1000, help="enqueues the two runs of a variant differ by")
    parser.add_argument("--port", type=int, default=5498, help="port of the throwaway cluster")
    parser.add_argument(
        "--enqueue",
        choices=["one", "many", "many-nohandles"],
        default="one",
        help="single enqueues (default), or one enqueue_many of N jobs with handles or without (figures per job)",
    )
    args = parser.parse_args()
    if not shutil.which("valgrind"):
        raise SystemExit("valgrind is not installed (apt-get install valgrind)")
    if not (PGBIN / "postgres").exists() or not (PGBIN / "initdb").exists():
        raise SystemExit(f"PostgreSQL 15 binaries not found in {PGBIN} (apt-get install postgresql-15)")
    with socket.socket() as probe:
        if probe.connect_ex(("127.0.0.1", args.port)) == 0:
            raise SystemExit(f"port {args.port} is in use: choose another with --port")
    trees = {label: Path(path).resolve() for label, _, path in (spec.partition("=") for spec in args.tree)}
    for label, tree in trees.items():
        if not (tree / "django_dbqueue").is_dir() or not (tree / "bench" / "settings.py").exists():
            raise SystemExit(f"--tree {label}={tree}: not a django-dbqueue checkout with bench/settings.py")
    os.environ.update(BENCH_PGHOST="127.0.0.1", BENCH_PGPORT=str(args.port), PYTHONHASHSEED="0")
    sys.path.insert(0, str(ROOT))
    from bench.drivers.common import pg_execute, pg_recreate

    tmp = Path(tempfile.mkdtemp(prefix="pg_instructions_"))
    postmaster = None
    try:
        postmaster = start_cluster(tmp, args.port)
        # label: (client command, its environment, its directory, database, tables to empty before a run)
        variants: dict[str, tuple[list[str], dict[str, str], Path, str, str]] = {}
        for label, tree in trees.items():
            dbname = f"dbqueue_instructions_{len(variants)}"
            env = {**os.environ, "PYTHONPATH": str(tree), "DJANGO_SETTINGS_MODULE": "bench.settings"}
            env.update(BENCH_DB="postgres", BENCH_DBNAME=dbname, BENCH_ENQUEUE=args.enqueue)
            pg_recreate(dbname)
            subprocess.run([sys.executable, "-c", MIGRATE], env=env, cwd=tree, check=True)
            variants[label] = ([sys.executable, "-c", OURS], env, tree, dbname, "dbqueue_job")
        if PGQUEUER.exists() and args.enqueue == "one":
            dbname = "pgqueuer_instructions"
            env = {**os.environ, "PYTHONPATH": str(ROOT), "BENCH_PGQUEUER_DB": dbname}
            setup = [str(PGQUEUER), "-m", "bench.drivers.peer_pgqueuer", "setup"]
            subprocess.run(setup, env=env, cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
            dsn = f"postgresql://postgres@127.0.0.1:{args.port}/{dbname}"
            variants["pgqueuer"] = ([str(PGQUEUER), "-c", THEIRS, dsn], env, ROOT, dbname, "pgqueuer, pgqueuer_log")
        figures: dict[str, dict[str, int]] = {}
        for label, (command, env, cwd, dbname, tables) in variants.items():
            runs = []
            for count in (BASE, BASE + args.calls):
                pg_execute(dbname, f"TRUNCATE {tables}")
                runs.append(measure(tmp, command, env, cwd, count))
            (server0, client0), (server1, client1) = runs
            server, client = round((server1 - server0) / args.calls), round((client1 - client0) / args.calls)
            figures[label] = {"server": server, "client": client, "total": server + client}
    finally:
        if postmaster is not None:
            postmaster.send_signal(signal.SIGINT)  # fast shutdown
            try:
                postmaster.wait(120)
            except subprocess.TimeoutExpired:
                postmaster.kill()
                postmaster.wait()
        shutil.rmtree(tmp, ignore_errors=True)
    what = "single enqueue" if args.enqueue == "one" else f"job of one enqueue_many ({args.enqueue})"
    print(f"instructions per {what} (callgrind; N={BASE + args.calls} minus N={BASE} calls)")
    print(f"  {'label':12s} {'server':>9s} {'client':>9s} {'total':>9s}")
    for label, f in figures.items():
        line = f"  {label:12s} {f['server']:9,d} {f['client']:9,d} {f['total']:9,d}"
        if "pgqueuer" in figures and label != "pgqueuer":
            ratio = figures["pgqueuer"]["total"] / f["total"]
            line += f"   ({ratio:.2f}x fewer than pgqueuer)" if ratio >= 1 else f"   ({1 / ratio:.2f}x more)"
        print(line)
    print(json.dumps({"calls": args.calls, "figures": figures}))


if __name__ == "__main__":
    main()
