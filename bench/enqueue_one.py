"""A single ``enqueue()`` from each code tree given, against pgqueuer's, alternating.

Each round runs, one after the other, a loop of ``--count`` single enqueues of a
no-op job from each tree (its own PostgreSQL database, migrated by that tree)
and, if ``bench/run`` has installed it, pgqueuer's ``enqueue`` of one job; the
figures are medians over the rounds of the wall time and of the enqueueing
process's CPU time per call (its start-up excluded). Variants that alternate
share the machine's state, which one ``bench/run`` cannot promise (docs/performance.md).

    .venv/bin/python bench/enqueue_one.py --tree before=/tmp/before --tree now=. --rounds 7
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PGQUEUER = ROOT / "bench" / ".venvs" / "pgqueuer" / "bin" / "python"

MIGRATE = """
import django
django.setup()
from django.core.management import call_command
call_command("migrate", verbosity=0)
"""

OURS = """
import json, sys, time
import django
django.setup()
from django.db import connection
from bench.benchapp.jobs import noop
count = int(sys.argv[1])
for i in range(50):
    noop.enqueue(i)
cpu, wall = time.process_time(), time.perf_counter()
for i in range(count):
    noop.enqueue(i)
cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
with connection.cursor() as cursor:
    cursor.execute("TRUNCATE dbqueue_job")
print(json.dumps({"wall_us": wall / count * 1e6, "cpu_us": cpu / count * 1e6}))
"""

THEIRS = """
import asyncio, json, sys, time
import asyncpg
from pgqueuer import AsyncpgDriver, Queries

async def main(count):
    connection = await asyncpg.connect(sys.argv[2])
    queries = Queries(AsyncpgDriver(connection))
    for i in range(50):
        await queries.enqueue("noop", str(i).encode(), 0)
    cpu, wall = time.process_time(), time.perf_counter()
    for i in range(count):
        await queries.enqueue("noop", str(i).encode(), 0)
    cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    await connection.execute("TRUNCATE pgqueuer, pgqueuer_log")
    print(json.dumps({"wall_us": wall / count * 1e6, "cpu_us": cpu / count * 1e6}))

asyncio.run(main(int(sys.argv[1])))
"""


def tree_env(tree: Path, dbname: str) -> dict[str, str]:
    return {
        **os.environ,
        "PYTHONPATH": str(tree),
        "DJANGO_SETTINGS_MODULE": "bench.settings",
        "BENCH_DB": "postgres",
        "BENCH_DBNAME": dbname,
    }


def run(command: list[str], env: dict[str, str] | None = None, cwd: Path = ROOT) -> dict[str, float]:
    out = subprocess.run(command, env=env, cwd=cwd, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tree", action="append", required=True, help="LABEL=PATH of a django-dbqueue checkout")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--count", type=int, default=1500)
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT))
    from bench.drivers.common import pg_recreate

    variants: dict[str, tuple[list[str], dict[str, str] | None, Path]] = {}
    for spec in args.tree:
        label, _, path = spec.partition("=")
        tree = Path(path).resolve()
        dbname = f"dbqueue_bench_one_{len(variants)}"
        pg_recreate(dbname)
        subprocess.run([sys.executable, "-c", MIGRATE], env=tree_env(tree, dbname), cwd=tree, check=True)
        variants[label] = ([sys.executable, "-c", OURS, str(args.count)], tree_env(tree, dbname), tree)
    if PGQUEUER.exists():
        env = {**os.environ, "PYTHONPATH": str(ROOT), "BENCH_PGQUEUER_DB": "pgqueuer_bench_one"}
        subprocess.run([str(PGQUEUER), "-m", "bench.drivers.peer_pgqueuer", "setup"], env=env, cwd=ROOT, check=True)
        dsn = "postgresql://postgres@127.0.0.1:5432/pgqueuer_bench_one"
        variants["pgqueuer"] = ([str(PGQUEUER), "-c", THEIRS, str(args.count), dsn], env, ROOT)
    figures: dict[str, list[dict[str, float]]] = {label: [] for label in variants}
    for _ in range(args.rounds):
        for label, (command, env, cwd) in variants.items():
            figures[label].append(run(command, env, cwd))
    print(f"single enqueue, {args.count:,} calls a round, medians of {args.rounds} alternating rounds")
    walls = {label: statistics.median(f["wall_us"] for f in rounds) for label, rounds in figures.items()}
    for label, rounds in figures.items():
        wall, cpu = walls[label], statistics.median(f["cpu_us"] for f in rounds)
        line = f"  {label:12s} {wall:6.0f} us wall ({1e6 / wall:,.0f} jobs/s), {cpu:5.1f} us CPU"
        if "pgqueuer" in walls and label != "pgqueuer":
            line += f"; {walls['pgqueuer'] / wall:.2f}x pgqueuer's rate"
        print(line)


if __name__ == "__main__":
    main()
