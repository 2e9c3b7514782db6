"""procrastinate's side of bench/waiting.py; runs in bench/.venvs/procrastinate.

    python -m bench.drivers.waiting_procrastinate setup|fill|remaining [--count N] [--kind ...]
    python -m bench.drivers.waiting_procrastinate worker --concurrency 32

Database: procrastinate_waiting_bench (dropped and created by ``setup``). The worker runs with
``wait=False`` (it stops when the queue is empty) and deletes finished jobs, as django-dbqueue
does. Sync jobs run in procrastinate's thread pool (the event loop's default executor).
"""

from __future__ import annotations

import argparse
import os

import procrastinate

from bench.drivers import waiting_common
from bench.drivers.common import conninfo, emit, pg_execute, pg_recreate, pg_settle

DBNAME = os.environ.get("BENCH_PROCRASTINATE_WAITING_DB", "procrastinate_waiting_bench")

app = procrastinate.App(connector=procrastinate.PsycopgConnector(conninfo=conninfo(DBNAME)))


@app.task(name="wait_sync")
def wait_sync(i: int) -> None:
    waiting_common.wait_sync(i)


@app.task(name="wait_async")
async def wait_async(i: int) -> None:
    await waiting_common.wait_async(i)


@app.task(name="http_sync")
def http_sync(i: int) -> None:
    waiting_common.http_sync(i)


@app.task(name="http_async")
async def http_async(i: int) -> None:
    await waiting_common.http_async(i)


KINDS = {"sync": wait_sync, "async": wait_async, "http_sync": http_sync, "http_async": http_async}


def remaining() -> int:
    return int(pg_execute(DBNAME, "SELECT count(*) FROM procrastinate_jobs WHERE status IN ('todo', 'doing')")[0])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("command", choices=["setup", "fill", "remaining", "worker"])
    parser.add_argument("--count", type=int, default=1000)
    parser.add_argument("--kind", default="async", choices=sorted(KINDS))
    parser.add_argument("--concurrency", type=int, default=32)
    args = parser.parse_args()
    if args.command == "setup":
        pg_recreate(DBNAME)
        with app.open():
            app.schema_manager.apply_schema()
        emit({"ok": True})
    elif args.command == "fill":
        pg_execute(DBNAME, "TRUNCATE procrastinate_jobs CASCADE")
        task = KINDS[args.kind]
        with app.open():
            for start in range(0, args.count, 10_000):
                task.batch_defer(*({"i": i} for i in range(start, min(args.count, start + 10_000))))
        pg_settle(DBNAME)
        emit({"jobs": remaining()})
    elif args.command == "worker":
        app.run_worker(concurrency=args.concurrency, wait=False, delete_jobs="successful")
    else:
        emit({"remaining": remaining()})


if __name__ == "__main__":
    # Through the module's import name: procrastinate finds tasks by their module, not __main__.
    from bench.drivers.waiting_procrastinate import main as _main

    _main()
