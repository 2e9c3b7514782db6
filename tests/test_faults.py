"""Faults with real ``queue_work`` processes: long jobs, a restarted server, killed connections, bad input.

Every test bounds its waits; every process is killed at teardown.
"""

from __future__ import annotations

import datetime as dt
import signal
import time

import pytest
from django.db.models.functions import Now

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




# -- poison input in a real process ------------------------------------------------------------

MODEL = '{"__dbq__": "model", "v": ["testapp.Order", %s]}'
# Rows a bad deploy, a hand edit or a newer version could leave; tests/test_worker.py covers
# the unknown name, invalid JSON, a non-envelope and changed signatures in this process.
POISON = {
    "args-not-a-list": ("tests.add", '{"args": "12", "kwargs": {}}', "PayloadError", "not a job envelope"),
    "kwargs-not-a-dict": ("tests.add", '{"args": [1, 2], "kwargs": [3]}', "PayloadError", "not a job envelope"),
    "a-json-string": ("tests.add", '"args"', "PayloadError", "not a job envelope"),
    "model-pk-of-the-wrong-type": ("tests.testapp.jobs.touch_order", '{"args": [%s], "kwargs": {}}' % (MODEL % '"A-1"'),
                                   "PayloadError", "'A-1'"),
    "model-pk-a-list": ("tests.testapp.jobs.touch_order", '{"args": [%s], "kwargs": {}}' % (MODEL % "[1, 2]"),
                        "PayloadError", "[1, 2]"),
    # A context job reads its position when it starts; any chain step reports progress when it ends.
    "chain-step-not-a-number": (
        "tests.testapp.jobs.fail_once",
        '{"args": ["c"], "kwargs": {}, "chain": {"id": "c1", "step": "two", "total": 3}}',
        "PayloadError", "chain position",
    ),
    "chain-total-missing-its-value": (
        "tests.add", '{"args": [1, 2], "kwargs": {}, "chain": {"id": "c2", "step": 1, "total": null}}',
        "PayloadError", "chain position",
    ),
    "nested-too-deep": ("tests.add", '{"args": [' + "[" * 100_000 + "]" * 100_000 + '], "kwargs": {}}',
                        "PayloadError", "RecursionError"),
}


def test_poison_rows_fail_at_once_with_a_reason_and_the_worker_process_keeps_serving(worker_process):
    rows = {
        label: Job.objects.create(name=name, payload=stored, retry_after=60, available_at=Now(), created_at=Now())
        for label, (name, stored, _cls, _message) in POISON.items()
    }
    jobs.record.enqueue("after-poison")
    process = worker_process("--sleep", "0.05")
    wait_until(lambda: Run.objects.filter(key="after-poison").exists(), 60,
               f"the worker did not get past the poison rows:\n{process.output()}")
    assert process.process.poll() is None, process.output()
    for label, row in rows.items():
        failed = FailedJob.objects.get(job_id=row.pk)
        _name, _stored, exception_class, message = POISON[label]
        assert failed.attempts == 1, label
        assert failed.exception_class.endswith(exception_class), (label, failed.exception_class, failed.error)
        assert "cannot run" in failed.error and message in failed.error, (label, failed.error[-500:])
    process.signal(signal.SIGTERM)
    assert process.wait(timeout=30) == 0, process.output()
    assert not Job.objects.exists()


def test_system_exit_and_keyboard_interrupt_from_a_job_do_not_end_a_worker_process(worker_process):
    jobs.raise_system_exit.enqueue()
    jobs.raise_keyboard_interrupt.enqueue()
    jobs.record.enqueue("after-exits")
    process = worker_process("--sleep", "0.05")
    wait_until(lambda: Run.objects.filter(key="after-exits").exists() and FailedJob.objects.count() == 2, 60,
               f"the worker did not carry on:\n{process.output()}")
    assert process.process.poll() is None, process.output()
    failures = dict(FailedJob.objects.values_list("name", "exception_class"))
    assert failures == {
        "tests.testapp.jobs.raise_system_exit": "builtins.SystemExit",
        "tests.testapp.jobs.raise_keyboard_interrupt": "builtins.KeyboardInterrupt",
    }
    # The job's KeyboardInterrupt is not a signal: the worker neither stops nor counts a signal.
    assert "stopping" not in process.output()
    process.signal(signal.SIGTERM)
    assert process.wait(timeout=30) == 0, process.output()
