"""The history of finished jobs (``DBQUEUE["KEEP_FINISHED"]``, finished.py): one row per job that
ended, written with the change that ended it; PostgreSQL's day partitions and retention."""

from __future__ import annotations

import signal
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta

import pytest
from django.db import connection
from django.test import override_settings
from django.test.utils import CaptureQueriesContext

from django_dbqueue import enqueue_many, finished, lifecycle, operations
from django_dbqueue.models import FailedJob, FinishedJob, Job
from tests.conftest import run_worker, wait_until
from tests.testapp import jobs
from tests.testapp.models import Attempt, Run

# WORKER_BEAT: the in-process workers' rows are not refreshed during a long drain (a beat in flight
# when the worker stops could outlive its test's database access on a loaded SQLite).
KEEP = {"DBQUEUE": {"KEEP_FINISHED": 24, "SLEEP": 0.05, "RETRY_AFTER": 60, "TIMEOUT": 30, "WORKER_BEAT": 3600}}
needs_postgresql = pytest.mark.skipif("connection.vendor != 'postgresql'", reason="the day partitions are PostgreSQL's")


@pytest.fixture
def keep() -> Iterator[None]:
    with override_settings(**KEEP):
        yield


@pytest.mark.django_db
def test_without_the_setting_nothing_is_kept():
    jobs.add.enqueue(1, 2)
    worker, _ = run_worker()
    assert worker.processed == 1 and not Job.objects.exists()
    assert not FinishedJob.objects.exists()


@pytest.mark.django_db
def test_each_outcome_leaves_one_row_with_what_an_operator_asks(keep):
    succeeded = jobs.add.enqueue(1, 2)
    failed = jobs.always_fail.using(tries=1).enqueue("f1")
    cancelled = jobs.record.enqueue("never")
    assert lifecycle.cancel(cancelled.id, reason="not needed") == "cancelled"
    worker, _ = run_worker()
    rows = {row.job_id: row for row in FinishedJob.objects.all()}
    assert set(rows) == {succeeded.id, failed.id, cancelled.id}
    ok, bad, stopped = rows[succeeded.id], rows[failed.id], rows[cancelled.id]
    assert (ok.outcome, ok.name, ok.queue, ok.attempts, ok.worker) == (
        "succeeded", "tests.add", "default", 1, worker.worker_id,
    )  # fmt: skip
    assert ok.payload["args"] == [1, 2] and ok.duration is not None and ok.duration >= 0
    assert ok.started_at is not None and ok.created_at <= ok.started_at <= ok.finished_at
    assert ok.error == "" and ok.exception_class == ""
    assert bad.outcome == "failed" and bad.exception_class == "builtins.ValueError"
    assert "f1 always fails" in bad.error and bad.error_summary == "ValueError: f1 always fails"
    assert stopped.outcome == "cancelled" and "not needed" in stopped.error and stopped.duration is None
    assert stopped.started_at is None and stopped.attempts == 0
    # The failed job is still in FailedJob (retry from there); its history row stays after a retry.
    assert FailedJob.objects.filter(job_id=failed.id).exists()


@pytest.mark.django_db
def test_a_drain_of_ten_thousand_leaves_exactly_one_row_per_job_with_its_outcome(keep):
    n = 10_000
    handles = enqueue_many(
        jobs.always_fail.using(tries=1).bind(f"f{i}") if i % 10 == 0 else jobs.add.bind(i, 1) for i in range(n)
    )
    worker, _ = run_worker(batch=20)
    assert worker.processed == n and not Job.objects.exists()
    expected = {handle.id: "failed" if i % 10 == 0 else "succeeded" for i, handle in enumerate(handles)}
    kept = dict(FinishedJob.objects.values_list("job_id", "outcome"))
    assert FinishedJob.objects.count() == n
    assert kept == expected
    assert set(FailedJob.objects.values_list("job_id", flat=True)) == {
        pk for pk, o in expected.items() if o == "failed"
    }


@pytest.mark.django_db(transaction=True)
def test_a_run_killed_and_reclaimed_leaves_one_row_for_the_run_that_finished(worker_process):
    env = {"DBQUEUE_TEST_KEEP_FINISHED": "24"}
    handle = jobs.long_running.using(retry_after=2).enqueue("killed", 60, again=0.1)
    first = worker_process("--sleep", "0.05", env=env)
    wait_until(lambda: Attempt.objects.filter(key="killed").exists(), 30, "the job never started")
    first.signal(signal.SIGKILL)
    first.wait(timeout=10)
    assert not FinishedJob.objects.exists()
    second = worker_process("--sleep", "0.05", env=env)
    wait_until(lambda: Run.objects.filter(key="killed").exists(), 30, f"never reclaimed:\n{second.output()}")
    wait_until(lambda: not Job.objects.exists(), 10, "the job row was not deleted")
    second.signal(signal.SIGTERM)
    assert second.wait(timeout=30) == 0
    row = FinishedJob.objects.get()
    assert (row.job_id, row.outcome, row.attempts) == (handle.id, "succeeded", 2)
    assert row.worker.split(":")[1] == str(second.pid) and row.duration is not None and row.duration < 30


@pytest.mark.django_db
def test_search_by_name_queue_outcome_time_and_arguments(keep):
    jobs.add.enqueue(1, 2)
    jobs.add.enqueue(40, 2)
    jobs.record.enqueue("eu", note="42")
    jobs.record.enqueue("us", note="7")
    run_worker()
    assert finished.search(name="tests.add").count() == 2
    assert finished.search(outcome="failed").count() == 0
    assert finished.search(queue="default").count() == 4
    assert [row.payload["args"] for row in finished.search(arguments="40")] == [[40, 2]]
    assert [row.payload["args"] for row in finished.search(arguments="[2, 1]")] == [[1, 2]]
    assert [row.payload["args"] for row in finished.search(arguments='{"note": "42"}')] == [["eu"]]
    assert [row.payload["args"] for row in finished.search(arguments='["us"]')] == [["us"]]
    assert finished.search(arguments='{"note": "43"}').count() == 0
    now = FinishedJob.objects.latest("finished_at").finished_at
    assert finished.search(since=now + timedelta(seconds=1)).count() == 0
    assert finished.search(until=now + timedelta(seconds=1)).count() == 4
    with pytest.raises(ValueError, match="arguments must be JSON"):
        finished.search(arguments="order_id=42")


@pytest.mark.django_db
def test_a_finished_run_is_enqueued_again_with_the_same_arguments(keep):
    jobs.add.enqueue(20, 22)
    run_worker()
    row = FinishedJob.objects.get()
    again = operations.enqueue_again([row.pk])
    assert len(again) == 1
    job = Job.objects.get()
    assert job.pk != row.job_id and job.name == "tests.add"
    run_worker()
    assert list(FinishedJob.objects.order_by("id").values_list("job_id", flat=True)) == [row.job_id, job.pk]


@pytest.mark.django_db
def test_prune_deletes_what_is_older_than_the_setting(keep):
    jobs.add.enqueue(1, 2)
    jobs.add.enqueue(3, 4)
    run_worker()
    old, new = FinishedJob.objects.order_by("id")
    if connection.vendor == "postgresql":
        # A day's rows go whole with their partition; move one row three days back.
        finished.add_partitions()
    FinishedJob.objects.filter(pk=old.pk).update(finished_at=old.finished_at - timedelta(days=3))
    finished.prune(24)
    assert list(FinishedJob.objects.values_list("pk", flat=True)) == [new.pk]


@needs_postgresql
@pytest.mark.django_db
def test_retention_drops_the_day_partitions_older_than_the_setting(keep):
    today = datetime.now(UTC).date()
    made = finished.add_partitions(days=finished.DAYS_AHEAD)
    assert set(finished.partitions()) >= {today + timedelta(days=d) for d in range(finished.DAYS_AHEAD)}
    assert finished.add_partitions() == [] and made is not None
    # Five days ago: no partition, so the row lands in the default one; its partition made after
    # takes it over.
    jobs.add.enqueue(1, 2)
    run_worker()
    row = FinishedJob.objects.get()
    five_days_ago = row.finished_at - timedelta(days=5)
    FinishedJob.objects.filter(pk=row.pk).update(finished_at=five_days_ago)
    with connection.cursor() as cursor:
        cursor.execute(f"SELECT count(*) FROM {finished.DEFAULT_PARTITION}")
        assert cursor.fetchone()[0] == 1
    finished.add_partition(five_days_ago.astimezone(UTC).date())
    with connection.cursor() as cursor:
        cursor.execute(f"SELECT count(*) FROM {finished.DEFAULT_PARTITION}")
        assert cursor.fetchone()[0] == 0
        cursor.execute(f"SELECT count(*) FROM {finished.TABLE}_p{five_days_ago.astimezone(UTC):%Y%m%d}")
        assert cursor.fetchone()[0] == 1
    # Retention: that day is older than 24 hours, whole: its partition is dropped, today's kept.
    assert finished.prune(24) == 0
    days = set(finished.partitions())
    assert five_days_ago.astimezone(UTC).date() not in days and today in days
    assert not FinishedJob.objects.exists()


@needs_postgresql
@pytest.mark.django_db
def test_an_insert_never_fails_for_want_of_a_partition(keep):
    with connection.cursor() as cursor:
        for name in finished.partitions().values():
            cursor.execute(f"DROP TABLE {name}")
    handle = jobs.add.enqueue(1, 2)
    assert lifecycle.cancel(handle.id) == "cancelled"
    assert FinishedJob.objects.get().outcome == "cancelled"
    with connection.cursor() as cursor:
        cursor.execute(f"SELECT count(*) FROM {finished.DEFAULT_PARTITION}")
        assert cursor.fetchone()[0] == 1


@pytest.mark.django_db
def test_arguments_the_database_cannot_store_as_json_keep_the_row_unsearchable(keep):
    # PostgreSQL's jsonb refuses the NUL character, which JSON writes as \u0000 (and a job may take).
    nul = jobs.echo.enqueue("a\x00b")
    worker, _ = run_worker()
    assert worker.processed == 1 and not Job.objects.exists()
    row = FinishedJob.objects.get()
    assert (row.job_id, row.outcome, row.payload) == (nul.id, "succeeded", None)


@needs_postgresql
@pytest.mark.django_db
def test_on_postgresql_the_claim_that_deletes_the_jobs_writes_their_rows(keep):
    enqueue_many(jobs.add.bind(i, 1) for i in range(25))
    with CaptureQueriesContext(connection) as queries:
        worker, _ = run_worker(batch=10, batch_window=60)
    assert worker.processed == 25 and FinishedJob.objects.count() == 25
    sql = [query["sql"] for query in queries.captured_queries]
    # No INSERT of its own, no DELETE of its own: each claim after the first deletes the batch
    # before it and writes its history rows (the last batch goes with the claim that finds none).
    assert not [s for s in sql if s.startswith(("INSERT", "DELETE")) and "dbqueue_job" in s.split("(")[0]]
    assert not [s for s in sql if s.startswith("INSERT") and "dbqueue_finished_job" in s.split("(")[0]]
    assert len([s for s in sql if s.startswith("WITH done AS (DELETE") and "kept AS (INSERT" in s]) >= 3
    row = FinishedJob.objects.get(payload__args=[24, 1])
    assert row.outcome == "succeeded" and row.duration is not None and row.worker == worker.worker_id
