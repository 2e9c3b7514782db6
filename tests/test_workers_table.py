"""The workers table and the run history, written by real ``queue_work`` processes."""

from __future__ import annotations

import signal

import pytest
from django.test import override_settings

from django_dbqueue import enqueue_many, history, workers
from django_dbqueue.models import FailedJob, Job, JobHistory, QueueWorker
from tests.conftest import wait_until
from tests.testapp import jobs
from tests.testapp.models import Attempt, Run

# Worker processes behave alike on every Django: scripts/test runs these with one.
pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.acceptance, pytest.mark.one_django]

FAST_BEAT = {"DBQUEUE_TEST_WORKER_BEAT": "0.5"}


def rows() -> dict[int, QueueWorker]:
    return {row.pid: row for row in QueueWorker.objects.all()}


def test_two_running_workers_have_rows_that_go_with_a_clean_stop(worker_process):
    first = worker_process("--sleep", "0.05", "--queue", "default,low", env=FAST_BEAT)
    second = worker_process("--sleep", "0.05", "--threads", "2", env=FAST_BEAT)
    enqueue_many(jobs.record.bind(f"r{i}") for i in range(20))
    jobs.attempt_and_wait.enqueue("long", 6)
    wait_until(lambda: len(rows()) == 2, 30, "the workers did not write their rows")
    wait_until(lambda: Run.objects.count() == 20, 30, "the workers did not run the jobs")
    # The beat carries the counts and the job running now (the long one, on one of them);
    # a job that ran may wait for its batched DELETE before it counts as processed.
    wait_until(
        lambda: (
            sum(row.processed for row in rows().values()) >= 10
            and sum(row.running for row in rows().values()) == 1
            and any(row.current_job.startswith(f"{jobs.attempt_and_wait.name} #") for row in rows().values())
        ),
        30,
        "the beats did not carry the counts",
    )
    by_pid = rows()
    assert by_pid[first.pid].queue_list == ["default", "low"]
    assert "threads=2" in by_pid[second.pid].options and "batch=" in by_pid[first.pid].options
    assert not QueueWorker.objects.filter(workers.dead_rows()).exists()
    for process in (first, second):
        process.signal(signal.SIGTERM)
    for process in (first, second):
        assert process.wait(timeout=60) == 0, process.output()[-2000:]
    assert not QueueWorker.objects.exists()


def test_a_killed_worker_is_recognised_dead_and_its_job_reclaimed_before_its_retry_after(worker_process):
    # retry_after is 60 s; the beat 0.5 s: dead after three missed beats, 1.5 s.
    jobs.attempt_and_wait.enqueue("victim", 30, again=0.05)
    victim = worker_process("--sleep", "0.05", env=FAST_BEAT)
    wait_until(lambda: Attempt.objects.filter(key="victim").exists(), 30, "the job never started")
    victim.process.kill()
    victim.process.wait(timeout=10)
    with override_settings(DBQUEUE={"WORKER_BEAT": 0.5}):
        wait_until(
            lambda: QueueWorker.objects.filter(workers.dead_rows(), pid=victim.pid).exists(),
            15,
            "the killed worker's row was not recognised as dead",
        )
    rescuer = worker_process("--sleep", "0.05", env=FAST_BEAT)
    wait_until(lambda: Run.objects.filter(key="victim").exists(), 20, f"not reclaimed early:\n{rescuer.output()}")
    assert Run.objects.get(key="victim").note.startswith("attempt=2 ")
    assert "of dead worker_id=" in rescuer.output()
    rescuer.signal(signal.SIGTERM)
    assert rescuer.wait(timeout=30) == 0
    assert not Job.objects.exists() and not FailedJob.objects.exists()


def test_the_history_adds_up_exactly_to_the_jobs_run(worker_process):
    calls = [jobs.record.bind(f"ok{i}") for i in range(700)]
    calls += [jobs.fail_once.bind(f"once{i}") for i in range(200)]  # fails, then succeeds
    calls += [jobs.always_fail.bind(f"bad{i}") for i in range(100)]  # tries=2: retried, then failed
    enqueue_many(calls)
    workers_ = [worker_process("--sleep", "0.05", "--backoff", "0") for _ in range(2)]
    wait_until(lambda: not Job.objects.exists() and FailedJob.objects.count() == 100, 120, "the workers did not drain")
    for process in workers_:
        process.signal(signal.SIGTERM)
    for process in workers_:
        assert process.wait(timeout=60) == 0, process.output()[-2000:]
    total = history.totals(JobHistory.objects.all())[None]
    assert (total.started, total.succeeded, total.failed, total.retried) == (1300, 900, 100, 300)
    assert sum(total.bins) == total.ended == 1300
    by_name = history.totals(JobHistory.objects.all(), by="name")
    assert (by_name[jobs.fail_once.name].retried, by_name[jobs.fail_once.name].succeeded) == (200, 200)
    assert (by_name[jobs.always_fail.name].retried, by_name[jobs.always_fail.name].failed) == (100, 100)
    assert total.run_time > 0 and total.percentile(0.5) is not None
