"""A job whose database connection breaks under it is given back without spending a try
(issue 16, point 14), a bounded number of times; a query the database refuses spends one."""

from __future__ import annotations

import pytest
from django.db import DatabaseError, connection

from django_dbqueue.db import apply_network_timeout
from django_dbqueue.models import FailedJob, Job
from django_dbqueue.outcomes import MAX_GIVE_BACKS
from tests.conftest import claim, kill_session, run_worker, wait_until
from tests.testapp import jobs
from tests.testapp.models import Attempt, Run

needs_server = pytest.mark.skipif(
    "connection.vendor == 'sqlite'", reason="SQLite has no server session that can be lost"
)


@needs_server
@pytest.mark.acceptance
@pytest.mark.django_db(transaction=True)
def test_a_job_whose_session_is_killed_three_times_with_tries_2_is_given_back_and_then_succeeds(worker_process):
    job = jobs.wait_for_session_kill.enqueue("k", 3)
    worker = worker_process("--sleep", "0.05")
    killed: list[int] = []
    for n in range(1, 4):
        wait_until(
            lambda n=n: Attempt.objects.filter(key="k").exclude(attempt=0).count() >= n,
            30,
            f"run {n} never started:\n{worker.output()}",
        )
        session = (
            Attempt.objects.filter(key="k").exclude(attempt=0).order_by("-id").values_list("attempt", flat=True)[0]
        )
        killed.append(session)
        kill_session(session)
    wait_until(lambda: Run.objects.filter(key="k").exists(), 30, f"the job never succeeded:\n{worker.output()}")
    wait_until(lambda: not Job.objects.filter(pk=job.pk).exists(), 10, "the job row was not deleted")
    assert not FailedJob.objects.exists()
    assert Attempt.objects.filter(key="k").count() == 4
    # The worker logs the outcome after the row's delete commits: wait for the line, not just the row.
    wait_until(lambda: "attempt=4 outcome=" in worker.output(), 10, f"no outcome logged:\n{worker.output()}")
    output = worker.output()
    assert output.count("given_back=connection_lost") == 3, output
    assert "attempt=4 outcome=succeeded" in output, output


@needs_server
@pytest.mark.django_db(transaction=True)
def test_a_job_that_always_breaks_its_own_connection_still_ends_in_failed_job():
    jobs.kill_own_session.enqueue("self")
    run_worker()
    connection.close()
    failed = FailedJob.objects.get()
    # Given back MAX_GIVE_BACKS times without spending a try, then its two tries.
    assert failed.attempts == MAX_GIVE_BACKS + 2
    assert Attempt.objects.filter(key="self").count() == MAX_GIVE_BACKS + 2
    assert not Job.objects.exists()


@pytest.mark.django_db(transaction=True)
def test_a_query_the_database_refuses_spends_a_try_like_any_exception(caplog):
    jobs.refused_query.enqueue("refused")
    run_worker()
    failed = FailedJob.objects.get()
    assert failed.attempts == 2 and Attempt.objects.filter(key="refused").count() == 2
    assert "given_back" not in caplog.text


@pytest.mark.django_db(transaction=True)
def test_jobs_a_stopping_worker_gives_back_unrun_spend_no_try():
    # Claimed in one batch; the worker is asked to stop before it starts them.
    for i in range(3):
        jobs.record.using(tries=1).enqueue(f"g{i}")
    from django_dbqueue.execution import Defaults
    from django_dbqueue.worker import Worker, WorkerOptions

    worker = Worker(WorkerOptions(queues=["default"], defaults=Defaults(tries=1, timeout=30, backoff=0), sleep=0))
    worker.outcomes.average_run = 0.001  # claim a batch at once
    claimed, *others = claim(worker)
    assert len(others) == 2
    worker.executor.queued.popleft()  # it runs
    worker._release_claimed()
    worker.heartbeat.stop()
    given_back = Job.objects.exclude(pk=claimed.pk)
    assert [(job.attempts, job.given_back, job.tries_spent) for job in given_back] == [(1, 1, 0), (1, 1, 0)]
    Job.objects.filter(pk=claimed.pk).delete()
    # With tries=1, each still runs: the give-back spent nothing.
    run_worker()
    assert Run.objects.count() == 2
    assert not FailedJob.objects.exists()


@needs_server
@pytest.mark.django_db(transaction=True)
def test_a_worker_started_on_a_connection_lost_since_its_last_query_opens_a_fresh_one():
    """``queue_work``'s start-up checks use the connection; a restart or a killed session between them
    and the worker's start left a connection whose socket the driver refuses to name, and the worker
    died at start instead of reconnecting."""
    jobs.record.enqueue("after-loss")
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_backend_pid()" if connection.vendor == "postgresql" else "SELECT CONNECTION_ID()")
        session = cursor.fetchone()[0]
    kill_session(session)
    with pytest.raises(DatabaseError), connection.cursor() as cursor:
        cursor.execute("SELECT 1")
    # The driver's connection is now closed, still held by Django's wrapper: what the worker finds.
    assert connection.connection is not None
    assert apply_network_timeout(connection) is False
    run_worker()
    assert Run.objects.filter(key="after-loss").exists()
