"""Retries as Celery users expect them: exponential backoff with a cap and jitter, retry_on and fail_on."""

from __future__ import annotations

import dataclasses
import json

import pytest
from django.core.exceptions import ImproperlyConfigured
from django.db.models.functions import Now
from django.test import override_settings

from django_dbqueue import JobContext, JobTimeout, Snooze, job, registry
from django_dbqueue.checks import check_settings
from django_dbqueue.execution import Defaults
from django_dbqueue.models import FailedJob, Job
from django_dbqueue.registry import Exponential
from tests.conftest import run_worker
from tests.testapp import jobs
from tests.testapp.models import Attempt, Run


class Unavailable(ConnectionError):
    """The flaky service said no."""


class Rejected(Unavailable):
    """The service said no for good: a ConnectionError that retrying cannot fix."""


def call_service(context: JobContext, key: str, error: str) -> None:
    Attempt.objects.create(key=key, attempt=context.attempt)
    raise {"unavailable": Unavailable, "rejected": Rejected, "value": ValueError}[error](f"{key}: {error}")


# Registered per test by the fixture: @job at import would add them to every test's registry.
CALLERS = {
    "retry_on": dict(retry_on=(ConnectionError,), tries=3),
    "fail_on": dict(fail_on=ValueError, tries=3),
    "both": dict(retry_on=[ConnectionError], fail_on=(Rejected,), tries=3),
    "exponential": dict(backoff=Exponential(base=100, factor=3, max=500, jitter=0), tries=5),
}


@pytest.fixture
def callers():
    definitions = {
        name: registry.JobDefinition(
            func=call_service, name=f"tests.retry_policy.{name}", takes_context=True, **options
        )
        for name, options in CALLERS.items()
    }
    for definition in definitions.values():
        registry.register(definition)
    yield definitions
    for definition in definitions.values():
        registry.unregister(definition.name)


def available_in(pk: int) -> float:
    """Seconds from the database's clock until the job ``pk`` is available."""
    row = Job.objects.annotate(now=Now()).get(pk=pk)
    return (row.available_at - row.now).total_seconds()


# -- exponential backoff -------------------------------------------------------------


def test_an_exponential_backoff_grows_by_its_factor_up_to_its_cap():
    policy = Exponential(base=10, factor=2, max=100, jitter=0)
    assert [policy.seconds(attempt) for attempt in range(1, 7)] == [10, 20, 40, 80, 100, 100]
    # The attempts column holds far more than a float's exponent: the cap, not an OverflowError.
    assert policy.seconds(32767) == 100
    assert Exponential(base=5, factor=1, max=60, jitter=0).seconds(9) == 5


def test_jitter_draws_each_delay_from_its_last_share():
    full, half = Exponential(base=8, max=8), Exponential(base=8, max=8, jitter=0.5)
    assert full.jitter == 1.0  # Celery's full jitter by default
    assert (full.seconds(1, rand=lambda: 0.0), full.seconds(1, rand=lambda: 0.75)) == (8, 2)
    assert (half.seconds(1, rand=lambda: 0.0), half.seconds(1, rand=lambda: 0.999)) == (8, pytest.approx(4, abs=0.01))
    drawn = {full.seconds(1) for _ in range(50)}
    assert len(drawn) > 1 and all(0 <= seconds <= 8 for seconds in drawn)
    assert Exponential(jitter=False).jitter == 0.0 and Exponential(jitter=True).jitter == 1.0


def test_backoff_exponential_is_the_default_policy_and_backoff_max_and_jitter_shape_it():
    plain = job(name="tests.retry_policy.plain", backoff="exponential")(lambda: None)
    shaped = job(name="tests.retry_policy.shaped", backoff="exponential", backoff_max=3600, backoff_jitter=0.25)(
        lambda: None
    )
    try:
        assert plain.backoff == Exponential(base=1, factor=2, max=600, jitter=1.0)
        assert shaped.backoff == Exponential(max=3600, jitter=0.25)
        assert shaped.using(backoff_max=60).backoff == Exponential(max=60, jitter=0.25)
        assert shaped.using(queue="emails").backoff == shaped.backoff
        assert shaped.using(backoff=[5, 10]).backoff == [5, 10]
        assert registry.backoff_seconds("exponential", 3) <= 4  # as DBQUEUE["BACKOFF"] may say
    finally:
        registry.unregister(plain.name)
        registry.unregister(shaped.name)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"base": 0}, "base must be seconds above 0 and at most 2147483647, not 0"),
        ({"base": -1}, "base must be seconds above 0"),
        ({"max": 2**31}, "max must be seconds above 0 and at most 2147483647, not 2147483648"),
        ({"base": 60, "max": 10}, r"max \(10\) must be at least base \(60\)"),
        ({"factor": 0.5}, "factor must be a number from 1 to 100, not 0.5"),
        ({"factor": True}, "factor must be a number from 1 to 100, not True"),
        ({"jitter": 1.5}, "jitter must be True, False or a share from 0 to 1, not 1.5"),
        ({"jitter": "full"}, "jitter must be True, False or a share from 0 to 1, not 'full'"),
    ],
)
def test_an_exponential_backoff_refuses_values_it_cannot_use(fields, message):
    with pytest.raises(ValueError, match=f"^Exponential backoff: {message}"):
        Exponential(**fields)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"backoff": "exponentially"}, "backoff must be seconds .*, a list of them, 'exponential' or an Exponential"),
        ({"backoff": [1, 2], "backoff_max": 60}, "backoff_max and backoff_jitter shape backoff='exponential'"),
        ({"backoff_jitter": 0.5}, "backoff_max and backoff_jitter shape backoff='exponential'"),
        ({"backoff": "exponential", "backoff_max": 0}, "Exponential backoff: max must be seconds above 0"),
        ({"backoff": "exponential", "backoff_jitter": 2}, "Exponential backoff: jitter must be True, False or a share"),
    ],
)
def test_the_decorator_refuses_a_backoff_it_cannot_use_naming_the_job(options, message):
    with pytest.raises(ImproperlyConfigured, match=f"^job 'tests.retry_policy.bad': {message}"):
        job(name="tests.retry_policy.bad", **options)(lambda: None)
    assert "tests.retry_policy.bad" not in registry.all_definitions()


def test_the_envelope_stores_the_policy_and_a_worker_reads_it_back():
    policy = Exponential(base=2, factor=3, max=50, jitter=0.5)
    stored = json.loads(json.dumps(registry.backoff_json(policy)))
    assert stored == {"base": 2, "factor": 3, "max": 50, "jitter": 0.5}
    assert registry.stored_backoff(stored) == policy
    assert registry.stored_backoff("exponential") == "exponential"
    # Unreadable (a hand edit, a newer version's field): the worker's default applies, as for a bad list.
    assert registry.stored_backoff({"base": 2, "growth": 3}) is None
    assert registry.stored_backoff({"base": -2}) is None
    assert registry.stored_backoff([1, -1]) is None


@pytest.mark.django_db
def test_a_failing_job_waits_base_then_base_times_factor_up_to_the_cap(callers):
    handle = callers["exponential"].enqueue("grow", "unavailable")
    assert json.loads(handle.job.payload)["backoff"] == {"base": 100, "factor": 3, "max": 500, "jitter": 0.0}
    waits = []
    for _ in range(3):
        run_worker(once=True)
        waits.append(available_in(handle.id))
        Job.objects.filter(pk=handle.id).update(available_at=Now())  # the backoff has passed
    assert 99 < waits[0] <= 100 and 299 < waits[1] <= 300 and 499 < waits[2] <= 500
    assert Attempt.objects.filter(key="grow").count() == 3


@pytest.mark.django_db
def test_the_workers_default_backoff_may_be_exponential():
    handle = jobs.always_fail.enqueue("default-policy")
    run_worker(once=True, defaults=Defaults(tries=3, timeout=30, backoff=Exponential(base=200, jitter=0)))
    assert 199 < available_in(handle.id) <= 200


@pytest.mark.parametrize("value", ["exponential", Exponential(base=5, max=60, jitter=0)])
def test_the_backoff_setting_may_be_exponential(value):
    with override_settings(DBQUEUE={"BACKOFF": value}):
        assert check_settings() == []


def test_the_backoff_setting_still_refuses_a_word_it_does_not_know():
    with override_settings(DBQUEUE={"BACKOFF": "exponentially"}):
        assert [message.id for message in check_settings()] == ["dbqueue.E003"]


# -- retry_on and fail_on ------------------------------------------------------------


@pytest.mark.django_db
def test_retry_on_retries_its_exceptions_and_fails_others_at_once(callers):
    retried = callers["retry_on"].enqueue("retried", "unavailable")
    failed = callers["retry_on"].enqueue("failed", "value")
    run_worker(defaults=Defaults(tries=3, timeout=30, backoff=1000))
    assert Job.objects.get().pk == retried.id  # released for another try, in 1000 s
    row = FailedJob.objects.get()
    assert (row.job_id, row.attempts, row.exception_class) == (failed.id, 1, "builtins.ValueError")
    assert row.error.startswith(
        f"tests.retry_policy.retry_on (job {failed.id}) is not retried: "
        "ValueError is not in its retry_on (ConnectionError).\n\nTraceback (most recent call last):"
    )


@pytest.mark.django_db
def test_fail_on_fails_at_once_and_runs_the_failure_callback(callers):
    failed = callers["fail_on"].bind("bad input", "value").on_failure(jobs.record.bind("cleanup")).enqueue()
    callers["fail_on"].enqueue("flaky", "unavailable")
    run_worker()
    row = FailedJob.objects.get(job_id=failed.id)
    assert row.attempts == 1
    assert row.error.startswith(
        f"tests.retry_policy.fail_on (job {failed.id}) is not retried: ValueError is in its fail_on."
    )
    assert Run.objects.filter(key="cleanup").exists()
    # Anything else keeps its tries.
    assert FailedJob.objects.get(name="tests.retry_policy.fail_on", attempts=3).exception_class.endswith("Unavailable")


@pytest.mark.django_db
def test_fail_on_wins_over_retry_on_for_a_subclass(callers):
    rejected = callers["both"].enqueue("rejected", "rejected")
    run_worker(once=True)
    row = FailedJob.objects.get()
    assert row.job_id == rejected.id and row.attempts == 1
    assert "is not retried: tests.test_retry_policy.Rejected is in its fail_on." in row.error


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"retry_on": ()}, r"retry_on must be an exception class or a tuple of them, such as \(ConnectionError"),
        ({"retry_on": "ValueError"}, "retry_on must be an exception class or a tuple of them"),
        ({"fail_on": {ValueError}}, "fail_on must be an exception class or a tuple of them"),
        ({"retry_on": (ValueError, 3)}, "retry_on must hold exception classes, such as ConnectionError, not 3"),
        ({"fail_on": (int,)}, "fail_on must hold exception classes, such as ConnectionError, not <class 'int'>"),
        ({"fail_on": Snooze}, "fail_on cannot hold Snooze: the worker handles it before fail_on is asked"),
    ],
)
def test_the_decorator_refuses_retry_on_and_fail_on_it_cannot_use(options, message):
    with pytest.raises(ImproperlyConfigured, match=f"^job 'tests.retry_policy.bad': {message}"):
        job(name="tests.retry_policy.bad", **options)(lambda: None)
    assert "tests.retry_policy.bad" not in registry.all_definitions()


def test_retry_on_and_fail_on_are_kept_as_tuples_and_match_subclasses(callers):
    assert callers["fail_on"].fail_on == (ValueError,) and callers["both"].retry_on == (ConnectionError,)
    assert callers["both"].not_retried(Unavailable()) is None
    assert callers["both"].not_retried(TimeoutError()) == "TimeoutError is not in its retry_on (ConnectionError)"
    # A timeout is a JobTimeout: listed or not, like any exception.
    assert callers["retry_on"].not_retried(JobTimeout()) == (
        "django_dbqueue.exceptions.JobTimeout is not in its retry_on (ConnectionError)"
    )
    assert callers["fail_on"].not_retried(JobTimeout()) is None


def test_using_cannot_change_retry_on_or_fail_on(callers):
    for option in ("retry_on", "fail_on"):
        with pytest.raises(TypeError, match=f"using\\({option}=...\\): {option} is not stored with a job"):
            callers["retry_on"].using(**{option: (OSError,)})


def test_a_job_without_retry_on_or_fail_on_retries_every_exception():
    assert jobs.always_fail.retry_on is None and jobs.always_fail.fail_on == ()
    assert jobs.always_fail.not_retried(ValueError()) is None


def test_the_options_of_job_are_a_definitions_fields_and_the_backoff_options_it_folds_in():
    fields = {field.name for field in dataclasses.fields(registry.JobDefinition)} - {"func", "name", "takes_context"}
    options = set(registry.DefinitionOptions.__annotations__)
    assert options == fields | {"backoff_max", "backoff_jitter"}
    # What using() takes: all but the options that live in the definition only.
    assert options - set(registry.JobOptions.__annotations__) == {"retry_on", "fail_on"}


def test_queue_work_backoff_option_takes_exponential_and_says_so_when_refusing():
    import argparse

    from django_dbqueue.management.options import backoff

    assert backoff("exponential") == "exponential" and backoff("10,60") == [10.0, 60.0]
    with pytest.raises(argparse.ArgumentTypeError, match="or 'exponential'"):
        backoff("exponentially")
