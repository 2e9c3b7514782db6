"""Job definitions, the registry, and enqueueing."""

import datetime as dt
import threading

import pytest
from django.conf import settings
from django.core.exceptions import ImproperlyConfigured
from django.db import connection, connections, transaction
from django.test import override_settings
from django.test.utils import CaptureQueriesContext

from django_dbqueue import JobDefinition, chain, claims, enqueue_many, job, registry
from django_dbqueue.exceptions import DbQueueError, JobNotRegistered, PayloadTooLarge, UnknownQueue
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
        ({"tries": 0}, "tries must be a whole number from 1 to 32767, not 0"),
        ({"tries": 32768}, "tries must be a whole number from 1 to 32767, not 32768"),
        ({"tries": True}, "tries must be a whole number"),
        ({"timeout": 0}, "timeout must be a whole number of seconds"),
        ({"timeout": 2**31}, "timeout must be a whole number of seconds from 1 to 2147483647, not 2147483648"),
        ({"retry_after": 1.5}, "retry_after must be a whole number of seconds"),
        ({"retry_after": 10**12}, "retry_after must be a whole number of seconds from 1 to 2147483647"),
        ({"backoff": [1, -1]}, "backoff must be seconds"),
        ({"backoff": "10"}, "backoff must be seconds"),
        ({"backoff": float("inf")}, "backoff must be seconds"),
        ({"backoff": [10, 2**40]}, "backoff must be seconds"),
        ({"priority": 101}, "priority must be a whole number from -100 to 100, not 101"),
        ({"delay": 1e12}, "delay must be seconds from 0 to 2147483647"),
        ({"delay": float("nan")}, "delay must be seconds"),
        ({"queue": ""}, "a queue name cannot be empty"),
        ({"queue": "emails "}, "may hold only letters, digits"),
        ({"queue": "q" * 101}, "is 101 characters long; at most 100"),
        ({"queue": 5}, "a queue name must be a str, not int"),
    ],
)
def test_bad_options_are_refused_when_the_job_is_defined(options, message):
    with pytest.raises(ImproperlyConfigured, match=message):
        job(name="tests.bad_options", **options)(lambda: None)
    assert "tests.bad_options" not in registry.all_definitions()


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"queue": "two words"}, "may hold only letters, digits"),
        ({"queue": "x" * 101}, "at most 100"),
        ({"tries": 40000}, "tries must be a whole number from 1 to 32767"),
        ({"timeout": 2**31}, "timeout must be a whole number of seconds from 1 to 2147483647"),
        ({"delay": dt.timedelta(days=40000)}, "delay must be seconds from 0 to 2147483647"),
    ],
)
def test_using_refuses_bad_options_like_the_decorator(options, message):
    with pytest.raises(ImproperlyConfigured, match=message):
        jobs.add.using(**options)


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
    row = jobs.add.using(queue="high", priority=7, tries=9, retry_after=120, timeout=30).enqueue(1, b=2).job
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
    assert claims.reserve(["default"]) is None


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
    # 40 rows of 22 columns fit one statement under SQLite's 999 parameters
    # (Django 5.2's limit there), past which Django splits the batch itself.
    calls = [jobs.add.bind(i, i) for i in range(40)]
    with CaptureQueriesContext(connection) as queries:
        rows = enqueue_many(calls)
    inserts = [q["sql"] for q in queries.captured_queries if q["sql"].startswith("INSERT")]
    assert len(inserts) == 1
    assert len(rows) == 40 and Job.objects.count() == 40
    assert all(row.pk for row in rows)


@pytest.mark.django_db(transaction=True)
def test_a_job_enqueued_in_a_rolled_back_transaction_never_existed():
    with pytest.raises(RuntimeError), transaction.atomic():
        jobs.add.enqueue(1, 2)
        raise RuntimeError("roll back")
    assert Job.objects.count() == 0
    assert claims.reserve(["default"]) is None


@pytest.mark.django_db(transaction=True)
def test_a_job_enqueued_in_an_open_transaction_is_invisible_to_workers_until_commit():
    seen: list[object] = []

    def reserve_from_another_connection():
        try:
            seen.append(claims.reserve(["default"]))
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


# -- MAX_PAYLOAD_SIZE and QUEUES, on every enqueue path -------------------------

MIB = 1024 * 1024


def dbqueue(**changes):
    return override_settings(DBQUEUE={**settings.DBQUEUE, **changes})


@pytest.mark.django_db
def test_a_50_mb_argument_is_refused_naming_the_job_and_the_size():
    big = "x" * (50 * MIB)
    with pytest.raises(PayloadTooLarge) as info:
        jobs.record.enqueue(big)
    size = len(f'{{"v":1,"args":["{big}"],"kwargs":{{}}}}')
    assert str(info.value) == (
        f"Cannot enqueue tests.testapp.jobs.record: its payload is {size:,} bytes, over "
        "DBQUEUE['MAX_PAYLOAD_SIZE'] (1,048,576 bytes). Keep large data out of the queue: store it "
        "elsewhere and pass a reference (a model instance, a file path) instead."
    )
    assert (info.value.name, info.value.size, info.value.limit) == ("tests.testapp.jobs.record", size, MIB)
    assert isinstance(info.value, ValueError) and isinstance(info.value, DbQueueError)
    assert Job.objects.count() == 0


@pytest.mark.django_db
def test_the_payload_size_counts_utf8_bytes_not_characters():
    with dbqueue(MAX_PAYLOAD_SIZE=400_000), pytest.raises(PayloadTooLarge, match=r"is 600,\d{3} bytes"):
        jobs.record.enqueue("é" * 300_000)
    assert Job.objects.count() == 0


@pytest.mark.django_db
def test_a_payload_of_exactly_the_limit_is_accepted_and_one_byte_more_is_refused():
    row = jobs.record.enqueue("y" * 1000).job
    limit = len(row.payload)
    Job.objects.all().delete()
    with dbqueue(MAX_PAYLOAD_SIZE=limit):
        jobs.record.enqueue("y" * 1000)
        with pytest.raises(PayloadTooLarge):
            jobs.record.enqueue("y" * 1001)
    assert Job.objects.count() == 1


@pytest.mark.django_db
def test_enqueue_many_with_one_payload_too_large_inserts_nothing_of_the_batch():
    calls = [jobs.record.bind(f"k{index}") for index in range(5)]
    with pytest.raises(PayloadTooLarge, match=r"Cannot enqueue tests\.testapp\.jobs\.record"):
        enqueue_many([*calls, jobs.record.bind("x" * (2 * MIB)), *calls])
    assert Job.objects.count() == 0


@pytest.mark.django_db
def test_a_chain_whose_payload_is_too_large_inserts_nothing():
    steps = chain(jobs.step.bind("c", 1), jobs.step.bind("z" * (2 * MIB), 2))
    with pytest.raises(PayloadTooLarge, match=r"Cannot enqueue tests\.testapp\.jobs\.step"):
        steps.enqueue()
    assert Job.objects.count() == 0


@pytest.mark.django_db
def test_without_max_payload_size_a_large_payload_is_stored():
    with dbqueue(MAX_PAYLOAD_SIZE=None):
        row = jobs.record.enqueue("x" * (2 * MIB))
    assert len(Job.objects.get(pk=row.pk).payload) > 2 * MIB


@pytest.mark.django_db
def test_enqueueing_into_a_queue_not_in_queues_is_refused_and_inserts_nothing():
    with dbqueue(QUEUES=["default", "emails"]):
        with pytest.raises(UnknownQueue) as info:
            jobs.add.using(queue="emials").enqueue(1, 2)
        with pytest.raises(UnknownQueue):
            enqueue_many([jobs.add.bind(1, 2), jobs.add.using(queue="reports").bind(3, 4)])
        with pytest.raises(UnknownQueue, match=r"Cannot enqueue tests\.add into the queue 'reports'"):
            chain(jobs.step.bind("c", 1), jobs.add.using(queue="reports").bind(1, 2)).enqueue()
        with pytest.raises(UnknownQueue):
            jobs.add.bind(1, 2).then(jobs.add.using(queue="reports").bind(3, 4)).enqueue()
        assert Job.objects.count() == 0
        jobs.add.using(queue="emails").enqueue(1, 2)
        jobs.add.enqueue(1, 2)
    assert str(info.value) == (
        "Cannot enqueue tests.add into the queue 'emials': it is not in DBQUEUE['QUEUES'] ('default', 'emails'), "
        "so no worker is meant to serve it. Add it to QUEUES, or pick one of those queues."
    )
    assert isinstance(info.value, ValueError)
    assert sorted(Job.objects.values_list("queue", flat=True)) == ["default", "emails"]


@pytest.mark.django_db
def test_the_tasks_backend_enqueues_through_the_same_checks():
    pytest.importorskip("django.tasks")
    from django_dbqueue.models import TaskResultRecord
    from tests.testapp import tasks

    with dbqueue(QUEUES=["default"]), pytest.raises(UnknownQueue, match="into the queue 'high'"):
        tasks.add_numbers.using(queue_name="high").enqueue(1, 2)
    assert Job.objects.count() == 0 and TaskResultRecord.objects.count() == 0


def test_importing_the_package_for_job_imports_no_models():
    import subprocess
    import sys

    script = "import sys, django_dbqueue; from django_dbqueue import job; print('django_dbqueue.models' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "False"
