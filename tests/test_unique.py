"""Unique jobs (issue 12): a unique index on the key, what a duplicate enqueue returns,
the scopes, ``unique_for`` windows, failures and retries, on every database.

Concurrency is real: threads with connections of their own enqueue the same job at
once, and the database's unique index decides.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from django.core.exceptions import ImproperlyConfigured
from django.db import IntegrityError, OperationalError, connection, transaction
from django.test.utils import CaptureQueriesContext

from django_dbqueue import claims, enqueue, enqueue_many, insert, job, lifecycle, registry, signals, unique
from django_dbqueue.handles import JobHandle, JobStatus
from django_dbqueue.models import FailedJob, Job, UniqueWindow
from django_dbqueue.rows import Flow, NewJob
from tests.conftest import run_worker, wait_until
from tests.testapp import jobs
from tests.testapp.models import Run

pytestmark = pytest.mark.django_db(transaction=True)

THREADS = 8
ENQUEUES = 1000

record_unique = jobs.record.using(unique=True)
record_until_started = jobs.record.using(unique="until_started")


def key_of(definition: registry.JobDefinition[..., Any], *args: Any, **kwargs: Any) -> str:
    return unique.key_of(definition, args, kwargs)


def in_threads(count: int, work: Callable[[int], Any]) -> list[Any]:
    """Run ``work(i)`` in ``count`` threads started together, each with a connection of
    its own (closed at the end); return what each returned."""
    results: list[Any] = [None] * count
    errors: list[Exception] = []
    start = threading.Barrier(count)

    def run(i: int) -> None:
        try:
            start.wait(timeout=30)
            results[i] = work(i)
        except Exception as exc:  # noqa: BLE001 - reported by the test's thread, below
            errors.append(exc)
        finally:
            connection.close()

    threads = [threading.Thread(target=run, args=(i,)) for i in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=300)
    assert not errors, errors
    return results


@pytest.fixture
def enqueued_signals() -> Iterator[list[int]]:
    """The ids of the jobs ``job_enqueued`` was sent for during the test."""
    received: list[int] = []

    def receiver(sender: Any, job: Job, **kwargs: Any) -> None:
        received.append(job.pk)

    signals.job_enqueued.connect(receiver)
    yield received
    signals.job_enqueued.disconnect(receiver)


def reserve() -> Job:
    reserved = claims.reserve(["default"], worker_id="test")
    assert reserved is not None
    return reserved


# -- a duplicate enqueue -------------------------------------------------------------


def test_a_second_enqueue_while_the_first_waits_returns_the_waiting_job_marked_not_enqueued(enqueued_signals, caplog):
    first = record_unique.enqueue("a")
    assert first.enqueued is True and first.job is not None
    with caplog.at_level(logging.DEBUG, logger="django_dbqueue"):
        second = record_unique.enqueue("a")
    assert isinstance(second, JobHandle)
    assert second.enqueued is False and second.job is None
    assert (second.id, second.name, second.queue, second.status) == (
        first.id,
        "tests.testapp.jobs.record",
        "default",
        JobStatus.WAITING,
    )
    assert Job.objects.count() == 1
    assert enqueued_signals == [first.id]
    key = key_of(record_unique, "a")
    assert f"not enqueued, unique key held key={key} by_id={first.id}" in caplog.text


def test_the_key_is_the_job_name_and_the_encoded_arguments():
    record_unique.enqueue("a", note="x")
    assert not record_unique.enqueue(key="a", note="x").enqueued  # the same call, spelled otherwise
    assert record_unique.enqueue("a", note="y").enqueued
    assert record_unique.enqueue("b", note="x").enqueued
    # Another job with the same arguments has a key of its own.
    assert jobs.echo.using(unique=True).enqueue("a", note="x").enqueued
    stored = Job.objects.order_by("id").values_list("unique_key", flat=True)
    assert len(set(stored)) == 4
    assert all(key.startswith(("tests.testapp.jobs.record:", "tests.testapp.jobs.echo:")) for key in stored)


def test_a_unique_key_callable_or_string_chooses_what_counts_as_the_same_job():
    by_key = jobs.record.using(unique_key=lambda key, note="": key)
    assert by_key.enqueue("a", note="x").enqueued
    assert not by_key.enqueue("a", note="y").enqueued
    assert by_key.enqueue("b").enqueued
    assert Job.objects.filter(unique_key="tests.testapp.jobs.record:a").exists()
    one_at_a_time = jobs.record.using(unique_key="nightly")
    assert one_at_a_time.enqueue("c").enqueued
    assert not one_at_a_time.enqueue("d").enqueued


def test_a_delayed_job_holds_its_key_and_the_duplicate_says_delayed():
    first = record_unique.using(delay=60).enqueue("a")
    second = record_unique.enqueue("a")
    assert (second.enqueued, second.id, second.status) == (False, first.id, JobStatus.DELAYED)


def test_jobs_that_are_not_unique_are_stored_every_time():
    assert all(jobs.record.enqueue("a").enqueued for _ in range(3))
    assert Job.objects.filter(unique_key__isnull=True).count() == 3


def test_aenqueue_returns_the_holder_too():
    from asgiref.sync import async_to_sync

    first = async_to_sync(record_unique.aenqueue)("a")
    second = async_to_sync(record_unique.aenqueue)("a")
    assert (first.enqueued, second.enqueued, second.id) == (True, False, first.id)


def test_a_duplicate_that_finds_its_holder_gone_is_enqueued(monkeypatch):
    """The holder finishes between the conflict and the read of it: the key is free, so the job is stored."""
    first = record_unique.enqueue("a")
    holders = insert.unique_key_holders
    calls = []

    def finish_then_read(*args: Any, **kwargs: Any) -> dict[str, int]:
        if not calls:
            Job.objects.filter(pk=first.id).delete()
        calls.append(kwargs)
        return holders(*args, **kwargs)

    monkeypatch.setattr(insert, "unique_key_holders", finish_then_read)
    second = record_unique.enqueue("a")
    assert second.enqueued and second.id != first.id
    assert list(Job.objects.values_list("pk", flat=True)) == [second.id]


def test_other_integrity_errors_still_raise():
    # A row the database refuses for another reason than the key: no retry_after (NOT
    # NULL; the enqueue's own checks are bypassed).
    new = NewJob("default", "tests.testapp.jobs.record", '{"v":1,"args":[],"kwargs":{}}', 0, None, None, None, 0.0)  # type: ignore[arg-type]
    with pytest.raises(IntegrityError):
        insert.insert_one(new._replace(flow=Flow(unique_key="k")))
    with pytest.raises(IntegrityError):
        insert.insert_many([new._replace(flow=Flow(unique_key="k")), new._replace(flow=Flow(unique_key="l"))])
    assert Job.objects.count() == 0


def test_a_holder_missed_by_the_first_read_is_found_by_the_next(monkeypatch):
    """A read that misses the holder (it finished and another took the key meanwhile) is
    followed by an insert or a locking read that finds the holder of the moment."""
    first = record_unique.enqueue("a")
    holders = insert.unique_key_holders
    calls = []

    def miss_once(*args: Any, **kwargs: Any) -> dict[str, int]:
        calls.append(kwargs)
        return {} if len(calls) == 1 else holders(*args, **kwargs)

    monkeypatch.setattr(insert, "unique_key_holders", miss_once)
    with transaction.atomic():
        second = record_unique.enqueue("a")
    assert (second.enqueued, second.id) == (False, first.id)
    assert len(calls) == 2
    assert Job.objects.count() == 1


# -- concurrent enqueues -----------------------------------------------------------


def test_eight_threads_enqueueing_the_same_job_a_thousand_times_store_exactly_one_row():
    handles = in_threads(THREADS, lambda i: [record_unique.enqueue("same") for _ in range(ENQUEUES // THREADS)])
    every = [handle for chunk in handles for handle in chunk]
    assert len(every) == ENQUEUES
    (row,) = Job.objects.all()
    assert [handle.id for handle in every if handle.enqueued] == [row.pk]
    assert {handle.id for handle in every} == {row.pk}


def test_eight_threads_enqueueing_many_copies_store_exactly_one_row():
    def work(i: int) -> list[JobHandle]:
        return enqueue_many([record_unique.bind("same"), jobs.record.bind(f"plain {i}")] * 5, batch_size=3)

    every = [handle for chunk in in_threads(THREADS, work) for handle in chunk]
    held = Job.objects.get(unique_key__isnull=False)
    assert Job.objects.filter(unique_key__isnull=True).count() == THREADS * 5
    keyed = every[0::2]
    assert [handle.id for handle in keyed if handle.enqueued] == [held.pk]
    assert {handle.id for handle in keyed} == {held.pk}


def test_eight_threads_enqueueing_in_a_window_store_exactly_one_row_and_one_window():
    windowed = jobs.record.using(unique_for=60)
    every = [
        handle
        for chunk in in_threads(THREADS, lambda i: [windowed.enqueue("same") for _ in range(ENQUEUES // THREADS)])
        for handle in chunk
    ]
    (row,) = Job.objects.all()
    (window,) = UniqueWindow.objects.all()
    assert window.job_id == row.pk and window.key == key_of(windowed, "same")
    assert row.unique_key is None  # a window alone holds no key on the row
    assert [handle.id for handle in every if handle.enqueued] == [row.pk]
    assert {handle.id for handle in every} == {row.pk}


@pytest.mark.parametrize("commit", [True, False], ids=["commit", "rollback"])
def test_a_second_enqueue_waits_for_an_uncommitted_first_then_is_a_duplicate_or_stored(commit):
    inserted = threading.Event()
    finish = threading.Event()
    seen: dict[str, Any] = {}

    def first() -> None:
        try:
            with transaction.atomic():
                seen["first"] = record_unique.enqueue("a")
                inserted.set()
                finish.wait(timeout=30)
                if not commit:
                    transaction.set_rollback(True)
        finally:
            connection.close()

    def second() -> None:
        try:
            seen["second"] = record_unique.enqueue("a")
        finally:
            connection.close()

    one = threading.Thread(target=first)
    one.start()
    assert inserted.wait(timeout=30)
    two = threading.Thread(target=second)
    two.start()
    time.sleep(0.3)
    assert "second" not in seen  # waiting for the first transaction to end
    finish.set()
    one.join(timeout=30)
    two.join(timeout=30)
    assert seen["second"].enqueued is not commit
    assert list(Job.objects.values_list("pk", flat=True)) == [seen["first"].id if commit else seen["second"].id]


class FakeDeadlock(Exception):
    """A driver's deadlock error, as PostgreSQL (SQLSTATE 40P01) and MariaDB (1213) report it."""

    sqlstate = "40P01"

    def __init__(self) -> None:
        super().__init__(1213, "Deadlock found when trying to get lock; try restarting transaction")


def deadlock_once(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    real = enqueue._store_once
    calls: list[int] = []

    def store(*args: Any) -> Any:
        calls.append(1)
        if len(calls) == 1:
            raise OperationalError("deadlock") from FakeDeadlock()
        return real(*args)

    monkeypatch.setattr(enqueue, "_store_once", store)
    return calls


def test_an_enqueue_that_is_its_own_transaction_runs_again_after_a_deadlock(monkeypatch, caplog):
    if connection.vendor == "sqlite":
        pytest.skip("SQLite serialises writers: no deadlocks")
    calls = deadlock_once(monkeypatch)
    with caplog.at_level(logging.INFO, logger="django_dbqueue"):
        assert record_unique.enqueue("a").enqueued
    assert len(calls) == 2 and "enqueue ran again after a deadlock attempt=1" in caplog.text


def test_a_deadlock_inside_the_callers_transaction_reaches_the_caller(monkeypatch):
    if connection.vendor == "sqlite":
        pytest.skip("SQLite serialises writers: no deadlocks")
    calls = deadlock_once(monkeypatch)
    with pytest.raises(OperationalError), transaction.atomic():
        record_unique.enqueue("a")
    assert len(calls) == 1


# -- inside the caller's transaction -------------------------------------------------


def test_a_duplicate_inside_a_transaction_leaves_the_transaction_usable():
    record_unique.enqueue("a")
    with transaction.atomic():
        first = record_unique.enqueue("b")
        assert not record_unique.enqueue("a").enqueued
        assert not record_unique.enqueue("b").enqueued
        Run.objects.create(key="after the duplicates")
        assert jobs.record.enqueue("c").enqueued
    assert Run.objects.filter(key="after the duplicates").exists()
    assert Job.objects.count() == 3
    assert Job.objects.filter(pk=first.id).exists()


def test_a_rolled_back_enqueue_frees_the_key():
    with pytest.raises(RuntimeError), transaction.atomic():
        record_unique.enqueue("a")
        raise RuntimeError("the caller's work failed")
    assert Job.objects.count() == 0
    assert record_unique.enqueue("a").enqueued


def test_on_postgresql_a_unique_enqueue_is_one_statement_with_no_savepoint():
    if connection.vendor != "postgresql":
        pytest.skip("ON CONFLICT DO NOTHING is PostgreSQL's path")
    with CaptureQueriesContext(connection) as queries:
        record_unique.enqueue("a")
    assert len(queries) == 1
    assert "ON CONFLICT" in queries[0]["sql"] and "DO NOTHING" in queries[0]["sql"]
    with transaction.atomic(), CaptureQueriesContext(connection) as queries:
        assert not record_unique.enqueue("a").enqueued
    assert not any("SAVEPOINT" in query["sql"] for query in queries)


# -- scopes ---------------------------------------------------------------------


def test_until_finished_the_key_is_held_while_the_job_runs_and_freed_when_it_succeeds():
    first = record_unique.enqueue("a")
    running = reserve()
    duplicate = record_unique.enqueue("a")
    assert (duplicate.enqueued, duplicate.id, duplicate.status) == (False, first.id, JobStatus.RUNNING)
    assert lifecycle.delete(running)
    assert record_unique.enqueue("a").enqueued


def test_until_finished_a_released_job_keeps_its_key():
    record_unique.enqueue("a")
    assert lifecycle.release(reserve(), delay=0, exception=True)
    assert not record_unique.enqueue("a").enqueued


def test_until_started_the_key_is_freed_when_a_worker_claims_the_job():
    first = record_until_started.enqueue("a")
    assert not record_until_started.enqueue("a").enqueued
    running = reserve()
    assert running.pk == first.id and running.unique_key is None
    assert Job.objects.get(pk=first.id).unique_key is None
    second = record_until_started.enqueue("a")
    assert second.enqueued and second.id != first.id
    assert not record_until_started.enqueue("a").enqueued


def test_the_first_claim_of_an_until_started_job_frees_its_key_before_it_runs_and_later_claims_free_it_at_once():
    from django_dbqueue import claims

    first = record_until_started.enqueue("a")
    assert not claims.clears_unique_keys("default")
    assert reserve().unique_key is None and Job.objects.get(pk=first.id).unique_key is None
    # PostgreSQL's claim statement leaves the CASE out until its queue is known to hold such jobs:
    # the key was freed a statement later, before the job ran. The other databases' claims always free it.
    assert claims.clears_unique_keys("default") is (connection.vendor == "postgresql")
    second = record_until_started.enqueue("a")
    assert second.enqueued
    with CaptureQueriesContext(connection) as queries:
        assert reserve().unique_key is None
    assert Job.objects.get(pk=second.id).unique_key is None
    # The claim's own UPDATE freed it: no second statement.
    assert len([query for query in queries if query["sql"].startswith("UPDATE")]) == 1, queries.captured_queries


def test_a_worker_runs_a_unique_job_and_the_next_enqueue_is_stored():
    record_unique.enqueue("a")
    run_worker()
    assert Run.objects.filter(key="a").count() == 1
    assert record_unique.enqueue("a").enqueued


@pytest.mark.one_django
@pytest.mark.acceptance
@pytest.mark.parametrize("scope", ["until_finished", "until_started"])
def test_with_a_real_worker_the_key_is_free_again_per_scope(worker_process, scope):
    napping = jobs.nap.using(unique=scope)
    first = napping.enqueue("scope", 1.5)
    worker = worker_process("--sleep", "0.05")
    # Running: reserved, and (until started) its key freed, which a claim does before the job runs.
    running = Job.objects.filter(pk=first.id, reserved_at__isnull=False)
    if scope == "until_started":
        running = running.filter(unique_key__isnull=True)
    wait_until(running.exists, 30, worker.output())
    while_running = napping.enqueue("scope", 1.5)
    if scope == "until_started":
        assert while_running.enqueued
        Job.objects.filter(pk=while_running.id).delete()
    else:
        assert (while_running.enqueued, while_running.id, while_running.status) == (False, first.id, JobStatus.RUNNING)
    wait_until(lambda: not Job.objects.filter(pk=first.id).exists(), 30, worker.output())
    assert napping.enqueue("scope", 0).enqueued


# -- failures and retries -----------------------------------------------------------


def fail(job_row: Job) -> FailedJob:
    failed = lifecycle.fail(job_row, error="Traceback: boom", exception_class="ValueError")
    assert failed is not None
    return failed


def test_a_job_that_fails_for_good_frees_its_key():
    failing = jobs.always_fail.using(unique=True, tries=1)
    failing.enqueue("a")
    run_worker()
    assert FailedJob.objects.count() == 1 and Job.objects.count() == 0
    assert failing.enqueue("a").enqueued


def test_retrying_a_failed_unique_job_takes_its_key_again():
    record_unique.enqueue("a")
    failed = fail(reserve())
    (retried,) = lifecycle.retry(FailedJob.objects.filter(pk__in=[failed.pk]))
    assert retried.unique_key == key_of(record_unique, "a")
    duplicate = record_unique.enqueue("a")
    assert (duplicate.enqueued, duplicate.id) == (False, retried.pk)


def test_retrying_a_failed_until_started_job_takes_its_key_until_it_starts_again():
    record_until_started.enqueue("a")
    failed = fail(reserve())
    (retried,) = lifecycle.retry(FailedJob.objects.filter(pk__in=[failed.pk]))
    assert retried.unique_until_start and retried.unique_key
    assert reserve().pk == retried.pk
    assert record_until_started.enqueue("a").enqueued


def test_retrying_a_failed_job_whose_key_is_held_again_leaves_it_failed_and_says_why(caplog):
    record_unique.enqueue("a")
    failed = fail(reserve())
    holder = record_unique.enqueue("a")
    assert holder.enqueued
    with caplog.at_level(logging.WARNING, logger="django_dbqueue"):
        assert lifecycle.retry(FailedJob.objects.filter(pk__in=[failed.pk])) == []
    assert FailedJob.objects.filter(pk=failed.pk).exists()
    assert list(Job.objects.values_list("pk", flat=True)) == [holder.id]
    assert f"job {holder.id} with the same unique key" in caplog.text
    assert "waiting or running" in caplog.text


# -- enqueue_many -------------------------------------------------------------------


def test_enqueue_many_stores_the_first_call_of_each_key_and_returns_the_holder_for_the_rest(enqueued_signals):
    existing = record_unique.enqueue("held")
    calls = [
        record_unique.bind("a"),
        jobs.record.bind("plain"),
        record_unique.bind("a"),
        record_unique.bind("held"),
        record_unique.bind("b"),
        jobs.record.bind("plain"),
    ]
    handles = enqueue_many(calls, batch_size=2)
    assert [handle.enqueued for handle in handles] == [True, True, False, False, True, True]
    assert handles[2].id == handles[0].id and handles[3].id == existing.id
    stored = [handle.id for handle in handles if handle.enqueued]
    assert stored == sorted(stored)  # inserted in call order
    assert Job.objects.count() == 5
    assert enqueued_signals == [existing.id, *stored]
    assert [handle.name for handle in handles] == ["tests.testapp.jobs.record"] * 6


def test_enqueue_many_of_jobs_that_are_not_unique_is_still_one_insert_per_batch():
    with CaptureQueriesContext(connection) as queries:
        enqueue_many([jobs.record.bind(str(i)) for i in range(10)], batch_size=5)
    inserts = [query for query in queries if query["sql"].startswith("INSERT")]
    assert len(inserts) == 2 and not any("ON CONFLICT" in query["sql"] for query in inserts)


def test_enqueue_many_inside_a_transaction_leaves_it_usable_after_duplicates():
    record_unique.enqueue("a")
    with transaction.atomic():
        handles = enqueue_many([record_unique.bind("a"), record_unique.bind("b"), jobs.record.bind("c")])
        Run.objects.create(key="after")
    assert [handle.enqueued for handle in handles] == [False, True, True]
    assert Run.objects.filter(key="after").exists()


def test_enqueue_many_where_every_call_is_a_duplicate_stores_nothing():
    first = record_unique.enqueue("a")
    handles = enqueue_many([record_unique.bind("a")] * 3)
    assert [(handle.enqueued, handle.id) for handle in handles] == [(False, first.id)] * 3
    assert Job.objects.count() == 1


# -- unique_for windows -------------------------------------------------------------


def test_no_second_enqueue_within_the_window_even_after_the_first_finished():
    windowed = jobs.record.using(unique_for=1)
    first = windowed.enqueue("a")
    run_worker()
    duplicate = windowed.enqueue("a")
    assert (duplicate.enqueued, duplicate.id, duplicate.status) == (False, first.id, JobStatus.SUCCEEDED)
    window = UniqueWindow.objects.get()
    wait_until(lambda: windowed.enqueue("a").enqueued, 3, "the window did not expire")
    # The expired row was taken over: still one row per key, now naming the new job.
    taken_over = UniqueWindow.objects.get()
    assert taken_over.pk == window.pk and taken_over.expires_at > window.expires_at
    assert taken_over.job_id == Job.objects.get().pk


def test_a_window_alone_lets_a_second_job_in_once_it_expired_even_if_the_first_still_waits():
    windowed = jobs.record.using(unique_for=1, delay=60)
    first = windowed.enqueue("a")
    assert not windowed.enqueue("a").enqueued
    wait_until(lambda: windowed.enqueue("a").enqueued, 3, "the window did not expire")
    assert Job.objects.count() == 2 and Job.objects.filter(pk=first.id).exists()


def test_a_window_with_unique_also_waits_for_the_job_to_finish():
    both = jobs.record.using(unique=True, unique_for=1)
    first = both.enqueue("a")
    before = UniqueWindow.objects.get().expires_at
    time.sleep(1.1)
    duplicate = both.enqueue("a")
    assert (duplicate.enqueued, duplicate.id) == (False, first.id)
    # The duplicate left out by the row's key did not move the window.
    assert UniqueWindow.objects.get().expires_at == before
    Job.objects.filter(pk=first.id).delete()
    assert both.enqueue("a").enqueued


def test_windows_in_enqueue_many_store_the_first_call_of_each_key():
    windowed = jobs.record.using(unique_for=60)
    handles = enqueue_many([windowed.bind("a"), windowed.bind("b"), windowed.bind("a"), jobs.record.bind("a")])
    assert [handle.enqueued for handle in handles] == [True, True, False, True]
    assert handles[2].id == handles[0].id
    again = enqueue_many([windowed.bind("b"), windowed.bind("c")])
    assert (again[0].enqueued, again[0].id) == (False, handles[1].id)
    assert again[1].enqueued
    assert UniqueWindow.objects.count() == 3


def test_a_rolled_back_window_is_not_taken():
    windowed = jobs.record.using(unique_for=60)
    with pytest.raises(RuntimeError), transaction.atomic():
        windowed.enqueue("a")
        raise RuntimeError("the caller's work failed")
    assert windowed.enqueue("a").enqueued


def test_prune_windows_deletes_expired_windows_only():
    jobs.record.using(unique_for=60).enqueue("kept")
    jobs.record.using(unique_for=1).enqueue("expires")
    wait_until(lambda: enqueue.prune_windows() == 1, 3, "the expired window was not pruned")
    assert list(UniqueWindow.objects.values_list("key", flat=True)) == [key_of(jobs.record, "kept")]


# -- bad input ----------------------------------------------------------------------


def test_a_key_callable_that_raises_is_a_clear_error_and_nothing_is_stored():
    def broken(key: str, note: str = "") -> str:
        raise KeyError("no such customer")

    with pytest.raises(ValueError) as info:
        jobs.record.using(unique_key=broken, unique_for=60).enqueue("a")
    assert str(info.value) == (
        "Cannot enqueue tests.testapp.jobs.record: its unique_key raised KeyError: 'no such customer'"
    )
    with pytest.raises(ValueError):
        enqueue_many([record_unique.bind("a"), jobs.record.using(unique_key=broken).bind("b")])
    assert Job.objects.count() == 0 and UniqueWindow.objects.count() == 0


def test_a_key_callable_returning_something_else_than_a_str_or_int_is_an_error():
    with pytest.raises(ValueError, match="its unique_key must be a str or an int, not NoneType"):
        jobs.record.using(unique_key=lambda key, note="": None).enqueue("a")
    assert Job.objects.count() == 0


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"unique": "always"}, "unique must be True, False, 'until_finished' or 'until_started', not 'always'"),
        ({"unique": 1}, "unique must be True, False"),
        ({"unique_key": ""}, "unique_key must be a non-empty str or a callable"),
        ({"unique_key": 5}, "unique_key must be a non-empty str or a callable"),
        ({"unique_for": 0}, "unique_for must be seconds from 0 (excluded)"),
        ({"unique_for": -1}, "unique_for must be seconds"),
        ({"unique_for": True}, "unique_for must be seconds"),
        ({"unique_for": "60"}, "unique_for must be seconds"),
    ],
)
def test_wrong_unique_options_are_refused_when_the_job_is_defined(options, message):
    with pytest.raises(ImproperlyConfigured, match=f"job 'tests.unique.bad': {message}".replace("(", r"\(")[:60]):
        job(name="tests.unique.bad", **options)(lambda: None)
    with pytest.raises(ImproperlyConfigured, match=message.replace("(", r"\(").replace(")", r"\)")):
        jobs.record.using(**options)
    assert "tests.unique.bad" not in registry.all_definitions()


def test_using_adds_changes_and_removes_the_unique_options():
    assert (record_unique.unique, record_unique.unique_key, record_unique.unique_for) == (True, None, None)
    both = jobs.record.using(unique="until_started", unique_key="k", unique_for=5)
    assert (both.unique, both.unique_key, both.unique_for) == ("until_started", "k", 5)
    off = both.using(unique=False)
    assert (off.unique, off.unique_key, off.unique_for) == (False, None, None)
    assert off.enqueue("a").enqueued and off.enqueue("a").enqueued
    window_only = both.using(unique=False, unique_for=5)
    assert (window_only.unique_key, window_only.unique_for) == (None, 5)
