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


@job(name="bench.scheduled", queue="bench-scheduled")
def scheduled(n: int) -> None:
    """Enqueued by the schedules of bench/schedules.py to a queue no bench worker serves."""


if os.environ.get("BENCH_SCHEDULES"):
    from django_dbqueue.schedules import periodic

    # Every minute, the busiest a cron schedule ticks: BENCH_SCHEDULES ticks a minute in all.
    for n in range(int(os.environ["BENCH_SCHEDULES"])):
        periodic(scheduled, "* * * * *", args=[n], name=f"bench-{n}")


# In a queue of its own: a worker claims the queues of jobs with concurrency keys
# with the flow claim, and the others (the drain of bench.noop) with the plain one.
@job(name="bench.keyed", queue="bench-keyed", concurrency_key=lambda i, key: f"k{key}", concurrency_limit=1)
def keyed(i: int, key: int) -> None:
    """A no-op job with a concurrency key (bench/flow.py): at most one per key runs at once."""
