"""Batched claims, prefetched jobs, round trips per job, and LISTEN/NOTIFY wake-ups."""

from __future__ import annotations

import logging
import signal
import time
import types

import pytest
from django.db import connection
from django.db.models import F
from django.test.utils import CaptureQueriesContext

from django_dbqueue import enqueue_many, lifecycle, signals
from django_dbqueue.execution import Defaults
from django_dbqueue.models import Job
from django_dbqueue.worker import StopReason, Worker, WorkerOptions
from tests.conftest import claim, needs_listen, run_worker, wait_until
from tests.testapp import jobs
from tests.testapp.models import Run


def make_worker(batch: int, **options: float) -> Worker:
    """A worker that has measured its jobs as quick: it claims ``batch`` at a time."""
    worker = Worker(
        WorkerOptions(queues=["default"], defaults=Defaults(tries=3, timeout=30, backoff=0), batch=batch, **options)
    )
    worker.outcomes.average_run = 0.001
    return worker


def is_claim(sql: str) -> bool:
    """A claim: on PostgreSQL an UPDATE ... RETURNING (alone, or with the DELETE of the batch
    that ran), else a SELECT in index order. The workflow sweep an idle worker runs now and then
    also selects jobs in order; it is not a claim."""
    if "dbqueue_workflow_node" in sql:
        return False
    if connection.vendor == "postgresql":
        return sql.startswith(("UPDATE", "WITH")) and "SKIP LOCKED" in sql and "dbqueue_job" in sql
    return sql.startswith("SELECT") and "dbqueue_job" in sql and "ORDER BY" in sql


def is_delete(sql: str) -> bool:
    return sql.startswith(("DELETE", "WITH done AS (DELETE")) and "dbqueue_job" in sql


@pytest.mark.django_db
def test_a_batch_runs_every_job_once_with_one_claim_and_one_delete_per_batch():
    enqueue_many(jobs.record.bind(f"b{i}") for i in range(25))
    with CaptureQueriesContext(connection) as queries:
        worker, _ = run_worker(batch=10, batch_window=60)
    assert worker.processed == 25 and Run.objects.count() == 25 and not Job.objects.exists()
    sql = [q["sql"] for q in queries.captured_queries]
    # The first claim takes one job (the worker knows nothing of their run time
    # yet), then 10, 10 and 4, then the empty one that ends the run; each claim
    # after the first deletes the batch before it (on PostgreSQL in the same
    # statement).
    assert len([s for s in sql if is_claim(s)]) == 5
    assert len([s for s in sql if is_delete(s)]) == 4


@pytest.mark.django_db(transaction=True)
def test_round_trips_per_job_in_steady_state_are_pinned():
    """Per batch of 10 jobs in steady state, besides each job's own INSERT: on PostgreSQL one
    statement that deletes the batch that ran and claims the next (0.1 round trips per job);
    on MariaDB the DELETE, then BEGIN, SELECT ... FOR UPDATE SKIP LOCKED, UPDATE, COMMIT; on
    SQLite the DELETE, a SELECT and a compare-and-set UPDATE per job."""
    enqueue_many(jobs.record.bind(f"r{i}") for i in range(20))
    worker = make_worker(batch=10, batch_window=60)
    assert len(claim(worker)) == 10
    with CaptureQueriesContext(connection) as queries:
        for _ in range(10):
            assert worker._collect()  # runs the next job
        following = claim(worker)  # finishes these ten, claims the next ten
    worker.heartbeat.stop()
    assert len(following) == 10 and worker.executor.busy == 10
    assert Run.objects.count() == 10 and Job.objects.count() == 10
    queue_work = {"postgresql": 1, "mysql": 1 + 4}.get(connection.vendor, 1 + 1 + 10)
    assert len(queries.captured_queries) == queue_work + 10  # and each job's INSERT


@pytest.mark.parametrize(
    ("average_run", "batch", "claimed"),
    [(0.001, 10, 10), (0.01, 10, 6), (0.02, 10, 3), (1.0, 10, 1), (0.001, 1, 1), (None, 10, 1)],
)
def test_a_claim_takes_as_many_jobs_as_run_in_the_batch_window(average_run, batch, claimed):
    worker = make_worker(batch=batch)
    worker.outcomes.average_run = average_run
    assert worker.options.batch_window == 0.05
    assert worker._claim_size() == claimed


@pytest.mark.django_db
def test_prefetched_jobs_are_released_when_the_worker_stops():
    enqueue_many(jobs.record.bind(f"p{i}") for i in range(3))
    worker = make_worker(batch=3)
    first, *claimed = claim(worker)
    assert len(claimed) == 2
    worker.executor.queued.popleft()  # it runs
    worker._release_claimed()
    assert Job.objects.reserved().count() == 1
    assert Job.objects.waiting().count() == 2
    assert [job.pk for job in worker.heartbeat.held()] == [first.pk]
    worker.heartbeat.stop()


@pytest.mark.django_db(transaction=True)
def test_prefetched_jobs_are_kept_alive_by_the_heartbeat_until_they_run():
    enqueue_many(jobs.record.using(retry_after=1).bind(f"s{i}") for i in range(2))
    worker = make_worker(batch=2)
    try:
        _, second = claim(worker)
        time.sleep(2.5)  # more than twice their retry_after
        assert Job.objects.expired() == [] and lifecycle.reclaim_expired() == 0
        worker._collect()  # runs the first
        assert second.attempts == 1
        worker._collect()
        assert claim(worker) == []  # deletes the batch, finds nothing more
    finally:
        worker.heartbeat.stop()
    assert Run.objects.count() == 2 and not Job.objects.exists()


@pytest.mark.django_db
def test_a_job_whose_reservation_was_taken_is_left_alone_by_its_batchs_delete(caplog):
    enqueue_many(jobs.record.bind(f"t{i}") for i in range(3))
    worker = make_worker(batch=3, batch_window=60)
    claimed = claim(worker)
    assert len(claimed) == 3
    taken = claimed[2]
    # Reclaimed and reserved by another worker meanwhile.
    Job.objects.filter(pk=taken.pk).update(attempts=F("attempts") + 1, reserved_by="host:9:zzz")
    with caplog.at_level(logging.WARNING, logger="django_dbqueue"):
        for _ in claimed:
            worker._collect()  # runs the next job
        assert claim(worker) == []  # deletes the batch, finds nothing more
    worker.heartbeat.stop()
    assert list(Job.objects.values_list("pk", flat=True)) == [taken.pk]
    assert any("reservation lost" in record.getMessage() for record in caplog.records)


@pytest.mark.django_db
def test_job_succeeded_is_sent_once_the_batchs_delete_removed_the_row():
    enqueue_many(jobs.record.bind(f"u{i}") for i in range(4))
    rows_left_at_signal: list[bool] = []

    def receiver(sender, job, **kwargs):
        rows_left_at_signal.append(Job.objects.filter(pk=job.pk).exists())

    signals.job_succeeded.connect(receiver)
    try:
        run_worker(batch=4, batch_window=60)
    finally:
        signals.job_succeeded.disconnect(receiver)
    assert rows_left_at_signal == [False] * 4


@pytest.mark.acceptance
@pytest.mark.django_db(transaction=True)
@needs_listen
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


@pytest.mark.django_db
def test_a_stopping_worker_runs_the_jobs_it_has_claimed_instead_of_giving_them_back():
    enqueue_many(jobs.record.bind(f"v{i}") for i in range(4))
    worker = make_worker(batch=4, stop_when_empty=True, sleep=0)

    def stop_at_first_start(sender, **kwargs):
        worker.request_stop()

    signals.job_started.connect(stop_at_first_start)
    try:
        reason = worker.run()  # claims all four, is stopped during the first
    finally:
        signals.job_started.disconnect(stop_at_first_start)
    assert reason is StopReason.SIGNAL
    assert Run.objects.count() == 4 and not Job.objects.exists()


@pytest.mark.django_db
def test_a_worker_that_cannot_finish_its_claimed_jobs_in_time_gives_the_rest_back(monkeypatch):
    enqueue_many(jobs.record.bind(f"w{i}") for i in range(3))
    worker = make_worker(batch=3)
    monkeypatch.setattr("django_dbqueue.worker.STOP_FINISH", 0)
    worker.request_stop()
    assert len(claim(worker)) == 3  # as a worker that was just stopping would hold
    worker._collect()  # runs the first
    assert worker.run() is StopReason.SIGNAL
    assert Run.objects.count() == 1
    assert list(Job.objects.values_list("attempts", "reserved_at")) == [(1, None), (1, None)]


@pytest.mark.parametrize(("slots", "busy", "claimed"), [(4, 4, 4), (4, 2, 6), (1, 1, 0), (1, 0, 2)])
def test_a_pool_claims_ahead_while_every_slot_runs_and_one_slot_runs_its_claims_first(slots, busy, claimed):
    # 50 ms jobs and a 50 ms window: a slot finishes one job in the window, so a pool whose
    # slots all run keeps one job waiting for each; one slot claims again only once it ran
    # what it holds (the --threads 32 drain lost 3-4 % while a busy pool claimed nothing).
    worker = make_worker(batch=10)
    worker.outcomes.average_run = 0.05
    worker.executor = types.SimpleNamespace(capacity=slots, busy=busy, draining=False)  # type: ignore[assignment]
    assert worker._claim_size() == claimed
