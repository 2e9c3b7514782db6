"""django-dbqueue's side of bench/waiting.py; runs in the project's own environment.

python -m bench.drivers.waiting_dbqueue setup|fill|remaining [--count N] [--kind sync|async|http_sync|http_async]
(DJANGO_SETTINGS_MODULE=bench.settings, BENCH_DBNAME=dbqueue_waiting_bench)
"""

from __future__ import annotations

import argparse
import os

from bench.drivers.common import emit, pg_recreate, pg_settle

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "bench.settings")
DBNAME = os.environ.setdefault("BENCH_DBNAME", "dbqueue_waiting_bench")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("command", choices=["setup", "fill", "remaining"])
    parser.add_argument("--count", type=int, default=1000)
    parser.add_argument("--kind", default="sync", choices=["sync", "async", "http_sync", "http_async"])
    args = parser.parse_args()
    if os.environ.get("BENCH_DB", "postgres") != "postgres":
        raise SystemExit("bench/waiting runs on PostgreSQL only")
    if args.command == "setup":
        pg_recreate(DBNAME)
    import django

    django.setup()
    from django.db import connection

    from django_dbqueue.models import Job

    if args.command == "setup":
        from django.core.management import call_command

        call_command("migrate", verbosity=0)
        emit({"ok": True})
    elif args.command == "fill":
        from bench.benchapp.waiting_jobs import KINDS
        from django_dbqueue import enqueue_many

        definition = KINDS[args.kind]
        with connection.cursor() as cursor:
            cursor.execute("TRUNCATE TABLE dbqueue_job")
        for start in range(0, args.count, 10_000):
            enqueue_many(definition.bind(i) for i in range(start, min(args.count, start + 10_000)))
        connection.close()
        pg_settle(DBNAME)
        emit({"jobs": Job.objects.count()})
    else:
        emit({"remaining": Job.objects.count()})


if __name__ == "__main__":
    main()
