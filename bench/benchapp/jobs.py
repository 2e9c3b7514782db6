"""Jobs of the benchmark, found by django-dbqueue's autodiscovery."""

import os
import time

from django_dbqueue import job


@job(name="bench.noop")
def noop(i: int) -> None:
    """Does nothing: the drain measures the queue, not the job."""


@job(name="bench.latency")
def record_start(tag: int, enqueued_at: float) -> None:
    """Append when this job started (time.time()) to BENCH_LATENCY_FILE."""
    started = time.time()
    with open(os.environ["BENCH_LATENCY_FILE"], "a") as out:
        out.write(f"{tag} {enqueued_at!r} {started!r}\n")
