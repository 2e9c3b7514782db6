"""Celery's side of bench/waiting.py; runs in bench/.venvs/celery (celery[redis]).

    python -m bench.drivers.waiting_celery setup|fill|remaining [--count N] [--kind sync|http_sync]

The worker is Celery's own command, started by bench/waiting.py:

    python -m celery -A bench.drivers.waiting_celery worker --pool threads --concurrency 32 ...

Broker: Redis at BENCH_REDIS_URL (redis://127.0.0.1:6379/15), queue ``bench_waiting``; no
result backend (results ignored), so the job is the same as django-dbqueue's.
"""

from __future__ import annotations

import argparse
import os

from celery import Celery

from bench.drivers import waiting_common
from bench.drivers.common import emit

REDIS_URL = os.environ.get("BENCH_REDIS_URL", "redis://127.0.0.1:6379/15")
QUEUE = "bench_waiting"

app = Celery("bench_waiting", broker=REDIS_URL)
app.conf.update(
    task_default_queue=QUEUE,
    task_ignore_result=True,
    broker_connection_retry_on_startup=True,
    worker_hijack_root_logger=False,
)


@app.task(name="wait_sync")
def wait_sync(i: int) -> None:
    waiting_common.wait_sync(i)


@app.task(name="http_sync")
def http_sync(i: int) -> None:
    waiting_common.http_sync(i)


KINDS = {"sync": wait_sync, "http_sync": http_sync}


def clear() -> None:
    import redis

    client = redis.Redis.from_url(REDIS_URL)
    # Only this bench's keys: the queue and kombu's bookkeeping of unacknowledged messages.
    client.delete(QUEUE, "unacked", "unacked_index", "unacked_mutex")
    client.close()


def remaining() -> int:
    import redis

    client = redis.Redis.from_url(REDIS_URL)
    try:
        return int(client.llen(QUEUE)) + int(client.hlen("unacked"))
    finally:
        client.close()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("command", choices=["setup", "fill", "remaining"])
    parser.add_argument("--count", type=int, default=1000)
    parser.add_argument("--kind", default="sync", choices=sorted(KINDS))
    args = parser.parse_args()
    if args.command == "setup":
        import celery

        clear()
        emit({"ok": True, "version": celery.__version__})
    elif args.command == "fill":
        clear()
        task = KINDS[args.kind]
        # One connection from the producer pool for every message (Celery has no bulk send).
        with app.producer_or_acquire() as producer:
            for i in range(args.count):
                task.apply_async((i,), producer=producer)
        emit({"jobs": remaining()})
    else:
        emit({"remaining": remaining()})


if __name__ == "__main__":
    # Through the module's import name, so that the worker and this script share one app.
    from bench.drivers.waiting_celery import main as _main

    _main()
