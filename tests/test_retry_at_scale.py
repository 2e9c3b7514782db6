"""Retrying 300,000 failed jobs: chunked, in bounded memory, on each database.

Slow (minutes): runs once per database with Django 6.1, when DBQUEUE_TEST_HEAVY is set
(scripts/test sets it). 300,000 on PostgreSQL, the production target; 50,000 on
MariaDB and SQLite, where the same chunked code took 2.5 minutes a run for 300,000
and 50,000 loaded at once would still be one and a half times the memory bound.
An interrupted retry needs a few chunks, not the scale: it runs everywhere.
"""

from __future__ import annotations

import math
import os
import resource
import sys
import time

import pytest
from django.db import connection, transaction
from django.utils import timezone

from django_dbqueue import operations
from django_dbqueue.models import FailedJob, Job

ROWS = 300_000 if os.environ.get("DBQUEUE_TEST_DB", "sqlite") == "postgres" else 50_000
# Growth of the process's peak resident memory allowed while retrying them all.
# Loading every row at once took about 300 MB per 100,000 rows.
MEMORY_BOUND_MB = 100

heavy = pytest.mark.skipif(
    not os.environ.get("DBQUEUE_TEST_HEAVY"),
    reason="slow: runs once per database, with Django 6.1: scripts/test sets DBQUEUE_TEST_HEAVY",
)


def payload(index: int) -> str:
    return f'{{"v":1,"args":["k{index}"],"kwargs":{{}}}}'


def insert_failed(count: int, batch: int = 5000) -> None:
    """Insert ``count`` failed jobs, a few thousand per statement, in one transaction."""
    now = timezone.now()
    with transaction.atomic():
        for start in range(0, count, batch):
            FailedJob.objects.bulk_create(
                FailedJob(
                    job_id=index,
                    queue="default",
                    name="tests.testapp.jobs.record",
                    payload=payload(index),
                    attempts=3,
                    max_tries=3,
                    exception_class="builtins.ValueError",
                    error="Traceback (most recent call last):\n  ...\nValueError: boom",
                    created_at=now,
                    failed_at=now,
                )
                for index in range(start, min(start + batch, count))
            )


def peak_rss_mb() -> float:
    # ru_maxrss is in kilobytes on Linux.
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


@heavy
# It bounds memory, not time: a slow machine took over the suite's 300 s (2026-12-05's CI VM).
@pytest.mark.timeout(900)
@pytest.mark.django_db(transaction=True)
def test_retrying_300000_failed_jobs_takes_bounded_memory(capsys):
    started = time.monotonic()
    insert_failed(ROWS)
    inserted = time.monotonic()
    before = peak_rss_mb()
    calls: list[int] = []
    retried = operations.retry_failed(operations.failed_jobs(), progress=calls.append)
    growth = peak_rss_mb() - before
    elapsed = time.monotonic() - inserted
    with capsys.disabled():
        # The figures, on the terminal: pytest shows a test's output only when it fails.
        sys.stderr.write(
            f"\n{connection.vendor}: inserted {ROWS:,} failed jobs in {inserted - started:.1f} s, "
            f"retried them in {elapsed:.1f} s, peak memory +{growth:.1f} MB\n"
        )
    assert retried == ROWS
    assert len(calls) == math.ceil(ROWS / operations.RETRY_CHUNK) and calls[-1] == ROWS
    assert growth < MEMORY_BOUND_MB, f"peak memory grew by {growth:.0f} MB"
    assert Job.objects.count() == ROWS and FailedJob.objects.count() == 0


@pytest.mark.django_db(transaction=True)
def test_an_interrupted_retry_of_failed_jobs_leaves_each_retried_or_still_failed():
    # Five chunks and part of one: two retried before the interruption, the rest after it.
    rows = 5 * operations.RETRY_CHUNK + 17
    insert_failed(rows)

    def interrupt_after_two_chunks(done: int) -> None:
        if done >= 2 * operations.RETRY_CHUNK:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        operations.retry_failed(FailedJob.objects.all(), progress=interrupt_after_two_chunks)
    retried, still_failed = Job.objects.count(), FailedJob.objects.count()
    assert retried == 2 * operations.RETRY_CHUNK
    assert retried + still_failed == rows
    # The two chunks retried are the lowest ids; every other job is still failed, once.
    done = 2 * operations.RETRY_CHUNK
    assert set(Job.objects.values_list("payload", flat=True)) == {payload(index) for index in range(done)}
    assert FailedJob.objects.filter(job_id__lt=done).count() == 0
    assert FailedJob.objects.values("job_id").distinct().count() == rows - done
