"""django.tasks tasks of the benchmark, run by django-tasks-db's db_worker."""

import os
import time

from django.tasks import task


@task()
def noop(i: int) -> None:
    """Does nothing."""


@task()
def record_start(tag: int, enqueued_at: float) -> None:
    started = time.time()
    with open(os.environ["BENCH_LATENCY_FILE"], "a") as out:
        out.write(f"{tag} {enqueued_at!r} {started!r}\n")
