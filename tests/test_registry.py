"""Job definitions, the registry, and enqueueing."""

import datetime as dt
import threading

import pytest
from django.core.exceptions import ImproperlyConfigured
from django.db import connection, connections, transaction
from django.test.utils import CaptureQueriesContext

from django_dbqueue import JobDefinition, enqueue_many, job, registry
from django_dbqueue.exceptions import JobNotRegistered
from django_dbqueue.models import Job
from tests.testapp import jobs
from tests.testapp.models import Order


def test_jobs_modules_of_installed_apps_are_discovered():
    assert "tests.testapp.jobs.record" in registry.all_definitions()
    assert registry.get("tests.add") is jobs.add


def test_the_decorator_keeps_the_function_callable_and_names_it_by_module_and_qualname():
    assert jobs.add(2, 3) == 5
    assert jobs.record.name == "tests.testapp.jobs.record"
    assert isinstance(jobs.record, JobDefinition)


def test_an_unknown_name_raises_an_error_that_says_how_to_fix_it():
    with pytest.raises(JobNotRegistered) as info:
        registry.get("os.system")
    assert "No job is registered under the name 'os.system'" in str(info.value)
    assert "INSTALLED_APPS" in str(info.value)


def test_a_name_used_by_two_functions_is_refused():
    def other():
        pass

    with pytest.raises(ImproperlyConfigured, match="give one of them another name"):
        job(name="tests.add")(other)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"tries": 0}, "tries must be an integer of at least 1"),
        ({"timeout": 0}, "timeout must be a whole number of seconds"),
        ({"retry_after": 1.5}, "retry_after must be a whole number of seconds"),
        ({"backoff": [1, -1]}, "backoff must be seconds"),
        ({"backoff": "10"}, "backoff must be seconds"),
        ({"priority": 101}, "priority must be an integer from -100 to 100"),
    ],
)
def test_bad_options_are_refused_when_the_job_is_defined(options, message):
    with pytest.raises(ImproperlyConfigured, match=message):
        job(name="tests.bad_options", **options)(lambda: None)
    assert "tests.bad_options" not in registry.all_definitions()


def test_using_returns_a_changed_copy():
    delayed = jobs.add.using(queue="high", delay=dt.timedelta(seconds=30), priority=5)
    assert (delayed.queue, delayed.delay, delayed.priority) == ("high", 30, 5)
    assert (jobs.add.queue, jobs.add.delay, jobs.add.priority) == (None, 0, 0)
    assert delayed.name == jobs.add.name


def test_backoff_per_attempt_repeats_the_last_value():
    assert [registry.backoff_seconds([5, 60], attempt) for attempt in (1, 2, 3)] == [5, 60, 60]
    assert registry.backoff_seconds(7, 3) == 7


@pytest.mark.django_db
def test_enqueue_stores_a_row_with_the_options():
    row = jobs.add.using(queue="high", priority=7, tries=9, retry_after=120, timeout=30).enqueue(1, b=2)
    row.refresh_from_db()
    assert (row.queue, row.name, row.priority, row.max_tries, row.retry_after, row.timeout, row.attempts) == (
        "high",
        "tests.add",
        7,
        9,
        120,
        30,
        0,
    )
    assert row.reserved_at is None
    assert Job.objects.waiting().filter(pk=row.pk).exists()


@pytest.mark.django_db
def test_a_delayed_job_is_not_waiting_until_its_time():
    row = jobs.add.using(delay=3600).enqueue(1, 2)
    assert Job.objects.delayed().filter(pk=row.pk).exists()
    assert Job.objects.reserve(["default"]) is None


@pytest.mark.django_db
def test_an_argument_that_cannot_be_stored_inserts_nothing():
    with pytest.raises(TypeError, match=r"Cannot enqueue tests.add: argument 'b' is of type set"):
        jobs.add.enqueue(1, b={1})
    with pytest.raises(TypeError, match=r"argument 0 \(args\[0\]\) is an unsaved testapp.Order"):
        jobs.touch_order.enqueue(Order(number="1"))
    with pytest.raises(TypeError):
        enqueue_many([jobs.add.bind(1, 2), jobs.add.bind(object(), 2)])
    assert Job.objects.count() == 0


@pytest.mark.django_db
def test_enqueue_many_inserts_every_call_in_one_statement():
    calls = [jobs.add.bind(i, i) for i in range(50)]
    with CaptureQueriesContext(connection) as queries:
        rows = enqueue_many(calls)
    inserts = [q["sql"] for q in queries.captured_queries if q["sql"].startswith("INSERT")]
    assert len(inserts) == 1
    assert len(rows) == 50 and Job.objects.count() == 50
    assert all(row.pk for row in rows)


@pytest.mark.django_db(transaction=True)
def test_a_job_enqueued_in_a_rolled_back_transaction_never_existed():
    with pytest.raises(RuntimeError), transaction.atomic():
        jobs.add.enqueue(1, 2)
        raise RuntimeError("roll back")
    assert Job.objects.count() == 0
    assert Job.objects.reserve(["default"]) is None


@pytest.mark.django_db(transaction=True)
def test_a_job_enqueued_in_an_open_transaction_is_invisible_to_workers_until_commit():
    seen: list[object] = []

    def reserve_from_another_connection():
        try:
            seen.append(Job.objects.reserve(["default"]))
        finally:
            connections.close_all()

    with transaction.atomic():
        row = jobs.add.enqueue(1, 2)
        other = threading.Thread(target=reserve_from_another_connection)
        other.start()
        other.join(timeout=30)
        assert seen == [None]
    other = threading.Thread(target=reserve_from_another_connection)
    other.start()
    other.join(timeout=30)
    assert [job.pk for job in seen[1:]] == [row.pk]
