"""queue_work --threads and --async-concurrency: what happens to each job the
process holds on a signal, a timeout, a crash, a cancel, and a job that raises.

tests/test_pool.py has the first tests of the feature (exactly-once with
2 processes x 8 threads, one stuck thread); these test the rest of the
semantics, with real worker processes wherever a process may end.
"""

from __future__ import annotations

import math
import os
import signal
import threading
import time

import pytest
from django.db import connection

from django_dbqueue import chain, enqueue_many, get_progress, signals
from django_dbqueue.checks import check_worker_connections
from django_dbqueue.models import FailedJob, Job
from django_dbqueue.pool import connections_per_process
from django_dbqueue.worker import EXIT_TIMED_OUT, StopReason
from tests.conftest import children_of, run_worker, wait_until
from tests.testapp import jobs
from tests.testapp.models import Attempt, Run

# Threads, loops and processes behave alike on every Django: run with one (scripts/test).
pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.acceptance, pytest.mark.one_django]

TIMEOUT = "django_dbqueue.exceptions.JobTimeout"
CANCELLED = "django_dbqueue.exceptions.JobCancelled"
# Seconds a job is given after its timeout (or a forced stop) before the process gives up on it.
GRACE = {"DBQUEUE_TEST_TIMEOUT_GRACE": "1"}


def attempts_of(key: str) -> list[int]:
    return list(Attempt.objects.filter(key=key).order_by("attempt").values_list("attempt", flat=True))


def started(prefix: str) -> int:
    return Attempt.objects.filter(key__startswith=prefix).count()


# -- stopping --------------------------------------------------------------------------


def test_sigterm_finishes_the_running_jobs_and_gives_back_the_claimed_ones(worker_process):
    # 12 slots claim 12 sync jobs: 8 run in the threads, 4 wait for a thread.
    enqueue_many(jobs.attempt_and_wait.bind(f"s-{i}", 2) for i in range(12))
    process = worker_process("--threads", "8", "--async-concurrency", "4", "--sleep", "0.05")
    wait_until(
        lambda: started("s-") == 8 and Job.objects.reserved().count() == 12, 30, f"not 8 running:\n{process.output()}"
    )
    process.signal(signal.SIGTERM)
    assert process.wait(timeout=30) == 0, process.output()
    ran = set(Run.objects.values_list("key", flat=True))
    assert ran == set(Attempt.objects.values_list("key", flat=True)) and len(ran) == 8
    assert not FailedJob.objects.exists()
    left = list(Job.objects.values_list("reserved_at", "attempts", "given_back"))
    assert left == [(None, 1, 1)] * 4, "the jobs that had not started go back without spending a try"


def test_a_second_sigterm_asks_the_running_jobs_to_stop_and_gives_back_one_that_does_not(worker_process):
    enqueue_many(jobs.attempt_and_wait.bind(f"i-{i}", 30) for i in range(3))
    jobs.attempt_and_sleep.enqueue("asleep", 30)
    process = worker_process("--threads", "4", "--sleep", "0.05", env=GRACE)
    wait_until(lambda: started("") == 4, 30, f"the jobs never started:\n{process.output()}")
    process.signal(signal.SIGTERM)
    process.wait_for_output("finishing the current job")
    second = time.monotonic()
    process.signal(signal.SIGTERM)
    code = process.wait(timeout=30)
    assert time.monotonic() - second < 10, process.output()
    assert not Run.objects.exists() and not FailedJob.objects.exists()
    # They looked (context.check_cancelled) and stopped with WorkerStopped: released.
    interrupted = Job.objects.filter(name=jobs.attempt_and_wait.name)
    assert list(interrupted.values_list("reserved_at", "attempts", "given_back")) == [(None, 1, 0)] * 3
    # Never looked, still in time.sleep one grace later: given back, not recorded as a failure.
    stuck = Job.objects.get(name=jobs.attempt_and_sleep.name)
    assert (stuck.reserved_at, stuck.given_back) == (None, 1), process.output()
    assert "did not stop: given back" in process.output()
    assert code == 0, process.output()


def test_sigterm_lets_the_async_jobs_in_flight_finish_and_gives_back_those_waiting_for_a_slot(worker_process):
    # 8 slots claim 8 async jobs: 4 are in flight on the loop, 4 wait for a loop slot.
    enqueue_many(jobs.async_attempt_and_wait.bind(f"as-{i}", 2) for i in range(8))
    process = worker_process("--threads", "4", "--async-concurrency", "4", "--sleep", "0.05")
    wait_until(
        lambda: started("as-") == 4 and Job.objects.reserved().count() == 8, 30, f"not 4 in flight:\n{process.output()}"
    )
    process.signal(signal.SIGTERM)
    assert process.wait(timeout=30) == 0, process.output()
    ran = set(Run.objects.values_list("key", flat=True))
    assert ran == set(Attempt.objects.values_list("key", flat=True)) and len(ran) == 4
    assert not FailedJob.objects.exists()
    assert list(Job.objects.values_list("reserved_at", "attempts", "given_back")) == [(None, 1, 1)] * 4


def test_a_second_sigterm_cancels_the_async_jobs_in_flight_and_releases_them(worker_process):
    enqueue_many(jobs.async_attempt_and_wait.bind(f"ac-{i}", 30) for i in range(4))
    process = worker_process("--async-concurrency", "4", "--sleep", "0.05", env=GRACE)
    wait_until(lambda: started("ac-") == 4, 30, f"the jobs never started:\n{process.output()}")
    process.signal(signal.SIGTERM)
    process.wait_for_output("finishing the current job")
    second = time.monotonic()
    process.signal(signal.SIGTERM)
    assert process.wait(timeout=30) == 0, process.output()
    assert time.monotonic() - second < 5, process.output()
    assert not Run.objects.exists() and not FailedJob.objects.exists()
    assert list(Job.objects.values_list("reserved_at", "attempts")) == [(None, 1)] * 4
    assert process.output().count("error=django_dbqueue.exceptions.WorkerStopped") == 4


# -- timeouts ----------------------------------------------------------------------------


def test_a_timeout_in_one_thread_is_retried_and_failed_while_seven_others_run_on(worker_process):
    # It looks whether it was asked to stop: it stops there, and its process goes on.
    jobs.busy_past_timeout.using(tries=2).enqueue("busy")
    # Longer than the busy job's two timeouts plus the grace: a process that ended for it
    # would give these back before they finish.
    enqueue_many(jobs.attempt_and_wait.bind(f"o-{i}", 4) for i in range(7))
    process = worker_process("--threads", "8", "--sleep", "0.05", env=GRACE)
    wait_until(lambda: FailedJob.objects.exists(), 30, f"the busy job never failed:\n{process.output()}")
    failed = FailedJob.objects.get()
    assert (failed.name, failed.exception_class, failed.attempts) == (jobs.busy_past_timeout.name, TIMEOUT, 2)
    assert attempts_of("busy") == [0, 0] and not Run.objects.filter(key="busy").exists()
    wait_until(lambda: Run.objects.count() == 7, 30, f"the other jobs did not finish:\n{process.output()}")
    assert set(Run.objects.values_list("pid", flat=True)) == {process.pid}
    assert all(note.startswith("attempt=1 given_back=0 ") for note in Run.objects.values_list("note", flat=True))
    jobs.record.enqueue("after")
    wait_until(lambda: Run.objects.filter(key="after").exists(), 30, f"the worker stopped serving:\n{process.output()}")
    process.signal(signal.SIGTERM)
    assert process.wait(timeout=30) == 0, process.output()
    assert "ending the process" not in process.output()


def test_an_async_timeout_cancels_that_job_at_its_await_and_the_loop_runs_on(worker_process):
    jobs.async_past_timeout.enqueue("late")
    enqueue_many(jobs.async_wait_and_record.bind(f"a-{i}", 3) for i in range(3))
    process = worker_process("--async-concurrency", "4", "--sleep", "0.05", env=GRACE)
    wait_until(lambda: FailedJob.objects.exists(), 30, f"the late job never failed:\n{process.output()}")
    failed = FailedJob.objects.get()
    assert (failed.name, failed.exception_class) == (jobs.async_past_timeout.name, TIMEOUT)
    wait_until(lambda: Run.objects.count() == 3, 30, f"the other jobs did not finish:\n{process.output()}")
    assert not Run.objects.filter(key="late").exists()
    jobs.async_wait_and_record.enqueue("after", 0)
    wait_until(lambda: Run.objects.filter(key="after").exists(), 30, f"the loop stopped serving:\n{process.output()}")
    process.signal(signal.SIGTERM)
    assert process.wait(timeout=30) == 0, process.output()
    assert "ending the process" not in process.output()


def test_a_stuck_thread_ends_its_process_and_a_fresh_one_runs_the_jobs_it_gave_back(worker_process):
    jobs.sleep_past_timeout.enqueue("stuck")
    enqueue_many(jobs.attempt_and_wait.bind(f"g-{i}", 30, again=0) for i in range(7))
    process = worker_process("--concurrency", "1", "--threads", "8", "--sleep", "0.05", env=GRACE)
    wait_until(lambda: started("g-") == 7, 30, f"the jobs never started:\n{process.output()}")
    [first] = children_of(process.pid)
    wait_until(lambda: Run.objects.count() == 7, 30, f"the jobs given back did not run again:\n{process.output()}")
    failed = FailedJob.objects.get()
    assert (failed.name, failed.exception_class) == (jobs.sleep_past_timeout.name, TIMEOUT)
    for key in (f"g-{i}" for i in range(7)):
        assert attempts_of(key) == [1, 2], key
    # Given back by the stuck process (no try spent), run by its replacement.
    assert {note.split(" thread=")[0] for note in Run.objects.values_list("note", flat=True)} == {
        "attempt=2 given_back=1"
    }
    assert first not in set(Run.objects.values_list("pid", flat=True))
    assert "ended after a job that did not stop" in process.output()
    process.signal(signal.SIGTERM)
    assert process.wait(timeout=30) == 0, process.output()
    assert not Job.objects.exists()


def test_an_async_job_blocking_the_loop_ends_the_process_and_every_other_job_goes_back(worker_process):
    jobs.async_block_loop.enqueue("blocker")
    enqueue_many(jobs.async_wait_and_record.bind(f"l-{i}", 30) for i in range(2))
    enqueue_many(jobs.attempt_and_wait.bind(f"t-{i}", 30) for i in range(2))
    process = worker_process("--threads", "2", "--async-concurrency", "4", "--sleep", "0.05", env=GRACE)
    assert process.wait(timeout=30) == EXIT_TIMED_OUT, process.output()
    failed = FailedJob.objects.get()
    assert (failed.name, failed.exception_class) == (jobs.async_block_loop.name, TIMEOUT)
    assert started("t-") == 2, "the thread jobs ran next to the blocked loop"
    others = list(Job.objects.values_list("name", "reserved_at", "attempts", "given_back"))
    assert sorted(others) == sorted(
        [(jobs.async_wait_and_record.name, None, 1, 1)] * 2 + [(jobs.attempt_and_wait.name, None, 1, 1)] * 2
    )
    assert not Run.objects.exists()


def test_processes_times_threads_under_the_supervisor_run_every_job_once_and_stop_when_empty(worker_process):
    total = 100 if connection.vendor == "sqlite" else 400
    enqueue_many(jobs.wait_and_record.bind(f"d-{i}", 0.01) for i in range(total))
    process = worker_process("--concurrency", "2", "--threads", "4", "--stop-when-empty", "--sleep", "0.05")
    assert process.wait(timeout=120) == 0, process.output()
    # Run.key is unique: a second run of any job would have failed to insert.
    assert Run.objects.count() == total
    assert not Job.objects.exists() and not FailedJob.objects.exists()
    assert process.pid not in set(Run.objects.values_list("pid", flat=True))
    assert len(set(Run.objects.values_list("pid", "note"))) > 2, "the jobs did not run in several threads"


# -- crashes, jobs that raise, cancel -------------------------------------------------------


def test_kill_9_of_a_threaded_child_reclaims_its_eight_jobs_at_once(worker_process):
    enqueue_many(jobs.attempt_and_wait.bind(f"k-{i}", 30, again=0) for i in range(8))
    process = worker_process("--concurrency", "1", "--threads", "8", "--sleep", "0.05")
    wait_until(lambda: started("k-") == 8, 30, f"the jobs never started:\n{process.output()}")
    [child] = children_of(process.pid)
    os.kill(child, signal.SIGKILL)
    # Well before their retry_after (60 s): reclaimed by the supervisor, not by expiry.
    wait_until(lambda: Run.objects.count() == 8, 20, f"the jobs were not run again:\n{process.output()}")
    for key in (f"k-{i}" for i in range(8)):
        assert attempts_of(key) == [1, 2], key
    assert child not in set(Run.objects.values_list("pid", flat=True))
    assert "reclaimed jobs=8" in process.output()
    process.signal(signal.SIGTERM)
    assert process.wait(timeout=30) == 0, process.output()
    assert not Job.objects.exists() and not FailedJob.objects.exists()


def test_jobs_that_raise_in_their_threads_leave_the_other_threads_running(caplog):
    enqueue_many(
        [
            jobs.thread_unsafe.bind("unsafe-1"),
            jobs.thread_unsafe.bind("unsafe-2"),
            jobs.raise_keyboard_interrupt.bind(),
            jobs.raise_system_exit.bind(),
            *(jobs.wait_and_record.bind(f"u-{i}", 0.2) for i in range(12)),
        ]
    )
    _, reason = run_worker(threads=4)
    assert reason is StopReason.EMPTY
    assert Run.objects.count() == 12
    failed = dict(FailedJob.objects.values_list("name", "exception_class"))
    assert failed == {
        jobs.thread_unsafe.name: "builtins.RuntimeError",
        jobs.raise_keyboard_interrupt.name: "builtins.KeyboardInterrupt",
        jobs.raise_system_exit.name: "builtins.SystemExit",
    }
    assert FailedJob.objects.filter(name=jobs.thread_unsafe.name).count() == 2
    # Their transactions were rolled back with the connections they were left open on.
    assert not Attempt.objects.filter(key__startswith="unsafe-").exists()
    assert caplog.text.count("left a transaction open") == 2
    assert not Job.objects.exists()


def test_a_hard_cancel_stops_one_thread_job_that_looks_and_the_seven_others_finish(worker_process):
    handle = jobs.attempt_and_wait.enqueue("cancel-me", 30)
    enqueue_many(jobs.attempt_and_wait.bind(f"c-{i}", 3) for i in range(7))
    process = worker_process("--threads", "8", "--sleep", "0.05", env=GRACE)
    wait_until(lambda: started("") == 8, 30, f"the jobs never started:\n{process.output()}")
    assert handle.cancel(hard=True)
    wait_until(lambda: FailedJob.objects.exists(), 15, f"the job was not cancelled:\n{process.output()}")
    failed = FailedJob.objects.get()
    assert (failed.job_id, failed.exception_class) == (handle.id, CANCELLED)
    wait_until(lambda: Run.objects.count() == 7, 30, f"the other jobs did not finish:\n{process.output()}")
    assert not Run.objects.filter(key="cancel-me").exists() and attempts_of("cancel-me") == [1]
    assert process.process.poll() is None, process.output()
    process.signal(signal.SIGTERM)
    assert process.wait(timeout=30) == 0, process.output()
    assert "ending the process" not in process.output()


def test_a_hard_cancel_of_a_thread_job_that_does_not_look_ends_the_process_in_order(worker_process):
    handle = jobs.attempt_and_sleep.enqueue("asleep", 30)
    enqueue_many(jobs.attempt_and_wait.bind(f"h-{i}", 30) for i in range(3))
    process = worker_process("--threads", "4", "--sleep", "0.05", env=GRACE)
    wait_until(lambda: started("") == 4, 30, f"the jobs never started:\n{process.output()}")
    assert handle.cancel(hard=True)
    assert process.wait(timeout=30) == EXIT_TIMED_OUT, process.output()
    failed = FailedJob.objects.get()
    assert (failed.job_id, failed.exception_class) == (handle.id, CANCELLED)
    assert list(Job.objects.values_list("reserved_at", "attempts", "given_back")) == [(None, 1, 1)] * 3
    assert not Run.objects.exists()


# -- the worker's other options and features ---------------------------------------------------


def test_max_jobs_with_threads_runs_exactly_that_many():
    enqueue_many(jobs.wait_and_record.bind(f"m-{i}", 0.1) for i in range(10))
    _, reason = run_worker(threads=4, max_jobs=6, stop_when_empty=False)
    assert reason is StopReason.MAX_JOBS
    left = list(Job.objects.values_list("reserved_at", "attempts", "given_back"))
    assert Run.objects.count() == 6, (left, list(FailedJob.objects.values_list("name", "error")))
    # The other four were never claimed.
    assert left == [(None, 0, 0)] * 4


def test_stop_when_empty_waits_for_eight_threads_and_200_async_jobs_in_flight_at_once(worker_process):
    # Each job waits until every job of its group runs at once in the one process.
    enqueue_many(jobs.all_at_once.bind("threads", f"t-{i}", 8) for i in range(8))
    enqueue_many(jobs.async_all_at_once.bind("loop", f"a-{i}", 200) for i in range(200))
    process = worker_process("--threads", "8", "--async-concurrency", "200", "--stop-when-empty", "--sleep", "0.05")
    assert process.wait(timeout=60) == 0, process.output()
    assert not FailedJob.objects.exists(), FailedJob.objects.first().error
    assert not Job.objects.exists()
    assert Run.objects.count() == 208
    assert set(Run.objects.values_list("pid", flat=True)) == {process.pid}
    assert set(Run.objects.filter(key__startswith="a-").values_list("note", flat=True)) == {"dbqueue-loop"}
    threads = set(Run.objects.filter(key__startswith="t-").values_list("note", flat=True))
    assert len(threads) == 8 and all(name.startswith("dbqueue-job-") for name in threads)


def test_chains_progress_and_signals_work_from_threads():
    succeeded: list[tuple[int, str]] = []

    def receiver(sender, job, **kwargs):
        succeeded.append((job.pk, threading.current_thread().name))

    pipelines = [chain(*(jobs.step.bind(name, n) for n in (1, 2, 3))) for name in ("ca", "cb")]
    for pipeline in pipelines:
        pipeline.enqueue()
    handles = enqueue_many(jobs.progress_and_record.bind(f"p-{i}") for i in range(4))
    signals.job_succeeded.connect(receiver)
    try:
        run_worker(threads=4)
    finally:
        signals.job_succeeded.disconnect(receiver)
    assert set(Run.objects.filter(key__startswith="c").values_list("key", flat=True)) == {
        f"{name}-{n}" for name in ("ca", "cb") for n in (1, 2, 3)
    }
    for pipeline in pipelines:
        progress = get_progress(pipeline.progress_key)
        assert progress is not None and (progress["percent"], progress["finished"]) == (100, True)
    # Each job read its own progress back while it ran.
    assert set(Run.objects.filter(key__startswith="p-").values_list("note", flat=True)) == {"40 working"}
    for handle in handles:
        assert get_progress(str(handle.id))["finished"]
    assert len(succeeded) == 10 and len({pk for pk, _ in succeeded}) == 10
    assert not Job.objects.exists() and not FailedJob.objects.exists()


def test_the_connection_check_warns_at_half_the_servers_max_connections():
    per_process = connections_per_process(8, 0)
    assert connections_per_process(8, 100) == per_process + 1, "the async ORM thread has a connection"
    if connection.vendor == "sqlite":
        assert check_worker_connections(1000, 8, 100) == [], "SQLite has no max_connections"
        return
    with connection.cursor() as cursor:
        cursor.execute("SHOW max_connections" if connection.vendor == "postgresql" else "SELECT @@max_connections")
        limit = int(cursor.fetchone()[0])
    processes = math.ceil(limit / 2 / per_process)
    assert processes >= 2, limit
    [warning] = check_worker_connections(processes, 8, 0)
    assert warning.id == "dbqueue.W007"
    assert f"{processes * per_process} database connections" in warning.msg and str(limit) in warning.msg
    assert check_worker_connections(processes - 1, 8, 0) == []
