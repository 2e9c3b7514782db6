"""pgqueuer's side of the benchmark (asyncio, not Django); runs in bench/.venvs/pgqueuer.

    python -m bench.drivers.peer_pgqueuer COMMAND [ARGS]

Its worker is a QueueManager on one asyncpg connection with its defaults
(batches of 10 jobs per dequeue, LISTEN/NOTIFY); ``mode=drain`` stops it when
the queue is empty.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import time
from typing import Any

import asyncpg
from pgqueuer import AsyncpgDriver, Queries, QueueManager
from pgqueuer.models import Job
from pgqueuer.types import QueueExecutionMode

from bench.drivers.common import PGHOST, PGPORT, PGUSER, emit, latency_run, pg_execute, pg_recreate, pg_settle

DBNAME = os.environ.get("BENCH_PGQUEUER_DB", "pgqueuer_bench")
DSN = f"postgresql://{PGUSER}@{PGHOST}:{PGPORT}/{DBNAME}"


def clear() -> None:
    pg_execute(DBNAME, "TRUNCATE pgqueuer", "TRUNCATE pgqueuer_log")


def remaining() -> int:
    return int(pg_execute(DBNAME, "SELECT count(*) FROM pgqueuer")[0])


async def worker(wait: bool) -> None:
    connection = await asyncpg.connect(DSN)
    qm = QueueManager(Queries(AsyncpgDriver(connection)))

    @qm.entrypoint("noop")
    async def noop(job: Job) -> None:
        """Does nothing."""

    @qm.entrypoint("latency")
    async def record_start(job: Job) -> None:
        started = time.time()
        tag, enqueued_at = (job.payload or b"").decode().split()
        with open(os.environ["BENCH_LATENCY_FILE"], "a") as out:
            out.write(f"{tag} {enqueued_at} {started!r}\n")

    # BENCH_PGQUEUER_BATCH: its dequeue's batch_size (unset: pgqueuer's default, 10).
    sized = {"batch_size": int(os.environ["BENCH_PGQUEUER_BATCH"])} if os.environ.get("BENCH_PGQUEUER_BATCH") else {}
    await qm.run(mode=QueueExecutionMode.continuous if wait else QueueExecutionMode.drain, **sized)


async def enqueue_bulk(queries: Queries, first: int, count: int) -> None:
    await queries.enqueue(["noop"] * count, [str(i).encode() for i in range(first, first + count)], [0] * count)


async def run(args: Any) -> dict[str, Any]:
    connection = await asyncpg.connect(DSN)
    queries = Queries(AsyncpgDriver(connection))
    try:
        if args.command == "setup":
            await queries.install()
            return {"ok": True}
        if args.command == "enqueue-one":
            clear()
            started = time.perf_counter()
            for i in range(args.count):
                await queries.enqueue("noop", str(i).encode(), 0)
            seconds = time.perf_counter() - started
            return {"jobs": args.count, "seconds": seconds, "jobs_per_s": args.count / seconds, "stored": remaining()}
        if args.command == "enqueue-bulk":
            clear()
            started = time.perf_counter()
            size = args.calls_of or args.count
            for start in range(0, args.count, size):
                await enqueue_bulk(queries, start, min(size, args.count - start))
            seconds = time.perf_counter() - started
            return {
                "jobs": args.count,
                "calls_of": size,
                "seconds": seconds,
                "jobs_per_s": args.count / seconds,
                "stored": remaining(),
            }
        if args.command == "fill":
            clear()
            for start in range(0, args.count, 10_000):
                await enqueue_bulk(queries, start, min(10_000, args.count - start))
            pg_settle(DBNAME)
            return {"jobs": remaining()}
        raise SystemExit(f"unknown command {args.command}")
    finally:
        await connection.close()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument(
        "command", choices=["setup", "enqueue-one", "enqueue-bulk", "fill", "remaining", "latency", "worker"]
    )
    parser.add_argument("--count", type=int, default=1000)
    parser.add_argument("--path", default="")
    parser.add_argument("--gap-min", type=float, default=0.005)
    parser.add_argument("--gap-max", type=float, default=0.03)
    parser.add_argument("--calls-of", type=int, default=0, help="enqueue-bulk: jobs per call (0: all in one)")
    parser.add_argument("--wait", action="store_true", help="worker: keep running when the queue is empty")
    args = parser.parse_args()
    if args.command == "setup":
        pg_recreate(DBNAME)
    if args.command == "worker":
        asyncio.run(worker(args.wait))
    elif args.command == "remaining":
        emit({"remaining": remaining()})
    elif args.command == "latency":
        emit(latency(args))
    else:
        emit(asyncio.run(run(args)))


def latency(args: Any) -> dict[str, Any]:
    """Enqueue one at a time from a plain loop, like the other systems' latency runs."""
    loop = asyncio.new_event_loop()
    connection = loop.run_until_complete(asyncpg.connect(DSN))
    queries = Queries(AsyncpgDriver(connection))

    def enqueue(tag: int, at: float) -> None:
        loop.run_until_complete(queries.enqueue("latency", f"{tag} {at!r}".encode(), 0))

    try:
        return latency_run(enqueue, args.count, args.path, gap_min=args.gap_min, gap_max=args.gap_max)
    finally:
        loop.run_until_complete(connection.close())
        loop.close()


if __name__ == "__main__":
    main()
