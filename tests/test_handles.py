"""Job handles (issue 13): status, results, retries and cancel, on every database.

A handle is read from where the job is (its row, FailedJob, the result store), so
the tests read it in this process while real worker processes move the job.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import subprocess
import sys

import pytest
from asgiref.sync import async_to_sync
from django.contrib.auth.models import User
from django.core.management import CommandError, call_command
from django.db import connection
from django.test import AsyncClient, override_settings

from django_dbqueue import PayloadError, chain, enqueue_many, get_progress, job
from django_dbqueue.handles import JobHandle, JobStatus, get_job, prune_results
from django_dbqueue.models import FailedJob, Job, TaskResultRecord
from django_dbqueue.operations import retry_failed
from tests.conftest import ROOT, children_of, run_worker, wait_until
from tests.testapp import jobs
from tests.testapp.models import Attempt, Order, Run

pytestmark = pytest.mark.django_db(transaction=True)


def status_elsewhere(job_id: int) -> str:
    """The status as another process (a ``manage.py shell``) reads it."""
    script = f"from django_dbqueue.handles import get_job; print(get_job({job_id}).status)"
    done = subprocess.run(
        [sys.executable, "-m", "django", "shell", "-c", script],
        cwd=ROOT,
        env={**os.environ, "DJANGO_SETTINGS_MODULE": "tests.settings", "DBQUEUE_TEST_USE_TEST_DB": "1"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.strip().splitlines()[-1]


def test_enqueue_returns_a_handle_with_the_row_and_its_status():
    handle = jobs.add.enqueue(1, 2)
    assert isinstance(handle, JobHandle) and handle.pk == handle.id == handle.job.pk
    assert (handle.name, handle.queue, handle.status) == ("tests.add", "default", JobStatus.WAITING)
    delayed = jobs.add.using(delay=60).enqueue(1, 2)
    assert delayed.status == JobStatus.DELAYED
    handles = enqueue_many([jobs.add.bind(i, i) for i in range(3)])
    assert [h.status for h in handles] == [JobStatus.WAITING] * 3
    assert chain(jobs.step.bind("c", 1), jobs.step.bind("c", 2)).enqueue().status == JobStatus.WAITING


@pytest.mark.acceptance
def test_a_jobs_status_through_every_state_read_from_other_processes(worker_process):
    # Long enough a delay for another process to start and read it on a loaded machine (1 s was not).
    handle = jobs.record_when_allowed.using(delay=6).enqueue("states")
    assert status_elsewhere(handle.id) == "delayed"
    wait_until(lambda: get_job(handle.id).status == JobStatus.WAITING, 15, "the delay never ended")
    assert status_elsewhere(handle.id) == "waiting"
    worker = worker_process("--sleep", "0.05")
    wait_until(lambda: get_job(handle.id).status == JobStatus.RUNNING, 20, worker.output())
    assert status_elsewhere(handle.id) == "running"  # the job runs until the Run below allows it to end
    Run.objects.create(key="states-allow")
    wait_until(lambda: Run.objects.filter(key="states").exists(), 20, worker.output())
    wait_until(lambda: get_job(handle.id).status == JobStatus.SUCCEEDED, 10, worker.output())
    assert status_elsewhere(handle.id) == "succeeded"
    handle.refresh()
    assert handle.finished and handle.status == JobStatus.SUCCEEDED

    failing = jobs.always_fail.enqueue("states-failed")
    wait_until(lambda: get_job(failing.id).status == JobStatus.FAILED, 20, worker.output())
    assert status_elsewhere(failing.id) == "failed"


def test_results_off_write_no_record_and_a_gone_row_reads_as_succeeded():
    handle = jobs.add.enqueue(2, 3)
    run_worker()
    assert not TaskResultRecord.objects.exists()
    handle.refresh()
    assert handle.status == JobStatus.SUCCEEDED and handle.result is None


def test_a_kept_result_is_read_after_the_row_is_gone_with_its_types():
    handle = jobs.keep_result.enqueue(7)
    run_worker()
    assert not Job.objects.exists()
    fetched = get_job(handle.id)
    assert fetched.status == JobStatus.SUCCEEDED
    assert fetched.result == {"x": 7, "when": dt.datetime(2030, 1, 2, 3, 4, 5, tzinfo=dt.UTC)}
    assert fetched.finished_at is not None and fetched.errors == []


def test_kept_results_keep_the_error_of_each_failed_attempt():
    handle = jobs.keep_after_one_failure.enqueue("twice")
    run_worker()
    fetched = get_job(handle.id)
    assert (fetched.status, fetched.result) == (JobStatus.SUCCEEDED, "twice done")
    assert [(e["attempt"], e["exception_class"]) for e in fetched.errors] == [(1, "builtins.ValueError")]
    assert "twice: first attempt fails" in fetched.errors[0]["traceback"]


def test_results_for_every_job_from_the_setting():
    with override_settings(DBQUEUE={"RESULTS": True}):
        handle = jobs.add.enqueue(20, 22)
        run_worker()
        assert get_job(handle.id).result == 42


def test_a_return_value_that_is_not_json_is_recorded_as_succeeded_with_a_note():
    handle = jobs.keep_a_set.enqueue()
    run_worker()
    fetched = get_job(handle.id)
    assert (fetched.status, fetched.result) == (JobStatus.SUCCEEDED, None)
    assert "the return value was not kept" in fetched.errors[-1]["traceback"]
    assert "set" in fetched.errors[-1]["traceback"]


def test_kept_results_are_pruned_by_age():
    jobs.keep_result.enqueue(1)
    run_worker()
    assert prune_results(1) == 0
    TaskResultRecord.objects.update(finished_at=dt.datetime(2020, 1, 1, tzinfo=dt.UTC))
    assert prune_results(1) == 1
    assert not TaskResultRecord.objects.exists()


def test_a_handle_follows_its_job_through_a_retry_from_failed_job():
    handle = jobs.always_fail.enqueue("retried")
    run_worker()
    handle.refresh()
    assert handle.status == JobStatus.FAILED
    assert retry_failed(FailedJob.objects.all()) == 1
    handle.refresh()
    if connection.vendor == "mysql" and not connection.mysql_is_mariadb:
        pytest.skip("plain MySQL returns no ids from a bulk insert")
    assert handle.status == JobStatus.WAITING and handle.job_id != handle.id
    run_worker()
    handle.refresh()
    assert handle.status == JobStatus.FAILED


# -- cancel ---------------------------------------------------------------------------


def test_cancelling_a_waiting_and_a_delayed_job_moves_them_to_failed_job_as_cancelled():
    waiting = jobs.record.enqueue("w")
    delayed = jobs.record.using(delay=60).enqueue("d")
    assert waiting.cancel() and delayed.cancel(reason="not needed")
    assert (waiting.status, delayed.status) == (JobStatus.CANCELLED, JobStatus.CANCELLED)
    assert not Job.objects.exists()
    failed = FailedJob.objects.get(job_id=delayed.id)
    assert failed.exception_class == "django_dbqueue.exceptions.JobCancelled"
    assert "not needed" in failed.error
    run_worker()
    assert not Run.objects.exists()
    assert not waiting.cancel(), "a finished job cannot be cancelled again"


def test_a_chain_cancelled_mid_way_keeps_its_remaining_steps_and_runs_no_failure_callback():
    handle = (
        chain(jobs.step.bind("m", 1), jobs.step.bind("m", 2), jobs.step.bind("m", 3))
        .on_failure(jobs.record.bind("on-failure"))
        .enqueue()
    )
    run_worker(once=True)
    second = Job.objects.get()
    assert get_job(second.pk).cancel()
    run_worker()
    assert set(Run.objects.values_list("key", flat=True)) == {"m-1"}
    failed = FailedJob.objects.get()
    assert [step["args"] for step in json.loads(failed.payload)["next"]] == [["m", 3]]
    assert get_job(handle.id).status == JobStatus.SUCCEEDED
    assert get_job(second.pk).status == JobStatus.CANCELLED


@pytest.mark.acceptance
def test_a_running_job_stops_at_its_next_progress_report_after_a_cancel(worker_process):
    handle = jobs.report_until_cancelled.enqueue("coop")
    worker = worker_process("--sleep", "0.05")
    wait_until(lambda: Attempt.objects.filter(key="coop").exists(), 20, worker.output())
    assert handle.cancel()
    assert handle.status == JobStatus.RUNNING, "a running job stays running until it has stopped"
    wait_until(lambda: get_job(handle.id).status == JobStatus.CANCELLED, 15, worker.output())
    assert not Run.objects.filter(key="coop").exists()
    assert Attempt.objects.filter(key="coop").count() == 1, "a cancelled job is not retried"
    # The final progress is written just after the outcome is stored.
    wait_until(lambda: (get_progress(str(handle.id)) or {}).get("failed"), 10, worker.output())
    assert worker.process.poll() is None
    # The worker goes on serving.
    jobs.record.enqueue("after-cancel")
    wait_until(lambda: Run.objects.filter(key="after-cancel").exists(), 15, worker.output())


@pytest.mark.acceptance
def test_a_hard_cancel_stops_a_job_that_never_checks_by_ending_its_process(worker_process):
    handle = jobs.ignore_cancel.enqueue("hard", 30)
    worker = worker_process("--concurrency", "1", "--sleep", "0.05", env={"DBQUEUE_TEST_TIMEOUT_GRACE": "0.5"})
    wait_until(lambda: Attempt.objects.filter(key="hard").exists(), 20, worker.output())
    [first] = children_of(worker.pid)
    call_command("queue_cancel", str(handle.id), "--hard")
    wait_until(lambda: get_job(handle.id).status == JobStatus.CANCELLED, 15, worker.output())
    assert not Run.objects.filter(key="hard").exists()
    assert "JobCancelled" in FailedJob.objects.get().error
    # Recorded by the process that ran it, which then ended; its supervisor started another.
    jobs.record.enqueue("after-hard")
    wait_until(lambda: Run.objects.filter(key="after-hard").exists(), 15, worker.output())
    assert Run.objects.get(key="after-hard").pid != first
    assert "did not stop within 0.5s of a hard cancel" in worker.output()
    assert worker.process.poll() is None


def test_queue_cancel_of_an_unknown_id_says_so_and_fails():
    with pytest.raises(CommandError, match="No waiting or running job has the id 999999"):
        call_command("queue_cancel", "999999")
    done = subprocess.run(
        [sys.executable, "-m", "django", "queue_cancel", "999999"],
        cwd=ROOT,
        env={**os.environ, "DJANGO_SETTINGS_MODULE": "tests.settings", "DBQUEUE_TEST_USE_TEST_DB": "1"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 1 and "No waiting or running job" in done.stderr


def test_queue_cancel_cancels_waiting_jobs(capsys):
    handles = enqueue_many([jobs.record.bind(f"q{i}") for i in range(3)])
    call_command("queue_cancel", ",".join(str(h.id) for h in handles))
    assert "Cancelled 3 job(s)" in capsys.readouterr().out
    assert FailedJob.objects.count() == 3 and not Job.objects.exists()


# -- async --------------------------------------------------------------------------------


def test_aenqueue_from_an_async_view():
    response = async_to_sync(AsyncClient().get)("/enqueue-async/", {"x": "5"})
    assert response.status_code == 200
    body = response.json()
    assert body["status"] == "waiting" and Job.objects.filter(pk=body["id"]).exists()
    run_worker()
    assert get_job(body["id"]).result == {"x": 5, "when": dt.datetime(2030, 1, 2, 3, 4, 5, tzinfo=dt.UTC)}


# -- max_exceptions -----------------------------------------------------------------------


def test_max_exceptions_fails_a_job_after_that_many_exceptions_whatever_its_tries_and_snoozes():
    jobs.snooze_then_raise.enqueue("budget")
    run_worker()
    failed = FailedJob.objects.get()
    # Attempts 1 and 3 snoozed, 2 and 4 raised: the second exception ends it, with 10 tries.
    assert failed.attempts == 4 and Attempt.objects.filter(key="budget").count() == 4
    assert "raised 2 exception(s), its max_exceptions" in failed.error
    assert failed.exception_class == "builtins.RuntimeError"


@pytest.mark.parametrize("value", [0, -1, True, 1.5, "2"])
def test_max_exceptions_must_be_a_positive_integer(value):
    from django.core.exceptions import ImproperlyConfigured

    with pytest.raises(ImproperlyConfigured, match="max_exceptions must be an integer"):
        jobs.record.using(max_exceptions=value)


# -- a kept model instance: fetched only for the model the job's return annotation names --------


@job(results=True)
def keep_order(number: str) -> Order:
    return Order.objects.create(number=number)


def test_a_kept_model_instance_is_fetched_again_for_the_model_the_return_annotation_names():
    handle = keep_order.enqueue("R-1")
    run_worker()
    order = get_job(handle.id).result
    assert isinstance(order, Order) and order.number == "R-1"


def test_a_kept_result_whose_row_names_another_model_raises_and_fetches_nothing(django_assert_num_queries):
    user = User.objects.create(username="admin", is_superuser=True)
    handle = keep_order.enqueue("R-2")
    run_worker()
    forged = {"__dbq__": "model", "v": ["auth.user", user.pk]}
    TaskResultRecord.objects.filter(job_id=handle.id).update(return_value=forged)
    fetched = get_job(handle.id)
    with django_assert_num_queries(0), pytest.raises(PayloadError) as info:
        fetched.result  # noqa: B018 - the property reads the result
    assert "refers to the model auth.user, which keep_order() does not declare (it declares testapp.order)" in str(
        info.value
    )
