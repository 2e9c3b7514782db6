"""Waiting for a job's end (issue 29): ``JobHandle.wait`` and ``wait_async``, on every database.

The job is run by a real worker process while this process waits; a wait that times out leaves
the job as it was; a wait inside a job that could deadlock is refused.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import time

import pytest
from asgiref.sync import sync_to_async
from django.db import connection, connections

from django_dbqueue import JobStatus, WaitTimeout, handles
from django_dbqueue.db import IdListener, alias, notify_ids
from django_dbqueue.handles import ENDED_CHANNEL
from django_dbqueue.models import FailedJob, Job
from django_dbqueue.running import current_job
from tests.conftest import run_worker, ticks_while, wait_until
from tests.testapp import jobs
from tests.testapp.models import Run

pytestmark = pytest.mark.django_db(transaction=True)


async def close_async_connections() -> None:
    """Close the connection of the thread ``sync_to_async`` ran the reads in (as an ASGI handler does
    at a request's end), so the test database can be dropped."""
    await sync_to_async(connections.close_all)()


def test_wait_returns_once_a_worker_process_has_run_the_job_with_its_result(worker_process):
    handle = jobs.keep_result.enqueue(7)
    worker = worker_process("--sleep", "0.05")
    waited = handle.wait(timeout=60)
    assert waited is handle
    assert handle.status is JobStatus.SUCCEEDED, worker.output()
    assert handle.result == {"x": 7, "when": dt.datetime(2030, 1, 2, 3, 4, 5, tzinfo=dt.UTC)}
    assert not Job.objects.filter(pk=handle.id).exists()


def test_wait_returns_a_failed_job_as_failed_without_raising_its_error(worker_process):
    handle = jobs.always_fail.enqueue("w")
    worker_process("--sleep", "0.05", "--tries", "1")
    handle.wait(timeout=60)
    assert handle.status is JobStatus.FAILED
    assert FailedJob.objects.filter(job_id=handle.id).exists()


def test_a_wait_that_times_out_raises_wait_timeout_and_leaves_the_job_alone():
    handle = jobs.record.enqueue("nobody-runs-me")
    started = time.monotonic()
    with pytest.raises(WaitTimeout, match=r"is still waiting after 0.3 s; it was left as it is") as raised:
        handle.wait(timeout=0.3)
    assert 0.3 <= time.monotonic() - started < 5
    assert raised.value.job_id == handle.id and raised.value.status == "waiting"
    assert isinstance(raised.value, TimeoutError)
    row = Job.objects.get(pk=handle.id)
    assert row.attempts == 0 and row.reserved_at is None


def test_wait_with_a_timedelta_and_zero():
    handle = jobs.record.enqueue("zero")
    with pytest.raises(WaitTimeout):
        handle.wait(timeout=dt.timedelta(0))
    with pytest.raises(ValueError, match="timeout must be seconds"):
        handle.wait(timeout=-1)
    run_worker()
    assert handle.wait(timeout=dt.timedelta(seconds=1)).status is JobStatus.SUCCEEDED


def test_wait_async_lets_the_event_loop_run_while_a_worker_runs_the_job(worker_process):
    handle = jobs.keep_result.enqueue(3)
    worker_process("--sleep", "0.05")
    ticks = ticks_while(lambda: handle.wait_async(timeout=60))
    assert handle.status is JobStatus.SUCCEEDED and handle.result["x"] == 3
    assert ticks >= 1


def test_wait_async_times_out_too():
    handle = jobs.record.enqueue("async-timeout")

    async def main() -> None:
        try:
            await handle.wait_async(timeout=0.2)
        finally:
            await close_async_connections()

    with pytest.raises(WaitTimeout):
        asyncio.run(main())
    assert Job.objects.filter(pk=handle.id, attempts=0).exists()


def test_a_job_that_waits_for_another_without_a_timeout_is_refused_with_the_deadlock_named():
    other = jobs.record.using(queue="elsewhere").enqueue("other")
    waiter = jobs.wait_for_job.enqueue(other.id)
    run_worker()
    failed = FailedJob.objects.get(job_id=waiter.id)
    assert failed.exception_class == "builtins.RuntimeError"
    assert f"waits for job {other.id} without a timeout" in failed.error
    assert "may need the slot this job holds" in failed.error
    assert Job.objects.filter(pk=other.id, attempts=0).exists()


def test_a_job_that_waits_for_another_with_a_timeout_may_wait():
    other = jobs.record.using(queue="elsewhere").enqueue("other-timed")
    waiter = jobs.wait_for_job.enqueue(other.id, 0.2)
    run_worker()
    failed = FailedJob.objects.get(job_id=waiter.id)
    assert failed.exception_class.endswith("WaitTimeout"), failed.exception_class
    # Once the other job has run, the same wait inside a job sees it finished.
    run_worker(["elsewhere"])
    again = jobs.wait_for_job.enqueue(other.id, 5)
    run_worker()
    assert Run.objects.get(key=f"waited-{other.id}").note == "succeeded"
    assert not Job.objects.filter(pk=again.id).exists()


def test_a_job_that_waits_for_itself_is_refused():
    waiter = jobs.wait_for_itself.enqueue()
    run_worker()
    failed = FailedJob.objects.get(job_id=waiter.id)
    assert "waits for itself: it would never finish" in failed.error


def test_outside_a_job_no_job_is_current():
    assert current_job() is None


needs_postgresql = pytest.mark.skipif(
    "connection.vendor != 'postgresql'", reason="NOTIFY is PostgreSQL's; elsewhere a wait polls"
)


@needs_postgresql
def test_the_end_of_a_job_that_keeps_its_result_is_announced_once_its_transaction_commits():
    listener = IdListener(alias(), ENDED_CHANNEL)
    assert listener.open()
    try:
        handle = jobs.keep_result.enqueue(1)
        failing = jobs.keep_after_one_failure.using(tries=1).enqueue("ends-failed")
        plain = jobs.record.enqueue("no-result")
        run_worker()
        heard: set[int] = set()
        deadline = time.monotonic() + 10
        while {handle.id, failing.id} - heard and time.monotonic() < deadline:
            heard |= listener.wait(deadline - time.monotonic())
        assert {handle.id, failing.id} <= heard
        # A job that keeps no result writes nothing at its end: nothing is sent for it.
        assert plain.id not in heard | listener.wait(0.2)
    finally:
        listener.close()


@needs_postgresql
def test_a_wait_for_a_job_that_keeps_its_result_is_woken_by_its_end_not_by_polling(worker_process, monkeypatch):
    # Reads a minute apart: only the announcement can end this wait before its timeout.
    monkeypatch.setattr(handles, "WAIT_FIRST", 60.0)
    monkeypatch.setattr(handles, "WAIT_LONGEST", 60.0)
    handle = jobs.keep_result.using(delay=1).enqueue(5)
    worker_process("--sleep", "0.05")
    started = time.monotonic()
    handle.wait(timeout=30)
    assert handle.status is JobStatus.SUCCEEDED and handle.result["x"] == 5
    # Polling would have read it again only at the timeout (30 s): the announcement woke it.
    assert time.monotonic() - started < 20
    # The wait's own connection is closed again (its server process may take a moment to leave the
    # view; this database's sessions only: other databases' waits may listen meanwhile).

    def listeners() -> int:
        with connection.cursor() as cursor:
            cursor.execute(
                "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
                "AND query LIKE 'LISTEN dbqueue_ended%%'"
            )
            return int(cursor.fetchone()[0])

    wait_until(lambda: listeners() == 0, 10, "the wait's listening connection was left open")


def test_elsewhere_nothing_is_sent_and_a_wait_does_not_listen():
    if connection.vendor == "postgresql":
        pytest.skip("this is the other databases' behaviour")
    assert not IdListener(alias(), ENDED_CHANNEL).open()
    notify_ids(alias(), ENDED_CHANNEL, [1, 2])  # a no-op, no error
