"""The worker loop in this process: outcomes, bad input, timeouts, signals."""

import datetime as dt
import logging
import time

import pytest
from django.db.models.functions import Now

from django_dbqueue import claims, signals
from django_dbqueue.models import FailedJob, Job
from django_dbqueue.worker import StopReason
from tests.conftest import run_worker
from tests.testapp import jobs
from tests.testapp.models import Attempt, Order, Run

pytestmark = pytest.mark.django_db


def raw_job(name: str, payload: str, **fields) -> Job:
    """Insert a row directly, as a bad deploy or a hand edit could leave it."""
    return Job.objects.create(
        name=name, payload=payload, retry_after=60, available_at=Now(), created_at=Now(), **fields
    )


def test_a_job_that_succeeds_is_deleted_and_logged(caplog):
    row = jobs.record.enqueue("ok", note="hello")
    with caplog.at_level(logging.INFO, logger="django_dbqueue"):
        worker, reason = run_worker()
    assert reason is StopReason.EMPTY and worker.processed == 1
    assert Run.objects.get().note == "hello"
    assert not Job.objects.exists()
    line = next(r.getMessage() for r in caplog.records if "outcome=" in r.getMessage())
    assert line.startswith(f"job=tests.testapp.jobs.record id={row.pk} queue=default attempt=1 outcome=succeeded")
    assert "duration=" in line and "hello" not in line  # arguments never reach the logs


def test_typed_arguments_and_keyword_arguments_reach_the_function():
    when = dt.datetime(2026, 5, 1, 12, 30, tzinfo=dt.UTC)
    jobs.echo.enqueue(when, {"d": dt.date(2026, 1, 1)}, flag=True)
    run_worker()
    assert Run.objects.get().note == repr(((when, {"d": dt.date(2026, 1, 1)}), {"flag": True}))


def test_a_model_instance_is_fetched_again_when_the_job_runs():
    order = Order.objects.create(number="A-1")
    jobs.touch_order.enqueue(order)
    Order.objects.filter(pk=order.pk).update(number="A-2")
    run_worker()
    assert Run.objects.get().note == "A-2"


def test_a_job_that_fails_once_is_released_and_succeeds_on_its_second_attempt():
    jobs.fail_once.enqueue("flaky")
    run_worker()
    assert list(Attempt.objects.values_list("attempt", flat=True).order_by("attempt")) == [1, 2]
    assert Run.objects.filter(key="flaky").exists()
    assert not Job.objects.exists() and not FailedJob.objects.exists()


def test_a_job_that_always_fails_moves_to_failed_job_with_its_traceback():
    row = jobs.always_fail.enqueue("doomed")
    run_worker()
    assert Attempt.objects.count() == 2  # tries=2
    failed = FailedJob.objects.get()
    assert (failed.job_id, failed.name, failed.attempts) == (row.pk, "tests.testapp.jobs.always_fail", 2)
    assert failed.exception_class == "builtins.ValueError"
    assert failed.error.startswith("Traceback (most recent call last):")
    assert 'in always_fail\n    raise ValueError(f"{key} always fails")' in failed.error
    assert failed.error_summary == "ValueError: doomed always fails"
    assert not Job.objects.exists()


def test_a_failed_attempt_waits_for_its_backoff():
    jobs.fail_with_backoff.enqueue()
    run_worker()
    job = Job.objects.annotate(now=Now()).get()
    assert job.attempts == 1 and job.reserved_at is None
    assert dt.timedelta(seconds=4) < job.available_at - job.now <= dt.timedelta(seconds=5)


def test_the_workers_backoff_applies_to_jobs_that_set_none():
    from django_dbqueue.execution import Defaults

    jobs.always_fail.enqueue("x")
    run_worker(defaults=Defaults(tries=3, timeout=30, backoff=[100, 200]))
    job = Job.objects.annotate(now=Now()).get()
    assert dt.timedelta(seconds=99) < job.available_at - job.now <= dt.timedelta(seconds=100)


@pytest.mark.parametrize(
    ("name", "stored", "exception_class", "message"),
    [
        (
            "os.system",
            '{"args": ["echo pwned"], "kwargs": {}}',
            "django_dbqueue.exceptions.JobNotRegistered",
            "cannot run: No job is registered under the name 'os.system'",
        ),
        (
            "tests.add",
            "{not json",
            "django_dbqueue.exceptions.PayloadError",
            "cannot run: the payload is not valid JSON",
        ),
        (
            "tests.add",
            '{"arguments": [1, 2]}',
            "django_dbqueue.exceptions.PayloadError",
            "cannot run: the payload is not a job envelope",
        ),
        (
            "tests.add",
            '{"args": [1, 2, 3], "kwargs": {}}',
            "django_dbqueue.exceptions.PayloadError",
            "the stored arguments no longer match tests.add(): too many positional arguments",
        ),
        (
            "tests.add",
            '{"args": [1], "kwargs": {"c": 2}}',
            "django_dbqueue.exceptions.PayloadError",
            "no longer match tests.add(): ",
        ),
    ],
)
def test_a_job_that_cannot_run_fails_at_once_with_an_error_that_says_why(name, stored, exception_class, message):
    row = raw_job(name, stored)
    jobs.record.enqueue("after")
    run_worker()
    failed = FailedJob.objects.get()
    assert (failed.job_id, failed.attempts, failed.exception_class) == (row.pk, 1, exception_class)
    assert message in failed.error
    assert Run.objects.filter(key="after").exists()  # the worker carried on


def test_a_job_whose_model_row_is_gone_fails_with_an_error_naming_the_row():
    order = Order.objects.create(number="B-1")
    jobs.touch_order.enqueue(order)
    order_pk = order.pk
    order.delete()
    run_worker()
    failed = FailedJob.objects.get()
    assert failed.exception_class == "django_dbqueue.exceptions.ModelReferenceMissing"
    assert f"testapp.Order with pk={order_pk} no longer exists" in failed.error
    assert failed.attempts == 1


def test_system_exit_and_keyboard_interrupt_in_a_job_do_not_end_the_worker():
    jobs.raise_system_exit.enqueue()
    jobs.raise_keyboard_interrupt.enqueue()
    jobs.record.enqueue("still-serving")
    _worker, reason = run_worker()
    assert reason is StopReason.EMPTY
    assert Run.objects.filter(key="still-serving").exists()
    failures = dict(FailedJob.objects.values_list("name", "exception_class"))
    assert failures == {
        "tests.testapp.jobs.raise_system_exit": "builtins.SystemExit",
        "tests.testapp.jobs.raise_keyboard_interrupt": "builtins.KeyboardInterrupt",
    }
    assert FailedJob.objects.get(name__endswith="system_exit").attempts == 3


def test_a_job_over_its_timeout_is_asked_to_stop_and_counts_as_failed():
    # It looks (context.check_cancelled): it stops there and the worker goes on. One that
    # never looks ends its process (tests/test_hard_cancel.py).
    jobs.busy_past_timeout.enqueue("busy")
    jobs.record.enqueue("next")
    started = time.monotonic()
    run_worker()
    assert time.monotonic() - started < 5
    failed = FailedJob.objects.get()
    assert failed.exception_class == "django_dbqueue.exceptions.JobTimeout"
    assert "the job ran longer than its timeout of 1 s and was stopped" in failed.error
    assert not Run.objects.filter(key="busy").exists()
    assert Run.objects.filter(key="next").exists()


def test_an_async_job_runs_to_completion():
    jobs.async_record.enqueue("async")
    run_worker()
    assert Run.objects.filter(key="async").exists() and not Job.objects.exists()


def test_signals_report_each_outcome_and_a_failing_receiver_changes_nothing(caplog):
    events = []

    def on_event(signal, sender, job, **kwargs):
        events.append((signal, job.name))

    def broken(**kwargs):
        raise RuntimeError("receiver bug")

    connected = [
        signals.job_enqueued,
        signals.job_started,
        signals.job_succeeded,
        signals.job_released,
        signals.job_failed,
    ]
    for signal in connected:
        signal.connect(on_event, weak=False)
        signal.connect(broken, weak=False)
    try:
        jobs.record.enqueue("signalled")
        jobs.always_fail.enqueue("f")
        with caplog.at_level(logging.ERROR, logger="django_dbqueue"):
            run_worker()
    finally:
        for signal in connected:
            signal.disconnect(on_event)
            signal.disconnect(broken)
    names = [(s, n.rsplit(".", 1)[1]) for s, n in events]
    assert names == [
        (signals.job_enqueued, "record"),
        (signals.job_enqueued, "always_fail"),
        (signals.job_started, "record"),
        (signals.job_succeeded, "record"),
        (signals.job_started, "always_fail"),
        (signals.job_released, "always_fail"),
        (signals.job_started, "always_fail"),
        (signals.job_failed, "always_fail"),
    ]
    assert Run.objects.filter(key="signalled").exists() and not Job.objects.exists()
    assert FailedJob.objects.count() == 1
    assert any("receiver" in r.getMessage() and "raised" in r.getMessage() for r in caplog.records)


def test_max_jobs_and_once_stop_the_worker():
    for i in range(3):
        jobs.record.enqueue(f"r{i}")
    worker, reason = run_worker(max_jobs=2)
    assert (reason, worker.processed, Job.objects.count()) == (StopReason.MAX_JOBS, 2, 1)
    worker, reason = run_worker(once=True)
    assert (reason, worker.processed, Job.objects.count()) == (StopReason.ONCE, 1, 0)


def test_memory_limit_stops_the_worker_after_a_job():
    jobs.record.enqueue("m1")
    jobs.record.enqueue("m2")
    worker, reason = run_worker(memory=1)
    assert (reason, worker.processed, Job.objects.count()) == (StopReason.MEMORY, 1, 1)


def test_a_wrong_statement_is_not_taken_for_a_lost_connection():
    from django.db import DatabaseError, connection

    from django_dbqueue.db import is_connection_error

    with pytest.raises(DatabaseError) as info, connection.cursor() as cursor:
        cursor.execute("SELECT no_such_column FROM dbqueue_job")
    assert not is_connection_error(info.value)


@pytest.mark.django_db(transaction=True)
def test_a_failed_claim_is_not_taken_for_an_empty_queue(monkeypatch):
    from django.db import OperationalError

    real = claims.reserve_many
    calls = []

    def flaky(*args, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            raise OperationalError("server closed the connection unexpectedly")
        return real(*args, **kwargs)

    monkeypatch.setattr(claims, "reserve_many", flaky)
    jobs.record.enqueue("after-a-failed-claim")
    worker, reason = run_worker()
    assert reason is StopReason.EMPTY and worker.processed == 1
    assert Run.objects.filter(key="after-a-failed-claim").exists()
