"""The django.tasks backend, held to what Django's own backend tests check."""

from __future__ import annotations

import datetime as dt
import signal
import sys

import pytest

# django.tasks arrived in Django 6.0; on 5.2 tests/test_checks.py covers the check that says so.
pytest.importorskip("django.tasks", reason="django.tasks needs Django 6")

from asgiref.sync import async_to_sync
from django.core.management import call_command
from django.db import transaction
from django.tasks import TaskResultStatus, default_task_backend, task
from django.tasks.exceptions import InvalidTask, TaskResultDoesNotExist
from django.tasks.signals import task_enqueued, task_finished, task_started
from django.test import override_settings

from django_dbqueue import PayloadTooLarge, claims, lifecycle
from django_dbqueue.models import FailedJob, Job, TaskResultRecord
from django_dbqueue.tasks import RUN_TASK, DatabaseBackend
from tests.conftest import run_worker, wait_until
from tests.testapp import tasks
from tests.testapp.models import Run

pytestmark = pytest.mark.django_db(transaction=True)


def test_the_backend_supports_every_feature():
    from django.tasks import task_backends

    backend = task_backends["default"]
    assert isinstance(backend, DatabaseBackend)
    assert (
        backend.supports_defer,
        backend.supports_async_task,
        backend.supports_get_result,
        backend.supports_priority,
    ) == (True, True, True, True)


def test_enqueue_returns_a_ready_result_and_stores_a_job():
    result = tasks.add_numbers.enqueue(1, 2)
    assert result.status == TaskResultStatus.READY and result.enqueued_at is not None
    assert (result.args, result.kwargs, result.backend, result.errors, result.worker_ids) == (
        [1, 2],
        {},
        "default",
        [],
        [],
    )
    job = Job.objects.get()
    assert job.name == RUN_TASK and job.queue == "default"
    fetched = default_task_backend.get_result(result.id)
    assert fetched.id == result.id and fetched.status == TaskResultStatus.READY
    assert fetched.task.func is tasks.add_numbers.func


@pytest.mark.parametrize(
    ("make", "error", "message"),
    [
        (
            lambda: tasks.add_numbers.using(queue_name="nope").enqueue(1, 2),
            InvalidTask,
            "Queue 'nope' is not valid for backend.",
        ),
        (lambda: tasks.add_numbers.using(priority=101).enqueue(1, 2), InvalidTask, "priority must be"),
        (
            lambda: tasks.add_numbers.using(run_after=dt.datetime(2030, 1, 1)).enqueue(1, 2),
            InvalidTask,
            "run_after must be an aware datetime.",
        ),
        (
            lambda: tasks.add_numbers.enqueue(object(), 2),
            TypeError,
            "Cannot enqueue tests.testapp.tasks.add_numbers: its arguments must be JSON",
        ),
        (
            lambda: tasks.add_numbers.enqueue("x" * 2_000_000, 2),
            PayloadTooLarge,
            "Cannot enqueue tests.testapp.tasks.add_numbers: its payload is 2,000,",
        ),
    ],
)
def test_invalid_enqueues_are_refused_and_store_nothing(make, error, message):
    with pytest.raises(error, match=message.replace("(", r"\(").replace(")", r"\)")):
        make()
    assert not Job.objects.exists() and not TaskResultRecord.objects.exists()


def test_a_task_must_be_a_module_level_function_taking_context_first():
    with pytest.raises(InvalidTask, match="first argument of 'context'"):
        task(takes_context=True)(tasks.not_named_context)
    with pytest.raises(InvalidTask, match="module level"):
        task(lambda: None)


def test_a_successful_task_has_every_field_and_its_json_return_value():
    result = tasks.remember_attempt.enqueue("ok")
    run_worker()
    result.refresh()
    assert result.status == TaskResultStatus.SUCCESSFUL and result.is_finished
    assert result.return_value == {"attempt": 1, "result_id": result.id}
    assert result.started_at <= result.last_attempted_at <= result.finished_at
    assert len(result.worker_ids) == 1 and result.attempts == 1 and result.errors == []
    assert not Job.objects.exists()


def test_a_failing_task_records_each_error_and_ends_in_failed_job():
    result = tasks.always_fails.enqueue("broken")
    run_worker()
    result.refresh()
    assert result.status == TaskResultStatus.FAILED and result.attempts == 2  # OPTIONS["TRIES"] = 2
    assert [e.exception_class_path for e in result.errors] == ["builtins.ValueError"] * 2
    assert result.errors[0].exception_class is ValueError
    assert "ValueError: broken" in result.errors[-1].traceback
    with pytest.raises(ValueError, match="Task failed"):
        _ = result.return_value
    assert FailedJob.objects.get().name == RUN_TASK


def test_a_return_value_that_is_not_json_fails_the_task():
    result = tasks.returns_object.enqueue()
    run_worker()
    result.refresh()
    assert result.status == TaskResultStatus.FAILED
    assert result.errors[-1].exception_class_path == "builtins.TypeError"


def test_a_task_retried_from_failed_job_follows_the_new_run():
    result = tasks.fails_until_allowed.enqueue("gate")
    run_worker()
    result.refresh()
    assert result.status == TaskResultStatus.FAILED
    Run.objects.create(key="gate-allow")
    call_command("queue_retry", "all", "--force")
    result.refresh()
    assert result.status == TaskResultStatus.READY and result.finished_at is None
    run_worker()
    result.refresh()
    assert result.status == TaskResultStatus.SUCCESSFUL and result.return_value == "done"
    assert result.attempts == 3 and len(result.errors) == 2


def test_higher_priority_runs_first_within_the_queue_order():
    tasks.record_key.using(priority=-10).enqueue("low-priority")
    tasks.record_key.using(priority=50).enqueue("urgent")
    tasks.record_key.using(queue_name="high").enqueue("high-queue")
    tasks.record_key.enqueue("normal")
    run_worker(queues=["high", "low"])
    assert list(Run.objects.order_by("id").values_list("key", flat=True)) == [
        "high-queue",
        "urgent",
        "normal",
        "low-priority",
    ]


def test_run_after_defers_the_task():
    later = dt.datetime.now(dt.UTC) + dt.timedelta(hours=1)
    result = tasks.add_numbers.using(run_after=later).enqueue(1, 1)
    run_worker()
    result.refresh()
    assert result.status == TaskResultStatus.READY
    assert Job.objects.delayed().count() == 1


def test_an_async_task_runs_and_aenqueue_and_aget_result_work():
    result = async_to_sync(tasks.double.aenqueue)(21)
    run_worker()
    fetched = async_to_sync(default_task_backend.aget_result)(result.id)
    assert fetched.status == TaskResultStatus.SUCCESSFUL and fetched.return_value == 42


def test_signals_are_sent_and_a_failing_receiver_does_not_change_the_outcome():
    seen = []

    def on_signal(signal, sender, task_result, **kwargs):
        seen.append((signal, task_result.status))

    def broken(**kwargs):
        raise RuntimeError("receiver bug")

    for sig in (task_enqueued, task_started, task_finished):
        sig.connect(on_signal, weak=False)
        sig.connect(broken, weak=False)
    try:
        result = tasks.add_numbers.enqueue(2, 3)
        run_worker()
    finally:
        for sig in (task_enqueued, task_started, task_finished):
            sig.disconnect(on_signal)
            sig.disconnect(broken)
    assert seen == [
        (task_enqueued, TaskResultStatus.READY),
        (task_started, TaskResultStatus.RUNNING),
        (task_finished, TaskResultStatus.SUCCESSFUL),
    ]
    result.refresh()
    assert result.status == TaskResultStatus.SUCCESSFUL and result.return_value == 5


def test_an_unknown_result_id_raises_does_not_exist():
    with pytest.raises(TaskResultDoesNotExist):
        default_task_backend.get_result("no-such-id")


def test_enqueue_joins_the_callers_transaction():
    with pytest.raises(RuntimeError), transaction.atomic():
        result = tasks.add_numbers.enqueue(1, 2)
        raise RuntimeError("roll back")
    with pytest.raises(TaskResultDoesNotExist):
        default_task_backend.get_result(result.id)
    assert not Job.objects.exists()


def test_task_options_reach_the_job():
    tasks.once_only.enqueue()
    job = Job.objects.get()
    assert (job.max_tries, job.timeout, job.retry_after) == (1, 5, 20)


def test_a_task_whose_worker_died_reads_as_failed():
    result = tasks.once_only.enqueue()
    claims.reserve(["default"], worker_id="dead-worker")
    lifecycle.reclaim_worker("dead-worker", error_for=lambda seconds: "the worker process died")
    fetched = default_task_backend.get_result(result.id)
    assert fetched.status == TaskResultStatus.FAILED
    assert fetched.errors[-1].exception_class_path == "django_dbqueue.exceptions.WorkerLost"


def test_the_backend_check_reports_a_database_that_cannot_claim():
    from django.db import connections

    connections.settings["other"] = {**connections.settings["default"], "ENGINE": "django.db.backends.dummy"}
    try:
        with override_settings(DBQUEUE={"DATABASE": "other"}):
            ids = [m.id for m in DatabaseBackend("x", {}).check()]
    finally:
        del connections.settings["other"]
        if hasattr(connections._connections, "other"):
            del connections["other"]
    assert ids == ["dbqueue.E010"]


def test_the_backend_check_reports_unknown_options():
    backend = DatabaseBackend("x", {"OPTIONS": {"TRYS": 3}})
    assert [m.id for m in backend.check()] == ["dbqueue.E008"]


def test_queue_prune_results_deletes_old_finished_results(capsys):
    from django.db.models import F

    result = tasks.add_numbers.enqueue(1, 2)
    run_worker()
    TaskResultRecord.objects.filter(pk=result.id).update(finished_at=F("finished_at") - dt.timedelta(hours=3))
    tasks.add_numbers.enqueue(3, 4)
    call_command("queue_prune_results", "--hours", "2")
    assert TaskResultRecord.objects.count() == 1
    assert "Deleted 1 result" in capsys.readouterr().out


@pytest.mark.acceptance
def test_get_result_from_another_process_sees_running_then_successful(worker_process):
    result = tasks.slow_task.enqueue("slow", 1.5)
    process = worker_process("--sleep", "0.05")
    wait_until(
        lambda: default_task_backend.get_result(result.id).status == TaskResultStatus.RUNNING, 30, "the task never ran"
    )
    wait_until(
        lambda: default_task_backend.get_result(result.id).status == TaskResultStatus.SUCCESSFUL,
        30,
        "the task never finished",
    )
    assert default_task_backend.get_result(result.id).return_value == "slow"
    process.signal(signal.SIGTERM)
    assert process.wait(timeout=30) == 0


def test_an_idle_worker_prunes_old_results_when_configured(settings):
    from django.db.models import F

    old = tasks.add_numbers.enqueue(1, 2)
    run_worker()
    TaskResultRecord.objects.filter(pk=old.id).update(finished_at=F("finished_at") - dt.timedelta(hours=3))
    fresh = tasks.add_numbers.enqueue(3, 4)
    run_worker()
    settings.DBQUEUE = {**settings.DBQUEUE, "RESULT_MAX_AGE": 2}
    run_worker(max_time=0.3, stop_when_empty=False, sleep=0.05)
    assert list(TaskResultRecord.objects.values_list("pk", flat=True)) == [fresh.id]


@task
def leak_secrets(filler: int) -> None:
    """Fails with secrets at both ends of a message ``filler`` characters long."""
    raise ValueError(
        f"login failed password=hunter2 {'x' * filler} api_key=sk_live_51HxQ9zG card 4111 1111 1111 1111 END"
    )


def test_each_attempts_traceback_is_scrubbed_and_capped_to_its_head_and_tail():
    result = leak_secrets.enqueue(1_000_000)
    run_worker()
    result.refresh()
    assert result.status == TaskResultStatus.FAILED and len(result.errors) == 2
    for error in result.errors:
        text = error.traceback
        assert "hunter2" not in text and "sk_live_51HxQ9zG" not in text and "4111 1111 1111 1111" not in text
        assert len(text) <= 20000 and "characters cut ..." in text
        assert text.startswith("Traceback (most recent call last):\n")
        assert "ValueError: login failed password=[scrubbed] x" in text
        assert text.endswith("api_key=[scrubbed] card [scrubbed] END\n")
        assert error.exception_class_path == "builtins.ValueError"
    assert "hunter2" not in FailedJob.objects.get().error


def test_each_attempts_traceback_is_stored_as_is_without_a_scrubber(settings):
    settings.DBQUEUE = {**settings.DBQUEUE, "ERROR_SCRUBBER": None}
    result = leak_secrets.enqueue(10)
    run_worker()
    result.refresh()
    assert all("password=hunter2" in error.traceback for error in result.errors)


def test_a_task_cancelled_before_it_runs_ends_failed_with_the_cancellation_as_its_error():
    from django_dbqueue.operations import cancel_jobs

    result = tasks.add_numbers.enqueue(1, 2)
    job = Job.objects.get()
    assert cancel_jobs([job.pk]) == {job.pk: "cancelled"}
    fetched = default_task_backend.get_result(result.id)
    assert fetched.status == TaskResultStatus.FAILED
    assert fetched.errors[-1].exception_class_path == "django_dbqueue.exceptions.JobCancelled"
    run_worker()
    assert default_task_backend.get_result(result.id).status == TaskResultStatus.FAILED


@pytest.mark.parametrize("path", ["tests.unregistered_tasks.never_imported", "os.system"])
def test_get_result_reads_only_registered_tasks_and_imports_no_module_a_row_names(path):
    result = tasks.add_numbers.enqueue(1, 2)
    # A row changed by hand, or by anyone who can write to the table.
    TaskResultRecord.objects.filter(pk=result.id).update(task_path=path)
    module = path.rpartition(".")[0]
    imported = module in sys.modules
    with pytest.raises(TaskResultDoesNotExist) as info:
        default_task_backend.get_result(result.id)
    assert str(info.value) == (
        f"the result {result.id} names the task {path!r}, which is not registered in this process; only "
        "registered tasks are read, never imported from the path a row names. Define the task with @task in a "
        "module imported at startup (an installed app's tasks.py)."
    )
    assert (module in sys.modules) == imported
