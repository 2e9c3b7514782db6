"""Streaming enqueue (issue 18): ``enqueue_many`` over any iterable, batch by batch.

A million jobs from a generator in bounded memory (heavy: with Django 6.1, on PostgreSQL,
whose rows go through the unnest INSERT in pipeline mode, and on SQLite, whose rows go through the executemany insert
that MariaDB's take too); an error in the middle with and without the caller's transaction; the
insert that returns no rows (``handles=False``: the unnest INSERT on PostgreSQL, executemany
elsewhere) storing every option exactly as the insert that returns them.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from django.core.exceptions import ValidationError
from django.db import DEFAULT_DB_ALIAS, DataError, IntegrityError, connection, connections, transaction
from django.db.migrations.executor import MigrationExecutor
from django.test.utils import CaptureQueriesContext

from django_dbqueue import JobCall, claims, enqueue_many, rows, signals
from django_dbqueue.models import Job
from tests.conftest import insert_at_this_schema, listening
from tests.testapp import jobs, limit_jobs

ROOT = Path(__file__).resolve().parent.parent
MILLION = 1_000_000
# The growth of the streaming process's peak resident memory allowed for a million
# jobs (docs/enqueue.md states it); holding a quarter of the calls in a list takes more.
STREAM_BOUND_MB = 40

heavy = pytest.mark.skipif(
    not os.environ.get("DBQUEUE_TEST_HEAVY"),
    reason="a million rows: runs once per database, with Django 6.1 (scripts/test sets DBQUEUE_TEST_HEAVY)",
)
# MariaDB streams through the same code as SQLite (the executemany insert of handles=False), whose
# million rows cover it; the rows it stores are checked there by the smaller tests below.
not_on_mariadb = pytest.mark.skipif(
    os.environ.get("DBQUEUE_TEST_DB", "sqlite") == "mysql",
    reason="the million goes through the executemany insert that SQLite's run covers",
)

# Run in a process of its own, so its peak memory is the stream's and nothing else's.
CHILD = r"""
import json, re, sys, time
import django
django.setup()
from django.db import transaction
from django_dbqueue import enqueue_many
from tests.testapp import jobs, limit_jobs

def status(field):
    return int(re.search(field + r":\s+(\d+) kB", open("/proc/self/status").read())[1]) / 1024

def reset_peak():
    # Linux: the peak resident memory (VmHWM) starts again from the current one.
    with open("/proc/self/clear_refs", "w") as out:
        out.write("5")

# Connect and fill the driver's buffers with one batch, undone, before measuring.
with transaction.atomic():
    enqueue_many((jobs.add.bind(0, 0) for _ in range(1000)), handles=False)
    transaction.set_rollback(True)
count = int(sys.argv[1])
reset_peak()
before = status("VmRSS")
started = time.perf_counter()
stored = enqueue_many((jobs.add.bind(i, -i) for i in range(count)), handles=False)
seconds = time.perf_counter() - started
peak = status("VmHWM")
# The instrument sees memory: a quarter of the calls held in a list.
reset_peak()
held_before = status("VmRSS")
held = [jobs.add.bind(i, -i) for i in range(count // 4)]
print(json.dumps({"stored": stored, "seconds": seconds, "before_mb": before, "peak_mb": peak,
                  "held_mb": status("VmHWM") - held_before}))
"""


@heavy
@not_on_mariadb
@pytest.mark.one_django
@pytest.mark.django_db(transaction=True)
def test_a_million_jobs_streamed_from_a_generator_are_all_stored_in_order_in_bounded_memory():
    environment = {**os.environ, "DJANGO_SETTINGS_MODULE": "tests.settings", "DBQUEUE_TEST_USE_TEST_DB": "1"}
    done = subprocess.run(
        [sys.executable, "-c", CHILD, str(MILLION)],
        cwd=ROOT,
        env={**environment, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    growth = report["peak_mb"] - report["before_mb"]
    print(
        f"\n{connection.vendor}: {MILLION:,} jobs streamed in {report['seconds']:.1f} s "
        f"({MILLION / report['seconds']:,.0f} jobs/s), peak memory +{growth:.1f} MB "
        f"(a list of {MILLION // 4:,} calls: +{report['held_mb']:.0f} MB)"
    )
    assert report["stored"] == MILLION
    assert growth < STREAM_BOUND_MB
    # A quarter of the calls held in a list grows the same measure past the bound.
    assert report["held_mb"] > STREAM_BOUND_MB, report
    # Every row, in id order, is the call of its position: none lost, none doubled, none moved.
    expected = (f'{{"v":1,"args":[{i},{-i}],"kwargs":{{}}}}' for i in range(MILLION))
    rows = Job.objects.order_by("id").values_list("payload", "name", "queue", "attempts", "reserved_at")
    count = 0
    for (text, name, queue, attempts, reserved_at), want in zip(
        rows.iterator(chunk_size=20_000), expected, strict=False
    ):
        if (text, name, queue, attempts, reserved_at) != (want, jobs.add.name, "default", 0, None):
            pytest.fail(f"row {count}: {(text, name, queue, attempts, reserved_at)!r}, expected the payload {want}")
        count += 1
    assert count == MILLION == Job.objects.count()


def calls(count: int, bad_at: int | None = None) -> Iterator[JobCall]:
    for i in range(count):
        yield jobs.add.bind(object() if i == bad_at else i, i)


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("handles", [True, False])
def test_an_error_at_call_6001_of_a_stream_names_it_and_stores_nothing_without_a_transaction(handles):
    with pytest.raises(TypeError) as raised:
        enqueue_many(calls(10_000, bad_at=6000), handles=handles)
    assert str(raised.value).startswith(f"call 6,001 of enqueue_many (index 6000): Cannot enqueue {jobs.add.name}")
    assert raised.value.position == 6000  # type: ignore[attr-defined]
    assert Job.objects.count() == 0


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("handles", [True, False])
def test_inside_the_callers_transaction_the_batches_sent_before_the_error_are_its_to_keep(handles):
    # Batches of 1,000: six were sent before call 6,001 was read; the caller keeps them.
    with transaction.atomic():
        with pytest.raises(TypeError, match="call 6,001 of enqueue_many"):
            enqueue_many(calls(10_000, bad_at=6000), handles=handles)
        assert Job.objects.count() == 6000
    assert [args for (args,) in Job.objects.order_by("id").values_list("payload")][-1].startswith(
        '{"v":1,"args":[5999,'
    )
    assert Job.objects.count() == 6000
    # Or lets the error out of its block: nothing stays.
    Job.objects.all().delete()
    with pytest.raises(TypeError), transaction.atomic():
        enqueue_many(calls(10_000, bad_at=6000), handles=handles)
    assert Job.objects.count() == 0


DEADLINE = dt.datetime(2030, 1, 2, 3, 4, 5, tzinfo=dt.UTC)
# Limited copies of a test job (not registered: their queue would show in the system checks of other tests).
keyed = dataclasses.replace(jobs.add, concurrency_key=lambda a, b: f"customer-{a}", concurrency_limit=1)
rated = dataclasses.replace(jobs.add, rate_limit="20/s")


def every_option() -> list[JobCall]:
    """Calls that use every option a bulk insert stores, each differently."""
    awkward = ["\\", "a\tb\nc\r", '"{x,y}"', "NULL", "\\N", "é 中文 🎉", "it's", "%s"]
    return [
        jobs.add.bind(1, 2),
        jobs.record.using(queue="fast", priority=7, tries=5, retry_after=90, timeout=20, backoff=[1, 2]).bind("a"),
        jobs.record.using(delay=30).bind("delayed"),
        jobs.record.using(delay=dt.timedelta(minutes=5, milliseconds=250), priority=-3).bind("later"),
        jobs.record.using(retry_until=DEADLINE, max_exceptions=2).bind("deadline"),
        jobs.fail_with_backoff.bind(),
        jobs.record.bind("first").then(jobs.record.bind("then")).on_failure(jobs.record.bind("failed")),
        keyed.bind(1, 1),
        rated.bind(3, 3),
        *(jobs.echo.bind(text, key=text) for text in awkward),
        jobs.record.using(unique=True).bind("unique"),
        jobs.record.using(unique=True).bind("unique"),  # held by the one before: not stored
    ]


COMPARED = [
    field.attname for field in Job._meta.concrete_fields if field.attname not in ("id", "available_at", "created_at")
]


def stored_rows() -> list[dict[str, Any]]:
    rows = list(Job.objects.order_by("id").values(*COMPARED, "available_at", "created_at"))
    for row in rows:
        row["delay"] = row.pop("available_at") - row.pop("created_at")
    return rows


@pytest.mark.django_db(transaction=True)
def test_rows_stored_without_handles_are_the_rows_stored_with_them_option_by_option():
    handles = enqueue_many(iter(every_option()))
    with_handles = stored_rows()
    assert [handle.enqueued for handle in handles] == [True] * (len(handles) - 1) + [False]
    assert [handle.id for handle in handles[:-1]] == list(Job.objects.order_by("id").values_list("id", flat=True))
    Job.objects.all().delete()

    assert enqueue_many(iter(every_option()), handles=False) == len(every_option()) - 1
    without = stored_rows()
    assert without == with_handles
    # And what they hold, row by row.
    plain, fast, delayed, later, deadline, backoff, chained, keyed, rated, *rest = without
    assert (fast["queue"], fast["priority"], fast["max_tries"], fast["retry_after"], fast["timeout"]) == (
        "fast",
        7,
        5,
        90,
        20,
    )
    assert json.loads(fast["payload"])["backoff"] == [1, 2] and json.loads(backoff["payload"])["backoff"] == [5, 60]
    assert (plain["delay"], delayed["delay"]) == (dt.timedelta(0), dt.timedelta(seconds=30))
    assert (later["delay"], later["priority"]) == (dt.timedelta(minutes=5, milliseconds=250), -3)
    envelope = json.loads(deadline["payload"])
    assert envelope["max_exceptions"] == 2 and dt.datetime.fromisoformat(envelope["retry_until"]) == DEADLINE
    envelope = json.loads(chained["payload"])
    assert [step["args"] for step in envelope["then"]] == [["then"]] and envelope["on_failure"]["args"] == ["failed"]
    assert (keyed["concurrency_key"], keyed["concurrency_limit"]) == ("customer-1", 1)
    assert rated["rate_limit"].startswith("20/") and rated["rate_key"] == jobs.add.name  # count/seconds/burst
    *texts, unique = rest
    assert [json.loads(row["payload"])["args"][0] for row in texts] == [
        "\\",
        "a\tb\nc\r",
        '"{x,y}"',
        "NULL",
        "\\N",
        "é 中文 🎉",
        "it's",
        "%s",
    ]
    assert unique["unique_key"] and all(row["attempts"] == 0 and row["reserved_by"] == "" for row in without)


@pytest.mark.django_db(transaction=True)
def test_rows_enqueued_one_at_a_time_are_the_rows_enqueued_in_bulk_option_by_option():
    enqueue_many(every_option())
    in_bulk = stored_rows()
    Job.objects.all().delete()

    with CaptureQueriesContext(connection) as queries:
        handles = [call.enqueue() for call in every_option()]
    assert stored_rows() == in_bulk
    assert [handle.enqueued for handle in handles] == [True] * (len(handles) - 1) + [False]
    # Each handle carries its row's id and the times the database gave it.
    rows = {row.pk: row for row in Job.objects.all()}
    for handle in handles[:-1]:
        row = rows[handle.id]
        assert (handle.job.available_at, handle.job.created_at) == (row.available_at, row.created_at)
    if connection.vendor == "postgresql":
        # One statement each, through the function whose INSERT the server keeps planned
        # (migration 0011); with flow control or without, eight values or fifteen.
        sent = [query["sql"] for query in queries.captured_queries]
        # The two unique ones insert with ON CONFLICT (unique.py).
        assert sum("dbqueue_enqueue(" in sql for sql in sent) == len(every_option()) - 2
        assert sum(sql.startswith("INSERT") for sql in sent) == 2


@pytest.mark.django_db(transaction=True)
def test_a_single_enqueue_keeps_its_driver_cursor_across_calls_and_a_new_one_after_a_reconnect():
    wrapper = connections[DEFAULT_DB_ALIAS]
    seen: list[str] = []

    def watch(execute, sql, params, many, context):
        seen.append(sql)
        return execute(sql, params, many, context)

    with wrapper.execute_wrapper(watch):
        first = jobs.add.enqueue(1, 1)
        kept = wrapper.__dict__.get("_dbqueue_kept_cursor")
        second = jobs.add.enqueue(2, 2)
        assert wrapper.__dict__.get("_dbqueue_kept_cursor") is kept
        wrapper.close()  # as at the end of a request with CONN_MAX_AGE=0
        third = jobs.add.enqueue(3, 3)
    # Django's wrapper is made for each call: execute_wrapper hooks see every enqueue.
    assert len([sql for sql in seen if sql.startswith("INSERT") or "dbqueue_enqueue(" in sql]) == 3
    if wrapper.vendor == "postgresql":  # elsewhere a single enqueue is Model.save()
        assert kept is not None and wrapper.__dict__["_dbqueue_kept_cursor"] is not kept
    stored = dict(Job.objects.values_list("id", "payload"))
    assert [json.loads(stored[handle.id])["args"] for handle in (first, second, third)] == [[1, 1], [2, 2], [3, 3]]


@pytest.mark.django_db
def test_a_new_job_writes_no_entry_in_the_index_of_reserved_rows():
    # Migration 0012: partial where the database has partial indexes; on PostgreSQL the
    # claim reads the partial index of waiting rows, and the full claim index is gone.
    if connection.vendor == "postgresql":
        with connection.cursor() as cursor:
            cursor.execute("SELECT indexname, indexdef FROM pg_indexes WHERE tablename = 'dbqueue_job'")
            indexes = dict(cursor.fetchall())
    elif connection.vendor == "sqlite":
        with connection.cursor() as cursor:
            cursor.execute("SELECT name, sql FROM sqlite_master WHERE type = 'index' AND tbl_name = 'dbqueue_job'")
            indexes = {name: sql or "" for name, sql in cursor.fetchall()}
    else:
        # MariaDB and MySQL have no partial indexes: both stay, full.
        with connection.cursor() as cursor:
            cursor.execute(
                "SELECT DISTINCT index_name FROM information_schema.statistics "
                "WHERE table_schema = DATABASE() AND table_name = 'dbqueue_job'"
            )
            names = {name for (name,) in cursor.fetchall()}
        assert {"dbqueue_job_claim", "dbqueue_job_reserved"} <= names
        return
    assert "WHERE reserved_at IS NOT NULL" in indexes["dbqueue_job_reserved"].replace("(", "").replace(")", "")
    assert ("dbqueue_job_claim" in indexes) == (connection.vendor == "sqlite")


@pytest.mark.django_db
def test_the_bounds_of_a_job_row_are_its_validators_and_one_check_constraint_on_every_database():
    # Migration 0013 dropped PostgreSQL's nine checks (each compiled again in every
    # statement that writes a row); migration 0014 brought the bounds back as one
    # CHECK, dbqueue_job_bounds, on every database (MariaDB and MySQL keep their
    # older column checks and unsigned columns, whose refusal is a DataError). The
    # enqueue function keeps no parameter defaults.
    row = Job(name="x", payload="{}", priority=101, attempts=-1, retry_after=-1, created_at=dt.datetime.now(dt.UTC))
    row.available_at = row.created_at
    with pytest.raises(ValidationError) as refused:
        row.full_clean()
    assert set(refused.value.error_dict) == {"priority", "attempts", "retry_after"}
    if connection.vendor == "postgresql":
        assert _checks_and_functions() == (1, [(8, 0), (15, 0)])
    row.priority, row.retry_after = 0, 60
    with pytest.raises((IntegrityError, DataError)), transaction.atomic():
        row.save()
    row.attempts, row.priority = 0, 101
    with pytest.raises((IntegrityError, DataError)), transaction.atomic():
        row.save()
    assert not Job.objects.exists()


@pytest.mark.django_db(transaction=True)
def test_migration_0013_goes_back_to_the_checks_and_the_function_with_defaults_and_forward_again():
    executor = MigrationExecutor(connection)
    latest = executor.loader.graph.leaf_nodes("django_dbqueue")
    try:
        executor.migrate([("django_dbqueue", "0012_enqueue_indexes")])
        if connection.vendor == "postgresql":
            assert _checks_and_functions() == (9, [(15, 7)])
            jobs.add.enqueue(1, 2)  # through the function of that schema
        else:
            now = dt.datetime.now(dt.UTC)
            old = rows.prepare(jobs.add.bind(1, 2))[0].to_job()
            old.available_at = old.created_at = now
            insert_at_this_schema(old)
        executor = MigrationExecutor(connection)
        executor.migrate(latest)
    finally:
        MigrationExecutor(connection).migrate(latest)
    if connection.vendor == "postgresql":
        assert _checks_and_functions() == (1, [(8, 0), (15, 0)])
    # A row stored before stays; both functions store rows (a plain job; one with a
    # concurrency key, whose claim is counted per key).
    jobs.add.enqueue(3, 4)
    limit_jobs.keyed.enqueue("k", 1)
    assert list(Job.objects.order_by("id").values_list("concurrency_key", flat=True)) == [None, None, "k"]


def _checks_and_functions() -> tuple[int, list[tuple[int, int]]]:
    """The job table's CHECK constraints, and each dbqueue_enqueue's (parameters, defaults)."""
    with connection.cursor() as cursor:
        cursor.execute("SELECT count(*) FROM pg_constraint WHERE conrelid = 'dbqueue_job'::regclass AND contype = 'c'")
        (checks,) = cursor.fetchone()
        cursor.execute("SELECT pronargs, pronargdefaults FROM pg_proc WHERE proname = 'dbqueue_enqueue'")
        return checks, sorted(cursor.fetchall())


@pytest.mark.django_db(transaction=True)
def test_without_handles_job_enqueued_receivers_still_get_every_row():
    received: list[Job] = []

    def receive(sender: Any, job: Job, **kwargs: Any) -> None:
        received.append(job)

    signals.job_enqueued.connect(receive)
    try:
        assert enqueue_many((jobs.add.bind(i, i) for i in range(2500)), handles=False) == 2500
    finally:
        signals.job_enqueued.disconnect(receive)
    assert sorted(job.pk for job in received) == list(Job.objects.order_by("id").values_list("id", flat=True))


@pytest.mark.skipif("connection.vendor != 'postgresql'", reason="the pipeline and NOTIFY are PostgreSQL's")
@pytest.mark.django_db(transaction=True)
def test_on_postgresql_rows_without_handles_go_through_the_unnest_insert_and_notify_once_per_queue_at_commit():
    from django.test.utils import CaptureQueriesContext

    with listening() as listener:
        with CaptureQueriesContext(connection) as queries, transaction.atomic():
            stream = (jobs.add.using(queue="emails" if i % 2 else "default").bind(i, i) for i in range(3000))
            assert enqueue_many(stream, handles=False) == 3000
            assert list(listener.notifies(timeout=0.3)) == []
        notified = sorted(note.payload for note in listener.notifies(timeout=2, stop_after=2))
        assert notified == ["default", "emails"]
        assert list(listener.notifies(timeout=0.3)) == []
    # Three batches, each one unnest INSERT (sent one batch ahead in pipeline mode); no COPY.
    inserts = [q["sql"] for q in queries.captured_queries if q["sql"].startswith("INSERT")]
    assert len(inserts) == 3 and all("unnest" in sql for sql in inserts)
    assert Job.objects.count() == 3000


@pytest.mark.django_db
@pytest.mark.parametrize("settings_dict", [None, {"QUEUE": "elsewhere", "RETRY_AFTER": 77}])
def test_a_batch_prepares_each_call_as_a_single_enqueue_does(settings_dict, settings):
    from django_dbqueue import enqueue, rows

    if settings_dict:
        settings.DBQUEUE = settings_dict
    calls = [
        *every_option(),
        jobs.add.using(tries=1, timeout=1, priority=100, delay=0.25).bind(-1, 1.5),
        jobs.fail_with_backoff.using(backoff=7, max_exceptions=1).bind(),
        jobs.echo.bind(dt.date(2026, 12, 1), when=dt.timedelta(seconds=3), ok=None),
        jobs.add.bind(3, 4),
    ]
    # Most of these take the shortcut; the unique, limited, deadline and chained ones do not.
    assert rows.Plain.of(jobs.add) is not None and rows.Plain.of(jobs.fail_with_backoff) is not None
    assert rows.Plain.of(jobs.record.using(unique=True)) is None and rows.Plain.of(keyed) is None
    batch = enqueue.prepare_all(calls, 0)
    one_by_one = [rows.prepare(call) for call in calls]
    assert [new for new, _ in batch] == [new for new, _ in one_by_one]
    assert [window for _, window in batch] == [window for _, window in one_by_one]


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("handles", [True, False])
def test_a_job_enqueued_in_bulk_can_be_claimed_at_once(handles):
    for i in range(20):
        enqueue_many([jobs.add.bind(i, 0), jobs.add.bind(i, 1)], handles=handles)
        claimed = claims.reserve(["default"])
        assert claimed is not None, f"round {i}: the job just enqueued is not available"
        Job.objects.all().delete()
    if connection.vendor == "sqlite":
        # SQLite compares times as text, and its clock has milliseconds ("...:05.123"): a time
        # written with microseconds ("...:05.123000") sorts after the clock's reading of that very
        # instant, and the job would wait for the next millisecond (a CI run caught it).
        enqueue_many([jobs.add.bind(i, 0) for i in range(50)], handles=handles)
        with connection.cursor() as cursor:
            cursor.execute(
                "SELECT COUNT(*) FROM dbqueue_job WHERE available_at > STRFTIME('%Y-%m-%d %H:%M:%f', available_at) "
                "OR created_at > STRFTIME('%Y-%m-%d %H:%M:%f', created_at)"
            )
            assert cursor.fetchone() == (0,)
