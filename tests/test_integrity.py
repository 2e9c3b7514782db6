"""One bad row never stops the queue (issue 26, points 1 and 3).

The job table refuses every value the worker cannot act on (one CHECK,
``dbqueue_job_bounds``, migration 0014), every path that builds a row checks the
same bounds first, and a loop over rows (the reclaim, the claim's flow round)
that still meets a bad one (a row written before the checks: the tests write one
past them) moves it to ``FailedJob`` with its error and goes on.
"""

from __future__ import annotations

import datetime as dt
import json
import signal
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
from django.db import DataError, IntegrityError, connection, transaction
from django.db.migrations.executor import MigrationExecutor

from django_dbqueue import batch, insert, lifecycle
from django_dbqueue.claims import claim
from django_dbqueue.db import DbNow
from django_dbqueue.models import INVALID_ROW_CLASS, FailedJob, FlowLimit, Job, JobBatch
from django_dbqueue.rows import new_job
from django_dbqueue.validation import ROW_BOUNDS, TEXT_BOUNDS, row_error
from tests.conftest import insert_at_this_schema, run_worker, wait_until
from tests.testapp import jobs
from tests.testapp.models import Run

REFUSED = (IntegrityError, DataError)
# Migration 0014's condition.
BOUNDS = " AND ".join(
    f"{column} >= {low}" if high is None else f"{column} BETWEEN {low} AND {high}"
    for column, (low, high) in ROW_BOUNDS.items()
)


@contextmanager
def past_the_checks() -> Iterator[None]:
    """Write rows as if the table had no checks (a row stored before migration 0014).

    PostgreSQL: the constraint is dropped, then added back NOT VALID, so the rows
    written meanwhile stay and every later write is checked (as an UPDATE of such
    a row is); ``restore_checks`` validates it once they are gone. SQLite and
    MariaDB: this connection skips its checks for a while.
    """
    with connection.cursor() as cursor:
        if connection.vendor == "postgresql":
            cursor.execute("ALTER TABLE dbqueue_job DROP CONSTRAINT dbqueue_job_bounds")
        elif connection.vendor == "sqlite":
            cursor.execute("PRAGMA ignore_check_constraints = ON")
        else:
            cursor.execute("SET SESSION check_constraint_checks = OFF")
    try:
        yield
    finally:
        with connection.cursor() as cursor:
            if connection.vendor == "postgresql":
                cursor.execute(f"ALTER TABLE dbqueue_job ADD CONSTRAINT dbqueue_job_bounds CHECK ({BOUNDS}) NOT VALID")
            elif connection.vendor == "sqlite":
                cursor.execute("PRAGMA ignore_check_constraints = OFF")
            else:
                cursor.execute("SET SESSION check_constraint_checks = ON")


@pytest.fixture
def restore_checks() -> Iterator[None]:
    yield
    Job.objects.all().delete()
    if connection.vendor == "postgresql":
        with connection.cursor() as cursor:
            cursor.execute("ALTER TABLE dbqueue_job VALIDATE CONSTRAINT dbqueue_job_bounds")


def _reserved(name: str = "tests.testapp.jobs.record", *, old_schema: bool = False, **values: Any) -> Job:
    """A row reserved ten minutes ago by a worker that is gone."""
    now = dt.datetime.now(dt.UTC)
    row = Job(
        name=name,
        payload='{"v": 1, "args": ["healthy"], "kwargs": {}}',
        queue="default",
        attempts=1,
        retry_after=60,
        available_at=now - dt.timedelta(minutes=11),
        created_at=now - dt.timedelta(minutes=11),
        reserved_at=now - dt.timedelta(minutes=10),
        reserved_by="gone",
    )
    row.__dict__.update(values)
    if old_schema:
        return insert_at_this_schema(row)
    row.save(force_insert=True)
    return row


# -- refused at write time ---------------------------------------------------


@pytest.mark.django_db
@pytest.mark.parametrize(
    "column, value",
    [
        ("retry_after", -1),
        ("retry_after", 0),
        ("timeout", -5),
        ("concurrency_limit", 0),
        ("concurrency_limit", -1),
        ("max_tries", -1),
        ("priority", 101),
        ("cancel", 3),
        ("attempts", -1),
    ],
)
def test_the_database_refuses_a_value_the_worker_cannot_act_on_through_update_and_raw_sql(column, value):
    handle = jobs.record.enqueue("x")
    with pytest.raises(REFUSED), transaction.atomic():
        Job.objects.filter(pk=handle.id).update(**{column: value})
    table, name = connection.ops.quote_name("dbqueue_job"), connection.ops.quote_name(column)
    with pytest.raises(REFUSED), transaction.atomic(), connection.cursor() as cursor:
        cursor.execute(f"UPDATE {table} SET {name} = %s WHERE id = %s", [value, handle.id])
    assert Job.objects.get(pk=handle.id).retry_after >= 1


@pytest.mark.django_db
def test_the_table_has_one_check_for_all_its_bounds_on_postgresql():
    if connection.vendor != "postgresql":
        pytest.skip("the count of constraints is PostgreSQL's concern (a statement compiles each)")
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT conname FROM pg_constraint WHERE conrelid = 'dbqueue_job'::regclass AND contype = 'c' ORDER BY 1"
        )
        assert [name for (name,) in cursor.fetchall()] == ["dbqueue_job_bounds"]


def test_row_error_names_the_column_and_the_bounds():
    assert row_error({"retry_after": -1}) == "retry_after must be a whole number from 1 to 2147483647, not -1"
    assert row_error({"concurrency_limit": 0}).startswith("concurrency_limit must be")
    assert row_error({"timeout": None, "max_tries": None, "concurrency_limit": None}) is None
    assert row_error({"retry_after": True}) is not None
    assert "rate_limit" in row_error({"rate_limit": "100 per minute"})
    assert "rate_limit" in row_error({"rate_limit": "1/0/1"})
    assert row_error({"rate_limit": "20/1/2"}) is None


def test_row_error_checks_the_text_columns_a_stored_step_fills():
    assert row_error({"name": "x" * 201}) == "name must be a str of 1 to 200 characters, not 201 characters"
    assert row_error({"name": ""}) is not None and row_error({"name": None}) is not None
    assert "queue name" in row_error({"queue": "no spaces"})
    assert row_error({"unique_key": "k" * 256}).startswith("unique_key must be a str of 0 to 255")
    assert row_error({"concurrency_key": {"a": 1}}).endswith("not a dict")
    assert row_error({"name": "a.b", "queue": "default", "unique_key": None, "rate_key": "r" * 255}) is None


def test_the_text_bounds_are_the_columns_lengths():
    assert TEXT_BOUNDS == {column: Job._meta.get_field(column).max_length for column in TEXT_BOUNDS}


def test_a_follow_up_step_read_back_with_out_of_range_values_is_refused_with_its_name():
    step = {"name": "tests.testapp.jobs.record", "queue": "default", "args": [], "kwargs": {}, "timeout": -1}
    with pytest.raises(ValueError, match=r"Cannot enqueue tests.testapp.jobs.record: timeout must be"):
        new_job(step, check=False)
    step = {**step, "timeout": None, "flow": {"concurrency_key": "k", "concurrency_limit": -1}}
    with pytest.raises(ValueError, match="concurrency_limit must be"):
        new_job(step, check=False)
    step = {**step, "flow": {"nonsense": 1}}
    with pytest.raises(ValueError, match="a step's flow must be a dict of"):
        new_job(step, check=False)
    step = {**step, "flow": None, "queue": "a queue"}
    with pytest.raises(ValueError, match="queue name"):
        new_job(step, check=False)
    step = {**step, "queue": "default", "flow": {"unique_key": "k" * 300}}
    with pytest.raises(ValueError, match="unique_key must be a str"):
        new_job(step, check=False)


@pytest.mark.django_db
def test_bulk_enqueue_of_rows_refuses_an_out_of_range_row_and_stores_none():
    now = dt.datetime.now(dt.UTC)
    rows = [
        Job(name="tests.testapp.jobs.record", payload="{}", retry_after=60, available_at=now, created_at=now),
        Job(name="tests.testapp.jobs.record", payload="{}", retry_after=-1, available_at=now, created_at=now),
    ]
    with pytest.raises(ValueError, match="retry_after must be"):
        insert.bulk_enqueue(rows)
    assert not Job.objects.exists()


@pytest.mark.django_db
def test_a_failed_job_whose_envelope_holds_a_bad_flow_value_stays_failed_and_the_others_are_retried(caplog):
    now = dt.datetime.now(dt.UTC)
    common = {"queue": "default", "name": "tests.testapp.jobs.record", "attempts": 1, "created_at": now}
    good = FailedJob.objects.create(job_id=1, payload='{"v": 1, "args": ["a"], "kwargs": {}}', failed_at=now, **common)
    bad = FailedJob.objects.create(
        job_id=2,
        payload='{"v": 1, "args": ["b"], "kwargs": {}, "flow": {"concurrency_key": "k", "concurrency_limit": -3}}',
        failed_at=now,
        **common,
    )
    odd = FailedJob.objects.create(
        job_id=3, payload='{"v": 1, "args": ["c"], "kwargs": {}, "flow": {"surprise": 1}}', failed_at=now, **common
    )
    weird = FailedJob.objects.create(
        job_id=4,
        payload='{"v": 1, "args": ["d"], "kwargs": {}, "flow": {"concurrency_key": {"a": 1}, "concurrency_limit": 1}}',
        failed_at=now,
        **common,
    )
    retried = lifecycle.retry(FailedJob.objects.filter(pk__in=[good.pk, bad.pk, odd.pk, weird.pk]))
    assert len(retried) == 2
    assert set(FailedJob.objects.values_list("pk", flat=True)) == {bad.pk, weird.pk}
    assert "concurrency_limit must be" in caplog.text
    assert f"failed_id={bad.pk}" in caplog.text


# -- moved aside by the loops over rows --------------------------------------------


@pytest.mark.django_db(transaction=True)
def test_a_poisoned_reserved_row_does_not_stop_the_reclaim_of_a_healthy_one(restore_checks):
    healthy = _reserved()
    with past_the_checks():
        # On its last try (fails: moved to FailedJob within bounds), and with tries
        # left (the reclaim's UPDATE is refused: moved aside as an invalid row).
        spent = _reserved(retry_after=0, max_tries=1, concurrency_limit=0, concurrency_key=None)
        left = _reserved(retry_after=0, max_tries=5)
    assert lifecycle.reclaim_expired() == 3
    healthy_row = Job.objects.get(pk=healthy.pk)
    assert healthy_row.reserved_at is None and healthy_row.attempts == 1
    # SQLite checks an UPDATE only against the checks of the columns it changes: its
    # reclaim puts the row with tries left back, and the claim that meets it moves it aside.
    assert [job.pk for job in claim("default", ["default"], 10, "w")] == [healthy.pk]
    assert not Job.objects.filter(pk__in=[spent.pk, left.pk]).exists()
    failed = {row.job_id: row for row in FailedJob.objects.all()}
    assert failed[spent.pk].exception_class == "django_dbqueue.exceptions.MaxAttemptsExceeded"
    assert failed[spent.pk].retry_after == 1
    assert failed[left.pk].exception_class == INVALID_ROW_CLASS
    assert "moved aside unrun" in failed[left.pk].error


@pytest.mark.django_db(transaction=True)
def test_a_row_moved_aside_is_logged_counted_and_listed_in_the_admin(restore_checks, caplog, admin_client):
    with past_the_checks():
        left = _reserved(retry_after=0, max_tries=5)
    lifecycle.reclaim_expired()
    assert claim("default", ["default"], 10, "w") == []
    failed = FailedJob.objects.get(job_id=left.pk)
    assert f"job moved aside job=tests.testapp.jobs.record id={left.pk}" in caplog.text
    assert [r.levelname for r in caplog.records if "moved aside" in r.getMessage()] == ["ERROR"]
    page = admin_client.get(f"/admin/django_dbqueue/failedjob/?exception_class={INVALID_ROW_CLASS}")
    assert page.status_code == 200 and f"/admin/django_dbqueue/failedjob/{failed.pk}/change/" in page.text
    assert FailedJob.objects.filter(exception_class=INVALID_ROW_CLASS).count() == 1


@pytest.mark.django_db(transaction=True)
def test_a_poisoned_row_of_a_dead_worker_is_moved_aside_and_its_healthy_job_released(restore_checks):
    healthy = _reserved()
    with past_the_checks():
        left = _reserved(retry_after=0, max_tries=5)
    error_for = "lost after {:.0f} s".format
    assert lifecycle.reclaim_worker("gone", error_for=error_for) == 2
    assert Job.objects.get(pk=healthy.pk).reserved_at is None
    if connection.vendor == "sqlite":
        # SQLite checks only the columns an UPDATE sets: the claim that meets the row moves it aside.
        assert [job.pk for job in claim("default", ["default"], 10, "w")] == [healthy.pk]
    assert FailedJob.objects.get(job_id=left.pk).exception_class == INVALID_ROW_CLASS


@pytest.mark.django_db(transaction=True)
def test_expired_compares_the_lease_in_sql_and_reads_only_expired_rows():
    now = dt.datetime.now(dt.UTC)
    old = _reserved()
    fresh = _reserved(reserved_at=now)
    long_lease = _reserved(retry_after=3600)
    jobs.record.enqueue("waiting")
    assert [job.pk for job in Job.objects.expired()] == [old.pk]
    assert "julianday" in str(Job.objects.get_queryset().expired().query) or connection.vendor != "sqlite"
    assert {fresh.pk, long_lease.pk}.isdisjoint(Job.objects.get_queryset().expired().values_list("pk", flat=True))


@pytest.mark.django_db(transaction=True)
def test_an_unreadable_rate_limit_fails_that_row_in_the_claim_and_the_others_are_claimed(limits):
    for n in range(3):
        limits.rated.enqueue(n)
    bad = [limits.rated.enqueue(10 + n).id for n in range(2)]
    Job.objects.filter(pk=bad[0]).update(rate_limit="100 per minute")
    Job.objects.filter(pk=bad[1]).update(rate_limit="1/0/1")
    claimed: list[Job] = []
    deadline = time.monotonic() + 10
    # The bucket (20/s, burst 2) lets two start at once, the third a tenth of a second later.
    while len(claimed) < 3 and time.monotonic() < deadline:
        claimed += claim("default", [limits.RATE_QUEUE], 10, "w")
        time.sleep(0.02)
    assert len(claimed) == 3 and not set(bad) & {job.pk for job in claimed}
    failed = FailedJob.objects.filter(job_id__in=bad)
    assert sorted(failed.values_list("exception_class", flat=True)) == [INVALID_ROW_CLASS] * 2
    assert all("rate_limit must be stored" in row.error for row in failed)


def _spoil_callbacks(**changes: Any) -> JobBatch:
    """A batch of one member whose stored ``then`` callbacks are a good step and a spoiled one."""
    batch(jobs.record.bind("member")).then(jobs.record.bind("spoiled"), jobs.record.bind("then")).enqueue()
    row = JobBatch.objects.get()
    steps = json.loads(row.callbacks)
    steps["then"][0].update(changes)
    steps["then"][0] = {key: value for key, value in steps["then"][0].items() if value is not DROP}
    JobBatch.objects.filter(pk=row.pk).update(callbacks=json.dumps(steps))
    return row


DROP = object()


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("changes", [{"timeout": -1}, {"args": DROP}, {"queue": "no such queue!"}])
def test_a_batch_whose_stored_callback_is_spoiled_ends_and_runs_its_other_callbacks(changes, caplog):
    row = _spoil_callbacks(**changes)
    jobs.record.enqueue("other")
    run_worker()
    assert sorted(Run.objects.values_list("key", flat=True)) == ["member", "other", "then"]
    assert JobBatch.objects.get(pk=row.pk).finished_at is not None
    assert f"batch id={row.pk} callback then not enqueued" in caplog.text
    assert not Job.objects.exists()


@pytest.mark.django_db(transaction=True)
@pytest.mark.skipif(connection.vendor != "sqlite", reason="only SQLite stores a text in a time column")
def test_a_row_whose_values_cannot_be_read_is_moved_aside_and_the_others_are_claimed(caplog):
    good = [jobs.record.enqueue(n).id for n in range(3)]
    bad = jobs.record.enqueue("bad").id
    with connection.cursor() as cursor:
        # Sorts before every real time, so it is claimable; Django cannot read it back.
        cursor.execute("UPDATE dbqueue_job SET available_at = '0001-13-45 00:00:00' WHERE id = %s", [bad])
    assert sorted(job.pk for job in claim("default", ["default"], 10, "w")) == good
    failed = FailedJob.objects.get(job_id=bad)
    assert failed.exception_class == INVALID_ROW_CLASS and "cannot be read" in failed.error
    assert not Job.objects.filter(pk=bad).exists()


# -- with real worker processes ----------------------------------------------------


@pytest.mark.acceptance
@pytest.mark.django_db(transaction=True)
def test_a_worker_reclaims_and_runs_a_healthy_job_beside_poisoned_rows_and_exits_0(worker_process, restore_checks):
    healthy = _reserved(payload='{"v": 1, "args": ["healthy"], "kwargs": {}}')
    with past_the_checks():
        _reserved(retry_after=0, max_tries=1, payload='{"v": 1, "args": ["spent"], "kwargs": {}}')
        _reserved(retry_after=0, max_tries=3, payload='{"v": 1, "args": ["left"], "kwargs": {}}')
    worker = worker_process("--stop-when-empty", "--sleep", "0.1")
    assert worker.wait(60) == 0, worker.output()
    assert list(Run.objects.values_list("key", flat=True)) == ["healthy"]
    assert not Job.objects.exists()
    assert FailedJob.objects.count() == 2
    assert not Job.objects.filter(pk=healthy.pk).exists()


@pytest.mark.acceptance
@pytest.mark.django_db(transaction=True)
def test_a_worker_runs_three_rate_limited_jobs_beside_unreadable_rate_rows_and_exits_0(worker_process, limits):
    for n in range(3):
        limits.rated.enqueue(n)
    bad = [limits.rated.enqueue(10 + n).id for n in range(2)]
    Job.objects.filter(pk=bad[0]).update(rate_limit="100 per minute")
    Job.objects.filter(pk=bad[1]).update(rate_limit="1/0/1")
    worker = worker_process("--queue", limits.RATE_QUEUE, "--sleep", "0.1", env={"DBQUEUE_TEST_LIMITS": "1"})
    wait_until(lambda: Run.objects.count() == 3 and FailedJob.objects.count() == 2, 30, worker.output())
    worker.signal(signal.SIGTERM)
    assert worker.wait(30) == 0, worker.output()
    assert sorted(Run.objects.values_list("key", flat=True)) == ["rated:0", "rated:1", "rated:2"]
    assert sorted(FailedJob.objects.values_list("job_id", flat=True)) == sorted(bad)
    assert "job moved aside" in worker.output()


@pytest.mark.acceptance
@pytest.mark.django_db(transaction=True)
def test_a_worker_ends_a_batch_whose_stored_callback_is_out_of_bounds_runs_three_others_and_exits_0(worker_process):
    _spoil_callbacks(timeout=-1)
    for n in range(3):
        jobs.record.enqueue(f"other{n}")
    worker = worker_process("--stop-when-empty", "--sleep", "0.1")
    assert worker.wait(60) == 0, worker.output()
    assert sorted(Run.objects.values_list("key", flat=True)) == ["member", "other0", "other1", "other2", "then"]
    assert not Job.objects.exists() and JobBatch.objects.get().finished_at is not None
    assert "callback then not enqueued" in worker.output()


@pytest.mark.django_db
def test_unused_flow_limit_rows_are_pruned():
    FlowLimit.objects.create(key="rate:old", tokens=1, updated_at=dt.datetime.now(dt.UTC) - dt.timedelta(days=2))
    FlowLimit.objects.create(key="rate:new", tokens=1, updated_at=DbNow())
    FlowLimit.objects.create(key="concurrency:k", tokens=0)
    FlowLimit.objects.create(key="concurrency:gone", tokens=0)
    Job.objects.create(
        name="x", payload="{}", retry_after=60, available_at=DbNow(), created_at=DbNow(), concurrency_key="k"
    )
    assert FlowLimit.objects.prune(older_than=dt.timedelta(days=1), concurrency_prefix="concurrency:") == 2
    assert set(FlowLimit.objects.values_list("key", flat=True)) == {"rate:new", "concurrency:k"}


@pytest.mark.django_db(transaction=True)
def test_migration_0014_moves_rows_out_of_its_bounds_aside_and_keeps_the_others():
    executor = MigrationExecutor(connection)
    latest = executor.loader.graph.leaf_nodes("django_dbqueue")
    try:
        executor.migrate([("django_dbqueue", "0013_lighter_statements")])
        # Values the older checks admitted (or, on PostgreSQL, no check at all).
        healthy = _reserved(old_schema=True)
        bad = _reserved(retry_after=0, concurrency_limit=0, concurrency_key="k", old_schema=True)
        MigrationExecutor(connection).migrate(latest)
    finally:
        MigrationExecutor(connection).migrate(latest)
    assert list(Job.objects.values_list("pk", flat=True)) == [healthy.pk]
    moved = FailedJob.objects.get(job_id=bad.pk)
    assert moved.exception_class == INVALID_ROW_CLASS and moved.retry_after == 1
    assert "moved aside unrun by migration 0014" in moved.error
    with pytest.raises(REFUSED), transaction.atomic():
        Job.objects.filter(pk=healthy.pk).update(retry_after=0)
