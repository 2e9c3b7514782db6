"""Waiting for a batch's end: ``BatchHandle.wait`` and ``wait_async``, on every database.

The members are run by a real worker process while this process waits; a wait that times out
leaves the batch as it was; a wait inside a job that could deadlock is refused.
"""

from __future__ import annotations

import asyncio
import time

import pytest
from asgiref.sync import sync_to_async
from django.db import connection, connections

from django_dbqueue import WaitTimeout, batch, batches, get_batch, handles, job
from django_dbqueue.batches import BatchWaitTimeout
from django_dbqueue.models import BatchState, FailedJob, Job
from tests.conftest import run_worker, ticks_while, wait_until
from tests.testapp import jobs
from tests.testapp.models import Run

pytestmark = pytest.mark.django_db(transaction=True)


@job(name="tests.batch_wait.wait_for_batch", tries=1)
def wait_for_batch(batch_id: int, timeout: float | None = None) -> None:
    get_batch(batch_id).wait(timeout=timeout)
    Run.objects.create(key=f"batch-waited-{batch_id}")


@job(name="tests.batch_wait.wait_for_own_batch", tries=1)
def wait_for_own_batch(key: str) -> None:
    member = Job.objects.get(payload__contains=key)
    get_batch(member.batch_id).wait(timeout=5)


def test_wait_returns_once_a_worker_process_has_ended_the_last_member(worker_process):
    handle = batch(*(jobs.record.bind(f"bw-{i}") for i in range(5)), name="five").enqueue()
    worker = worker_process("--sleep", "0.05")
    waited = handle.wait(timeout=60)
    assert waited is handle
    assert handle.finished and handle.state == BatchState.FINISHED, worker.output()
    assert (handle.done, handle.total) == (5, 5)
    assert Run.objects.filter(key__startswith="bw-").count() == 5


def test_a_finished_batch_returns_at_once_and_a_failed_member_still_ends_it():
    handle = batch(jobs.record.bind("bf-ok"), jobs.always_fail.using(tries=1).bind("bf-no")).enqueue()
    run_worker()
    assert handle.wait(timeout=0).finished
    assert handle.failed == 1 and handle.state == BatchState.FAILED


def test_a_wait_that_times_out_raises_wait_timeout_and_leaves_the_batch_alone():
    handle = batch(jobs.record.bind("bt-1"), jobs.record.bind("bt-2"), name="slow").enqueue()
    started = time.monotonic()
    with pytest.raises(WaitTimeout, match=r"batch \d+ \(slow\) is still running after 0.3 s, 0 of 2 members"):
        handle.wait(timeout=0.3)
    assert time.monotonic() - started >= 0.3
    try:
        handle.wait(timeout=0)
    except BatchWaitTimeout as raised:
        assert raised.batch_id == handle.id and raised.status == "running"
        assert isinstance(raised, TimeoutError)
    else:
        raise AssertionError("a wait of 0 s for a pending batch returned")
    assert Job.objects.filter(batch_id=handle.id, attempts=0, reserved_at__isnull=True).count() == 2
    assert not handle.refresh().finished and handle.pending == 2
    with pytest.raises(ValueError, match="timeout must be seconds"):
        handle.wait(timeout=-1)


def test_wait_async_lets_the_event_loop_run_while_a_worker_ends_the_batch(worker_process):
    handle = batch(jobs.record.bind("ba-1"), jobs.record.bind("ba-2")).enqueue()
    worker_process("--sleep", "0.05")
    ticks = ticks_while(lambda: handle.wait_async(timeout=60))
    assert handle.finished and handle.succeeded == 2
    assert ticks >= 1


def test_wait_async_times_out_too():
    handle = batch(jobs.record.bind("bat-1")).enqueue()

    async def main() -> None:
        try:
            await handle.wait_async(timeout=0.2)
        finally:
            await sync_to_async(connections.close_all)()

    with pytest.raises(BatchWaitTimeout):
        asyncio.run(main())
    assert Job.objects.filter(batch_id=handle.id, attempts=0).exists()


def test_a_job_that_waits_for_a_batch_without_a_timeout_is_refused_with_the_deadlock_named():
    other = batch(jobs.record.using(queue="elsewhere").bind("bo-1")).enqueue()
    waiter = wait_for_batch.enqueue(other.id)
    run_worker()
    failed = FailedJob.objects.get(job_id=waiter.id)
    assert failed.exception_class == "builtins.RuntimeError"
    assert f"waits for batch {other.id} without a timeout" in failed.error
    assert "the members it waits for may need the slot this job holds" in failed.error
    assert not other.refresh().finished


def test_a_job_that_waits_for_a_batch_with_a_timeout_may_wait():
    other = batch(jobs.record.using(queue="elsewhere").bind("bo-2")).enqueue()
    run_worker(["elsewhere"])
    waiter = wait_for_batch.enqueue(other.id, 5)
    run_worker()
    assert Run.objects.filter(key=f"batch-waited-{other.id}").exists()
    assert not Job.objects.filter(pk=waiter.id).exists()


def test_a_member_that_waits_for_its_own_batch_is_refused():
    handle = batch(wait_for_own_batch.bind("own-batch-key"), jobs.record.bind("own-other")).enqueue()
    run_worker()
    failed = FailedJob.objects.get(batch_id=handle.id)
    assert f"waits for its own batch {handle.id}: the batch cannot finish while this member runs" in failed.error


needs_postgresql = pytest.mark.skipif(
    "connection.vendor != 'postgresql'", reason="NOTIFY is PostgreSQL's; elsewhere a wait polls"
)


@needs_postgresql
def test_a_batch_wait_is_woken_by_the_batch_end_not_by_polling(worker_process, monkeypatch):
    # Reads a minute apart: only the announcement can end this wait before its timeout.
    monkeypatch.setattr(handles, "WAIT_FIRST", 60.0)
    monkeypatch.setattr(handles, "WAIT_LONGEST", 60.0)
    handle = batch(jobs.record.using(delay=1).bind("bn-1"), jobs.record.bind("bn-2")).enqueue()
    worker_process("--sleep", "0.05")
    started = time.monotonic()
    handle.wait(timeout=30)
    assert handle.finished and handle.succeeded == 2
    # Polling would have read it again only at the timeout (30 s): the announcement woke it.
    assert time.monotonic() - started < 20
    listening = f"LISTEN {batches.lifecycle.BATCH_ENDED_CHANNEL}%"

    def listeners() -> int:
        with connection.cursor() as cursor:
            # This database's sessions only: other databases' waits may listen meanwhile.
            cursor.execute(
                "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND query LIKE %s",
                [listening],
            )
            return int(cursor.fetchone()[0])

    # The listener's connection is closed; its server process may take a moment to leave the view.
    wait_until(lambda: listeners() == 0, 10, "the wait's listening connection was left open")


@needs_postgresql
def test_with_listen_off_a_batch_wait_polls(settings):
    settings.DBQUEUE = {"LISTEN": False}
    handle = batch(jobs.record.bind("bp-1")).enqueue()
    run_worker()
    assert handle.wait(timeout=5).finished
