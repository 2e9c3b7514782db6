"""procrastinate's side of the benchmark; runs in bench/.venvs/procrastinate.

python -m bench.drivers.peer_procrastinate COMMAND [ARGS]
"""

from __future__ import annotations

import argparse
from typing import Any

import procrastinate

from bench.drivers.common import emit, latency_run, pg_execute, pg_recreate, pg_settle, timed
from bench.drivers.procrastinate_app import DBNAME, app, noop, record_start


def clear() -> None:
    pg_execute(DBNAME, "TRUNCATE procrastinate_jobs CASCADE")


def remaining() -> int:
    return int(pg_execute(DBNAME, "SELECT count(*) FROM procrastinate_jobs WHERE status IN ('todo', 'doing')")[0])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument(
        "command", choices=["setup", "enqueue-one", "enqueue-bulk", "fill", "remaining", "latency", "worker"]
    )
    parser.add_argument("--count", type=int, default=1000)
    parser.add_argument("--path", default="")
    parser.add_argument("--gap-min", type=float, default=0.005)
    parser.add_argument("--gap-max", type=float, default=0.03)
    parser.add_argument("--wait", action="store_true", help="worker: keep running when the queue is empty")
    args = parser.parse_args()

    if args.command == "setup":
        pg_recreate(DBNAME)
        with app.open():
            app.schema_manager.apply_schema()
        emit({"ok": True, "version": procrastinate.__version__ if hasattr(procrastinate, "__version__") else ""})
    elif args.command == "worker":
        # Finished jobs are deleted, as django-dbqueue does.
        app.run_worker(concurrency=1, wait=args.wait, delete_jobs="successful")
    elif args.command == "remaining":
        emit({"remaining": remaining()})
    else:
        with app.open():
            emit(run(args))


def run(args: Any) -> dict[str, Any]:
    if args.command == "enqueue-one":
        clear()
        seconds = timed(lambda: [noop.defer(i=i) for i in range(args.count)])
        return {"jobs": args.count, "seconds": seconds, "jobs_per_s": args.count / seconds, "stored": remaining()}
    if args.command == "enqueue-bulk":
        clear()
        seconds = timed(lambda: noop.batch_defer(*({"i": i} for i in range(args.count))))
        return {"jobs": args.count, "seconds": seconds, "jobs_per_s": args.count / seconds, "stored": remaining()}
    if args.command == "fill":
        clear()
        for start in range(0, args.count, 10_000):
            noop.batch_defer(*({"i": i} for i in range(start, min(args.count, start + 10_000))))
        pg_settle(DBNAME)
        return {"jobs": remaining()}
    if args.command == "latency":
        return latency_run(
            lambda tag, at: record_start.defer(tag=tag, enqueued_at=at),
            args.count,
            args.path,
            gap_min=args.gap_min,
            gap_max=args.gap_max,
        )
    raise SystemExit(f"unknown command {args.command}")


if __name__ == "__main__":
    main()
