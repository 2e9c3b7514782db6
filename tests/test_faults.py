"""Faults with real ``queue_work`` processes: long jobs, a restarted server, killed connections, bad input.

Every test bounds its waits; every process is killed at teardown.
"""

from __future__ import annotations

import datetime as dt
import signal
import time

import pytest

from django_dbqueue.models import FailedJob, Job
from tests.conftest import wait_until
from tests.testapp import jobs
from tests.testapp.models import Attempt, Run

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.acceptance]


# -- long jobs and the heartbeat ---------------------------------------------------------------


def test_a_job_running_three_times_its_retry_after_is_not_stolen_from_its_live_worker(worker_process):
    # retry_after=2 s on the row, a 6 s run: without a heartbeat the idle second
    # worker reclaims the reservation at 2 s and runs the job again in parallel.
    row = jobs.long_running.using(retry_after=2).enqueue("long", 6)
    first = worker_process("--sleep", "0.05")
    wait_until(lambda: Attempt.objects.filter(key="long").exists(), 30, "the job never started")
    reserved_at = Job.objects.get(pk=row.pk).reserved_at
    second = worker_process("--sleep", "0.05")
    second.wait_for_output("worker started")
    latest = reserved_at
    deadline = time.monotonic() + 30
    while not Run.objects.filter(key="long").exists():
        assert time.monotonic() < deadline, f"the job never finished:\n{first.output()}"
        current = Job.objects.filter(pk=row.pk).values_list("reserved_at", flat=True).first()
        if current is not None:
            latest = max(latest, current)
        time.sleep(0.1)
    assert list(Attempt.objects.values_list("attempt", flat=True)) == [1], second.output()
    assert Run.objects.get(key="long").pid == first.pid
    assert latest - reserved_at >= dt.timedelta(seconds=2), "the reservation was never extended"
    assert not Job.objects.exists() and not FailedJob.objects.exists()
    assert "reclaimed" not in first.output() + second.output()
    for process in (first, second):
        process.signal(signal.SIGTERM)
        assert process.wait(timeout=30) == 0, process.output()


def test_a_killed_workers_long_job_is_still_reclaimed_after_its_retry_after(worker_process):
    jobs.long_running.using(retry_after=2).enqueue("orphan", 3)
    first = worker_process("--sleep", "0.05")
    wait_until(lambda: Attempt.objects.filter(key="orphan").exists(), 30, "the job never started")
    second = worker_process("--sleep", "0.05")
    second.wait_for_output("worker started")
    time.sleep(1.5)  # past a heartbeat or two
    first.signal(signal.SIGKILL)
    first.wait(timeout=10)
    killed = time.monotonic()
    wait_until(lambda: Attempt.objects.filter(key="orphan", attempt=2).exists(), 15,
               f"the dead worker's job was not reclaimed:\n{second.output()}")
    # The last heartbeat was at most retry_after / 3 before the kill.
    assert time.monotonic() - killed < 2 + 1.5
    wait_until(lambda: Run.objects.filter(key="orphan").exists(), 30, "the job never ran again")
    assert Run.objects.get(key="orphan").pid == second.pid
    assert list(Attempt.objects.order_by("attempt").values_list("attempt", flat=True)) == [1, 2]
    second.signal(signal.SIGTERM)
    assert second.wait(timeout=30) == 0
    assert not Job.objects.exists() and not FailedJob.objects.exists()
