"""A job's life beyond one run: snooze, retry_until and middleware around every run."""

from __future__ import annotations

import datetime as dt
import logging
import math
import signal
import time
from collections.abc import Callable
from typing import Any

import pytest
from django.conf import settings
from django.core.exceptions import ImproperlyConfigured
from django.db.models.functions import Now
from django.test import override_settings
from django.utils import timezone, translation

from django_dbqueue import JobContext, Snooze, checks, claims, job, payload
from django_dbqueue.execution import Defaults
from django_dbqueue.inline import execute
from django_dbqueue.middleware import JobLogFilter
from django_dbqueue.models import FailedJob, Job
from django_dbqueue.registry import JobDefinition
from django_dbqueue.validation import MAX_SECONDS
from tests.conftest import run_worker, wait_until
from tests.testapp import jobs
from tests.testapp.models import Attempt, Run

pytestmark = pytest.mark.django_db

DEFAULTS = Defaults(tries=3, timeout=30, backoff=0, timeout_grace=2)


def middleware_settings(*paths: str) -> override_settings:
    return override_settings(DBQUEUE={**settings.DBQUEUE, "MIDDLEWARE": list(paths)})


@pytest.fixture(autouse=True)
def _fresh_middleware_calls():
    jobs.MIDDLEWARE_CALLS.clear()
    yield
    jobs.MIDDLEWARE_CALLS.clear()


# -- snooze ------------------------------------------------------------------------


@pytest.mark.django_db(transaction=True)
@pytest.mark.acceptance
def test_a_job_that_snoozes_five_times_spends_no_try_and_then_succeeds_in_a_worker_process(worker_process):
    jobs.snooze_then_record.enqueue("sleepy", 5, 0.05)  # tries=2: a spent try per snooze would fail it
    process = worker_process("--sleep", "0.05")
    wait_until(lambda: Run.objects.filter(key="sleepy").exists(), 60, "the job never succeeded")
    process.signal(signal.SIGTERM)
    assert process.wait(timeout=30) == 0, process.output()
    assert list(Attempt.objects.filter(key="sleepy").order_by("id").values_list("attempt", flat=True)) == [
        1,
        2,
        3,
        4,
        5,
        6,
    ]
    # Read by the last run, before its success deleted the row: attempts 6, given back 5.
    assert Run.objects.get(key="sleepy").note == "given_back=5 last=False"
    assert not Run.objects.filter(key="sleepy-swallowed").exists()  # except Exception did not catch it
    assert not Job.objects.exists() and not FailedJob.objects.exists()


def test_a_snooze_releases_the_job_for_its_delay_and_counts_as_given_back():
    jobs.snooze_for.enqueue("later", 300)
    run_worker()
    job = Job.objects.annotate(now=Now()).get()
    assert (job.attempts, job.given_back, job.tries_spent, job.reserved_at) == (1, 1, 0, None)
    assert dt.timedelta(seconds=299) < job.available_at - job.now <= dt.timedelta(seconds=300)
    assert not FailedJob.objects.exists()


def test_a_snooze_is_not_an_error_its_outcome_holds_no_traceback():
    row = jobs.snooze_for.enqueue("short", dt.timedelta(seconds=5))
    claimed = claims.reserve(["default"], worker_id="w")
    assert claimed is not None
    outcome = execute(claimed, worker_id="w", defaults=DEFAULTS)
    assert (outcome.status, outcome.delay, outcome.given_back, outcome.snoozed) == ("released", 5.0, True, True)
    assert outcome.error == "snoozed for 5 s" and isinstance(outcome.exception, Snooze)
    assert claimed.pk == row.pk


@pytest.mark.parametrize(
    ("seconds", "error"),
    [
        (-1, ValueError),
        (math.nan, ValueError),
        (math.inf, ValueError),
        (MAX_SECONDS + 1, ValueError),
        (dt.timedelta(seconds=-1), ValueError),
        ("5", TypeError),
        (True, TypeError),
    ],
)
def test_a_snooze_refuses_a_delay_the_database_cannot_hold(seconds, error):
    with pytest.raises(error, match="a snooze takes"):
        Snooze(seconds)


def test_a_bad_snooze_delay_is_an_ordinary_failure_of_the_job():
    jobs.snooze_for.enqueue("negative", -5)  # tries=1
    run_worker()
    failed = FailedJob.objects.get()
    assert failed.exception_class == "builtins.ValueError"
    assert "a snooze takes seconds from 0 to 2147483647, not -5" in failed.error
    assert failed.error.startswith("Traceback")


def test_a_snooze_at_the_boundaries_is_accepted():
    assert Snooze(0).seconds == 0.0 and Snooze(MAX_SECONDS).seconds == MAX_SECONDS
    assert Snooze(dt.timedelta(minutes=2)).seconds == 120.0
    assert str(Snooze(0.05)) == "snoozed for 0.05 s"


# -- retry_until ---------------------------------------------------------------------


def test_a_job_past_its_retry_until_fails_at_its_first_error_whatever_its_tries():
    past = timezone.now() - dt.timedelta(seconds=1)
    jobs.always_fail.using(tries=5, retry_until=past).enqueue("late")
    run_worker()
    failed = FailedJob.objects.get()
    assert failed.attempts == 1 and Attempt.objects.count() == 1
    assert failed.exception_class == "builtins.ValueError"
    assert "is not retried: its retry_until, " in failed.error and "has passed" in failed.error
    # The original traceback is kept, and stays the summary.
    assert "Traceback (most recent call last):" in failed.error
    assert failed.error_summary == "ValueError: late always fails"


def test_a_job_before_its_retry_until_is_retried_until_its_tries_are_used():
    jobs.always_fail.using(tries=3, retry_until=dt.timedelta(hours=1)).enqueue("early")
    run_worker()
    assert FailedJob.objects.get().attempts == 3 and Attempt.objects.count() == 3
    assert "retry_until" not in FailedJob.objects.get().error


def test_a_callable_retry_until_is_evaluated_at_enqueue_and_stored_in_utc():
    calls = []

    def deadline() -> dt.datetime:
        calls.append(1)
        return dt.datetime(2030, 1, 2, 3, 4, 5, tzinfo=dt.timezone(dt.timedelta(hours=2)))

    row = jobs.always_fail.using(retry_until=deadline).enqueue("stored").job
    assert calls == [1]
    assert payload.decode(row.payload)["retry_until"] == "2030-01-02T01:04:05+00:00"


def test_a_retry_until_timedelta_counts_from_enqueue():
    before = timezone.now()
    row = jobs.always_fail.using(retry_until=dt.timedelta(minutes=10)).enqueue("relative").job
    stored = dt.datetime.fromisoformat(payload.decode(row.payload)["retry_until"])
    assert before + dt.timedelta(minutes=10) <= stored <= timezone.now() + dt.timedelta(minutes=10)


@pytest.mark.parametrize(
    ("value", "message"),
    [
        (dt.datetime(2030, 1, 1), "retry_until must be a timezone-aware datetime, not the naive '2030-01-01T00:00:00'"),
        ("tomorrow", "retry_until must be an aware datetime, a timedelta, or a callable returning one, not str"),
        (dt.timedelta(seconds=-5), "retry_until as a timedelta must be from 0 to"),
        (3600, "not int 3600"),
    ],
)
def test_a_bad_retry_until_is_refused_on_the_definition(value, message):
    with pytest.raises(ImproperlyConfigured, match=message):
        jobs.always_fail.using(retry_until=value)
    with pytest.raises(ImproperlyConfigured, match=message):
        JobDefinition(func=jobs.always_fail.func, name="tests.bad_retry_until", retry_until=value)


@pytest.mark.parametrize("returned", [dt.datetime(2030, 1, 1), "tomorrow"])
def test_a_callable_retry_until_that_returns_a_bad_value_fails_the_enqueue(returned):
    with pytest.raises(TypeError, match=r"Cannot enqueue tests\.testapp\.jobs\.always_fail: retry_until must be"):
        jobs.always_fail.using(retry_until=lambda: returned).enqueue("never")
    assert not Job.objects.exists()


def test_retry_until_is_compared_with_the_database_clock_at_the_claim():
    """The row says the database claimed it an hour ago: by that clock the deadline,
    half an hour ago by this process's clock, has not passed yet."""
    now = timezone.now()
    envelope = {
        "v": payload.VERSION,
        "args": [],
        "kwargs": {},
        "retry_until": (now - dt.timedelta(minutes=30)).isoformat(),
    }
    row = Job(
        pk=1,
        name=jobs.raise_system_exit.name,
        payload=payload.dumps(envelope),
        attempts=1,
        max_tries=3,
        retry_after=60,
        reserved_at=now - dt.timedelta(hours=1),
    )
    assert execute(row, worker_id="w", defaults=DEFAULTS).status == "released"
    row.reserved_at = now
    outcome = execute(row, worker_id="w", defaults=DEFAULTS)
    assert outcome.status == "failed" and "has passed" in outcome.error


def test_an_unreadable_retry_until_is_ignored_and_the_tries_still_apply(caplog):
    envelope = {"v": payload.VERSION, "args": [], "kwargs": {}, "retry_until": "soon"}
    row = Job(
        pk=1, name=jobs.raise_system_exit.name, payload=payload.dumps(envelope), attempts=1, reserved_at=timezone.now()
    )
    with caplog.at_level(logging.WARNING, logger="django_dbqueue"):
        assert execute(row, worker_id="w", defaults=DEFAULTS).status == "released"
    assert "ignoring unreadable retry_until" in caplog.text


# -- middleware ----------------------------------------------------------------------


def test_settings_middleware_wrap_the_jobs_own_in_order_around_each_run():
    jobs.wrapped.enqueue("result")
    with middleware_settings("tests.testapp.jobs.outer_middleware", "tests.testapp.jobs.inner_middleware"):
        run_worker()
    assert jobs.MIDDLEWARE_CALLS == [
        "outer:before:wrapped:1",
        "inner:before:wrapped:1",
        "job:before:wrapped:1",
        "run",
        "job:after:result",
        "inner:after:result",
        "outer:after:result",
    ]
    assert not Job.objects.exists()


def test_settings_middleware_receive_a_context_for_jobs_that_take_none():
    jobs.record.enqueue("plain")
    with middleware_settings("tests.testapp.jobs.outer_middleware"):
        run_worker()
    assert jobs.MIDDLEWARE_CALLS == ["outer:before:record:1", "outer:after:plain"]
    assert Run.objects.filter(key="plain").exists()


def test_settings_middleware_are_read_again_when_the_setting_changes():
    jobs.wrapped.enqueue("first")
    with middleware_settings("tests.testapp.jobs.outer_middleware"):
        run_worker()
    jobs.wrapped.enqueue("second")
    run_worker()
    assert [call for call in jobs.MIDDLEWARE_CALLS if call.startswith("outer")] == [
        "outer:before:wrapped:1",
        "outer:after:first",
    ]


def test_a_callable_in_the_middleware_setting_works_like_its_dotted_path():
    jobs.wrapped.enqueue("direct")
    with override_settings(DBQUEUE={**settings.DBQUEUE, "MIDDLEWARE": [jobs.inner_middleware]}):
        run_worker()
    assert jobs.MIDDLEWARE_CALLS[0] == "inner:before:wrapped:1"


@pytest.mark.django_db(transaction=True)
@pytest.mark.acceptance
def test_an_exception_in_a_middleware_fails_the_job_and_the_worker_process_keeps_serving(worker_process):
    row = jobs.behind_failing_middleware.enqueue("never")  # tries=2
    process = worker_process("--sleep", "0.05")
    wait_until(lambda: FailedJob.objects.exists(), 30, "the job never failed")
    jobs.record.enqueue("after")
    wait_until(lambda: Run.objects.filter(key="after").exists(), 30, f"the worker stopped serving:\n{process.output()}")
    assert process.process.poll() is None
    process.signal(signal.SIGTERM)
    assert process.wait(timeout=30) == 0, process.output()
    failed = FailedJob.objects.get()
    assert (failed.job_id, failed.attempts, failed.exception_class) == (row.pk, 2, "builtins.RuntimeError")
    assert "in failing_middleware" in failed.error and failed.error_summary == "RuntimeError: the middleware broke"
    assert list(Attempt.objects.filter(key=f"mw-{row.pk}").values_list("attempt", flat=True)) == [1, 2]
    assert not Run.objects.filter(key="never").exists()


def test_middleware_run_inside_the_jobs_timeout():
    jobs.behind_sleeping_middleware.enqueue("slow")  # timeout=1
    started = time.monotonic()
    run_worker()
    assert time.monotonic() - started < 5
    assert FailedJob.objects.get().exception_class == "django_dbqueue.exceptions.JobTimeout"


def test_a_middleware_that_cannot_be_imported_fails_the_run_with_an_error_naming_it():
    jobs.behind_missing_middleware.enqueue("unreached")  # tries=1
    run_worker()
    failed = FailedJob.objects.get()
    assert failed.exception_class == "django.core.exceptions.ImproperlyConfigured"
    assert (
        "the middleware 'tests.testapp.no_such_module.middleware' in @job(middleware=...) of "
        "tests.testapp.jobs.behind_missing_middleware cannot be imported: "
        "No module named 'tests.testapp.no_such_module'"
    ) in failed.error
    assert not Run.objects.exists()


def test_a_bad_path_in_the_middleware_setting_is_released_then_failed_and_the_worker_carries_on():
    jobs.always_fail.enqueue("x")  # tries=2
    with middleware_settings("tests.testapp.jobs.no_such_middleware"):
        _worker, _reason = run_worker()
    failed = FailedJob.objects.get()
    assert failed.attempts == 2 and failed.exception_class == "django.core.exceptions.ImproperlyConfigured"
    assert "the middleware 'tests.testapp.jobs.no_such_middleware' in DBQUEUE['MIDDLEWARE'] cannot be imported" in (
        failed.error
    )
    assert not Attempt.objects.exists()  # the job itself never ran


@pytest.mark.parametrize(
    "value",
    [
        ["tests.testapp.jobs.no_such_middleware"],
        ["no_such_module.middleware"],
        ["tests.testapp.jobs.MIDDLEWARE_CALLS"],  # imports, but is not callable
        "tests.testapp.jobs.outer_middleware",  # a string, not a list
        [42],
    ],
)
def test_the_system_check_reports_a_middleware_setting_that_does_not_import_to_callables(value):
    with override_settings(DBQUEUE={"MIDDLEWARE": value}):
        [error] = checks.check_settings()
    assert error.id == "dbqueue.E003"
    assert error.msg.startswith(
        "DBQUEUE['MIDDLEWARE'] must be a list of middleware: callables, or dotted paths that import to callables, not"
    )


def test_the_system_check_accepts_importable_middleware():
    with override_settings(DBQUEUE={"MIDDLEWARE": ["django_dbqueue.middleware.log_context", jobs.inner_middleware]}):
        assert checks.check_settings() == []


@pytest.mark.parametrize("entry", [42, "not a path"])
def test_a_jobs_own_middleware_must_be_callables_or_dotted_paths(entry):
    with pytest.raises(ImproperlyConfigured, match="each middleware must be a callable or the dotted path of one"):
        JobDefinition(func=jobs.record.func, name="tests.bad_middleware", middleware=[entry])


def test_the_log_context_middleware_tags_log_records_written_during_a_run(caplog):
    jobs.log_line.enqueue("tagged")
    caplog.handler.addFilter(JobLogFilter())
    with middleware_settings("django_dbqueue.middleware.log_context"):
        with caplog.at_level(logging.WARNING, logger="tests.jobs"):
            run_worker()
    [record] = [r for r in caplog.records if r.name == "tests.jobs"]
    assert (record.job_name, record.job_attempt) == ("tests.testapp.jobs.log_line", 1)
    assert isinstance(record.job_id, int)
    outside = logging.LogRecord("x", logging.INFO, __file__, 1, "m", None, None)
    JobLogFilter().filter(outside)
    assert (outside.job_id, outside.job_name, outside.job_attempt) == ("", "", "")


# The README's first middleware example, run for real.
def use_language(context: JobContext, call_next: Callable[[], Any]) -> Any:
    """Run jobs that take a ``language`` argument with that language active."""
    language = context.kwargs.get("language")
    if not language:
        return call_next()
    with translation.override(language):
        return call_next()


@job(name="tests.lifecycle.greet", middleware=[use_language])
def greet(key: str, *, language: str = "") -> None:
    Run.objects.create(key=key, note=translation.get_language())


def test_a_middleware_reads_the_calls_arguments_and_switches_the_language_around_the_run():
    greet.enqueue("fr", language="fr")
    greet.enqueue("default")
    run_worker()
    assert dict(Run.objects.values_list("key", "note")) == {"fr": "fr", "default": settings.LANGUAGE_CODE}
