"""Batched claims, prefetched jobs, round trips per job, and LISTEN/NOTIFY wake-ups."""

from __future__ import annotations

import collections
import signal
import time

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext

from django_dbqueue import enqueue_many
from django_dbqueue.execution import Defaults
from django_dbqueue.models import Job
from django_dbqueue.worker import Worker, WorkerOptions
from tests.conftest import run_worker, wait_until
from tests.testapp import jobs
from tests.testapp.models import Run


def make_worker(batch: int) -> Worker:
    return Worker(WorkerOptions(queues=["default"], defaults=Defaults(tries=3, timeout=30, backoff=0), batch=batch))


@pytest.mark.django_db
def test_a_batch_runs_every_job_once_with_one_claim_per_batch():
    enqueue_many(jobs.record.bind(f"b{i}") for i in range(25))
    with CaptureQueriesContext(connection) as queries:
        worker, _ = run_worker(batch=10)
    assert worker.processed == 25 and Run.objects.count() == 25 and not Job.objects.exists()
    sql = [q["sql"] for q in queries.captured_queries]
    claims = [s for s in sql if s.startswith("SELECT") and "dbqueue_job" in s and "ORDER BY" in s]
    assert len(claims) == 4  # 10 + 10 + 5, then the empty one that ends the run
    deletes = [s for s in sql if s.startswith("DELETE") and "dbqueue_job" in s]
    assert len(deletes) == 25


@pytest.mark.django_db(transaction=True)
def test_round_trips_per_job_in_steady_state_are_pinned():
    """Per batch of 10 jobs: one claim (BEGIN, SELECT ... FOR UPDATE SKIP LOCKED, UPDATE, COMMIT;
    on SQLite a SELECT and a compare-and-set UPDATE per job), then per job its DELETE, plus the
    job's own INSERT: 1.4 round trips of queue work per job."""
    enqueue_many(jobs.record.bind(f"r{i}") for i in range(10))
    worker = make_worker(batch=10)
    with CaptureQueriesContext(connection) as queries:
        first = worker._next_job()
        assert first is not None
        worker.process(first)
        for _ in range(9):
            job = worker._next_job()
            assert job is not None
            worker.process(job)
    claim = 4 if connection.features.has_select_for_update_skip_locked else 1 + 10
    assert len(queries.captured_queries) == claim + 10 * 2  # per job: the DELETE and the job's INSERT


@pytest.mark.django_db
def test_prefetched_jobs_are_released_when_the_worker_stops():
    enqueue_many(jobs.record.bind(f"p{i}") for i in range(3))
    worker = make_worker(batch=3)
    first = worker._next_job()
    assert first is not None and len(worker._prefetched) == 2
    worker._release_prefetched()
    assert Job.objects.reserved().count() == 1
    assert Job.objects.waiting().count() == 2


@pytest.mark.django_db
def test_a_prefetched_job_held_too_long_is_given_back_and_claimed_afresh():
    enqueue_many(jobs.record.bind(f"s{i}") for i in range(2))
    worker = make_worker(batch=2)
    first = worker._next_job()
    held, _ = worker._prefetched.popleft()
    worker._prefetched = collections.deque([(held, time.monotonic() - held.retry_after)])
    again = worker._next_job()
    assert again is not None and again.pk == held.pk and again.attempts == held.attempts + 1
    assert first is not None and first.pk != held.pk


@pytest.mark.acceptance
@pytest.mark.django_db(transaction=True)
@pytest.mark.skipif(
    "os.environ.get('DBQUEUE_TEST_DB', 'sqlite') != 'postgres'",
    reason="LISTEN/NOTIFY is PostgreSQL's; other databases poll",
)
def test_an_idle_worker_is_woken_by_notify_long_before_its_next_poll(worker_process):
    process = worker_process("--sleep", "60")
    process.wait_for_output("worker started")
    time.sleep(0.5)  # let it reach its idle wait
    started = time.monotonic()
    jobs.record.enqueue("woken")
    wait_until(lambda: Run.objects.filter(key="woken").exists(), 20, "the worker was not woken")
    assert time.monotonic() - started < 5
    process.signal(signal.SIGTERM)
    assert process.wait(timeout=30) == 0
