"""queue_work --threads and --async-concurrency: many jobs at once in one worker process.

Real worker processes on the test database; every wait is bounded.
"""

from __future__ import annotations

import signal
import time

import pytest
from django.db import connection

from django_dbqueue import enqueue_many
from django_dbqueue.models import FailedJob, Job, JobProgress
from django_dbqueue.worker import EXIT_TIMED_OUT
from tests.conftest import run_worker, wait_until
from tests.testapp import jobs
from tests.testapp.models import Run

# Threads, loops and processes behave alike on every Django: run with one (scripts/test).
pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.acceptance, pytest.mark.one_django]


def test_threads_in_process_run_jobs_at_once():
    enqueue_many(jobs.wait_and_record.bind(f"t-{i}", 0.3) for i in range(16))
    started = time.monotonic()
    run_worker(threads=8)
    elapsed = time.monotonic() - started
    assert Run.objects.count() == 16
    assert not Job.objects.exists() and not FailedJob.objects.exists()
    assert len(set(Run.objects.values_list("note", flat=True))) == 8
    # Two rounds of 0.3 s, not sixteen.
    assert elapsed < 16 * 0.3 / 2, elapsed


def test_async_jobs_share_one_loop():
    enqueue_many(jobs.async_wait_and_record.bind(f"a-{i}", 0.5) for i in range(200))
    started = time.monotonic()
    run_worker(async_concurrency=200)
    elapsed = time.monotonic() - started
    assert Run.objects.filter(note="loop").count() == 200
    assert not Job.objects.exists() and not FailedJob.objects.exists()
    assert elapsed < 200 * 0.5 / 10, elapsed


def test_two_processes_of_eight_threads_run_every_job_exactly_once(worker_process):
    total = 400 if connection.vendor == "sqlite" else 2000
    workers = [worker_process("--threads", "8", "--max-time", "150", "--sleep", "0.05") for _ in range(2)]
    for process in workers:
        process.wait_for_output("worker started")
    enqueue_many(jobs.wait_and_record.bind(f"x-{i}", 0.005) for i in range(total))
    wait_until(lambda: not Job.objects.exists(), 150, "the workers did not drain the queue")
    for process in workers:
        process.signal(signal.SIGTERM)
    for process in workers:
        assert process.wait(timeout=60) == 0, process.output()
    # Run.key is unique: a second run of any job would have failed to insert.
    assert Run.objects.count() == total
    assert not FailedJob.objects.exists()
    assert len(set(Run.objects.values_list("pid", flat=True))) == 2


def test_a_stuck_thread_ends_the_process_and_the_others_go_back(worker_process):
    jobs.sleep_past_timeout.enqueue("stuck")
    enqueue_many(jobs.wait_and_record.bind(f"o-{i}", 20) for i in range(7))
    process = worker_process("--threads", "8", "--sleep", "0.05", env={"DBQUEUE_TEST_TIMEOUT_GRACE": "1"})
    assert process.wait(timeout=30) == EXIT_TIMED_OUT, process.output()
    failed = FailedJob.objects.get()
    assert failed.name == jobs.sleep_past_timeout.name and "JobTimeout" in failed.exception_class
    assert Job.objects.count() == 7
    assert not Job.objects.reserved().exists()
    assert set(Job.objects.values_list("given_back", flat=True)) == {1}


def test_an_async_job_on_the_loop_reports_progress():
    handle = jobs.async_progress.enqueue("p")
    run_worker(async_concurrency=4)
    assert Run.objects.filter(key="p").exists()
    # Written from the loop through the progress thread, then finished by the worker.
    row = JobProgress.objects.get(key=str(handle.id))
    assert row.finished and row.percent == 100
