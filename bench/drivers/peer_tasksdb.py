"""django-tasks-db's side of the benchmark; runs in bench/.venvs/tasksdb.

    python -m bench.drivers.peer_tasksdb COMMAND [ARGS]   (DJANGO_SETTINGS_MODULE=bench.drivers.tasksdb_settings)

Its worker is the ``db_worker`` management command, started by bench/run. It
has no bulk enqueue.
"""

from __future__ import annotations

import argparse
import os
from typing import Any

from bench.drivers.common import emit, latency_run, pg_execute, pg_recreate, pg_settle, timed

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "bench.drivers.tasksdb_settings")
DBNAME = os.environ.get("BENCH_TASKSDB_DB", "tasksdb_bench")


def clear() -> None:
    pg_execute(DBNAME, "TRUNCATE django_tasks_database_dbtaskresult")


def remaining() -> int:
    return int(
        pg_execute(
            DBNAME, "SELECT count(*) FROM django_tasks_database_dbtaskresult WHERE status IN ('READY', 'RUNNING')"
        )[0]
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("command", choices=["setup", "enqueue-one", "fill", "remaining", "latency"])
    parser.add_argument("--count", type=int, default=1000)
    parser.add_argument("--path", default="")
    parser.add_argument("--gap-min", type=float, default=0.005)
    parser.add_argument("--gap-max", type=float, default=0.03)
    args = parser.parse_args()
    if args.command == "setup":
        pg_recreate(DBNAME)
    import django

    django.setup()
    from django.core.management import call_command

    from bench.drivers.tasksdb_tasks import noop, record_start

    result: dict[str, Any]
    if args.command == "setup":
        call_command("migrate", verbosity=0)
        result = {"ok": True}
    elif args.command == "enqueue-one":
        clear()
        seconds = timed(lambda: [noop.enqueue(i) for i in range(args.count)])
        result = {"jobs": args.count, "seconds": seconds, "jobs_per_s": args.count / seconds, "stored": remaining()}
    elif args.command == "fill":
        # No bulk enqueue in django-tasks-db: one enqueue() per task.
        clear()
        for i in range(args.count):
            noop.enqueue(i)
        from django.db import connections

        connections.close_all()
        pg_settle(DBNAME)
        result = {"jobs": remaining()}
    elif args.command == "remaining":
        result = {"remaining": remaining()}
    else:
        result = latency_run(
            lambda tag, at: record_start.enqueue(tag, at),
            args.count,
            args.path,
            gap_min=args.gap_min,
            gap_max=args.gap_max,
        )
    emit(result)


if __name__ == "__main__":
    main()
