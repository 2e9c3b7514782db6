"""Bulk enqueue (``enqueue_many``): one INSERT per batch, in one transaction."""

from __future__ import annotations

import dataclasses
import datetime as dt
import json
import threading
import time
from typing import Any

import pytest
from django.db import DatabaseError, connection, connections, transaction
from django.db import utils as django_db_utils
from django.test.utils import CaptureQueriesContext

from django_dbqueue import JobDefinition, claims, enqueue_many, payload, signals
from django_dbqueue.models import Job
from tests.conftest import kill_session, listening, session_id
from tests.testapp import jobs

# Every column, to compare a returned row with the stored one.
FIELDS = [field.attname for field in Job._meta.concrete_fields]


def stored(rows: list[Job]) -> list[dict[str, Any]]:
    by_pk = {row["id"]: row for row in Job.objects.filter(pk__in=[job.pk for job in rows]).values(*FIELDS)}
    return [by_pk[job.pk] for job in rows]


def returned(rows: list[Job]) -> list[dict[str, Any]]:
    return [{name: getattr(job, name) for name in FIELDS} for job in rows]


def enqueue_rows(*args: Any, **kwargs: Any) -> list[Job]:
    """``enqueue_many``, returning the rows its handles carry."""
    rows = [handle.job for handle in enqueue_many(*args, **kwargs)]
    assert all(row is not None for row in rows)
    return rows  # type: ignore[return-value]


def inserts(queries: CaptureQueriesContext) -> list[str]:
    return [q["sql"] for q in queries.captured_queries if q["sql"].startswith("INSERT")]


@pytest.mark.django_db
def test_the_returned_rows_are_the_stored_rows_with_ids_and_database_times_in_call_order():
    rows = enqueue_rows(jobs.add.bind(i, i) for i in range(30))
    assert returned(rows) == stored(rows)
    assert [payload.decode(job.payload)["args"] for job in rows] == [[i, i] for i in range(30)]
    assert len({job.pk for job in rows}) == 30
    assert all(job.created_at == job.available_at and job.created_at.tzinfo is not None for job in rows)
    assert all(not job._state.adding and job._state.db == "default" for job in rows)
    assert Job.objects.waiting().count() == 30


@pytest.mark.django_db
@pytest.mark.parametrize("keyed", [False, True], ids=["plain", "keyed"])
def test_a_job_enqueued_alone_is_claimed_before_the_jobs_enqueued_many_after_it(limits, keyed, monkeypatch):
    """``enqueue`` and ``enqueue_many`` read the same clock, the database's: rows sent after a
    job never get an earlier ``available_at``, so the claim keeps the order they were sent in."""
    call, queue, key = (limits.keyed.bind, limits.KEYS_QUEUE, "k") if keyed else (jobs.add.bind, "default", 0)
    if keyed:
        monkeypatch.setattr(claims, "_flow_queues", {queue})  # as a worker that runs limits' jobs
    first = call(key, 0).enqueue()
    later = enqueue_many(call(key, n) for n in range(1, 4))
    ids = [first.id, *(handle.id for handle in later)]
    times = list(Job.objects.filter(pk__in=ids).order_by("id").values_list("available_at", flat=True))
    assert times == sorted(times)
    claimed = claims.reserve_many([queue], limit=4, worker_id="w")
    # A key with one slot admits one job: the first.
    assert [job.pk for job in claimed] == (ids[:1] if keyed else ids)


@pytest.mark.django_db
def test_a_delay_makes_a_job_available_that_many_seconds_after_it_was_created():
    rows = enqueue_rows(
        [
            jobs.add.bind(1, 1),
            jobs.add.using(delay=30).bind(2, 2),
            jobs.add.using(delay=dt.timedelta(minutes=5, milliseconds=250)).bind(3, 3),
        ]
    )
    assert returned(rows) == stored(rows)
    assert [job.available_at - job.created_at for job in rows] == [
        dt.timedelta(0),
        dt.timedelta(seconds=30),
        dt.timedelta(minutes=5, milliseconds=250),
    ]
    assert [job.pk for job in Job.objects.waiting()] == [rows[0].pk]
    assert {job.pk for job in Job.objects.delayed()} == {rows[1].pk, rows[2].pk}


@pytest.mark.django_db
def test_queue_priority_and_options_of_each_call_are_stored():
    fast = jobs.record.using(queue="fast", priority=7, tries=5, retry_after=90, timeout=20, backoff=[1, 2])
    rows = enqueue_rows([fast.bind("a"), jobs.record.bind("b"), jobs.fail_with_backoff.using(priority=-3).bind()])
    assert returned(rows) == stored(rows)
    first, second, third = rows
    assert (first.queue, first.priority, first.max_tries, first.retry_after, first.timeout) == ("fast", 7, 5, 90, 20)
    assert payload.decode(first.payload)["backoff"] == [1, 2]
    assert (second.queue, second.priority, second.max_tries, second.timeout) == ("default", 0, None, None)
    assert second.retry_after == 60 and "backoff" not in payload.decode(second.payload)
    assert (third.priority, third.max_tries, payload.decode(third.payload)["backoff"]) == (-3, 4, [5, 60])
    assert all(job.attempts == 0 and job.reserved_at is None and job.reserved_by == "" for job in rows)


@pytest.mark.django_db
def test_text_that_means_something_to_sql_or_to_array_syntax_is_stored_as_it_is():
    awkward = ['"', "\\", "\\\\\"'", "{a,b}", "NULL", "", " x ", "it's", "a\nb\tc", "é 中文 🎉", "\\u0000"]
    awkward += ["%s", "%(x)s", "$1", "');--"]
    # Queue names are checked at enqueue; job names (text columns like the queue) are not.
    name = "q \"x\", {y} \\ 'z' NULL"
    rows = enqueue_rows(
        [jobs.echo.bind(text, key=text) for text in awkward]
        + [dataclasses.replace(jobs.echo, name=name).using(queue="q.x:y-z_1").bind(*awkward)]
    )
    assert returned(rows) == stored(rows)
    for text, job in zip(awkward, rows, strict=False):
        assert payload.arguments(payload.decode(job.payload)) == ((text,), {"key": text})
    assert rows[-1].name == name and payload.decode(rows[-1].payload)["args"] == awkward
    assert Job.objects.filter(name=name, queue="q.x:y-z_1").count() == 1


@pytest.mark.django_db
def test_more_rows_than_batch_size_take_one_insert_per_batch_and_keep_their_order():
    # 50 rows of 12 columns stay under SQLite's oldest limit of 999 parameters,
    # which Django 5.2's bulk_create splits batches by.
    with CaptureQueriesContext(connection) as queries:
        rows = enqueue_rows((jobs.add.bind(i, 0) for i in range(120)), batch_size=50)
    assert len(inserts(queries)) == 3
    assert Job.objects.count() == 120
    assert [payload.decode(job.payload)["args"][0] for job in rows] == list(range(120))
    assert returned(rows) == stored(rows)


@pytest.mark.django_db(transaction=True)
def test_a_bad_argument_in_a_later_batch_names_its_call_and_undoes_the_batches_sent_before():
    # Streamed: the first batch of 100 is sent before call 151 is read; enqueue_many's own
    # transaction takes it back.
    calls = [jobs.add.bind(i, i) for i in range(150)] + [jobs.add.bind(object(), 1)]
    with CaptureQueriesContext(connection) as queries, pytest.raises(TypeError) as raised:
        enqueue_many(iter(calls), batch_size=100)
    expected = f"call 151 of enqueue_many (index 150): Cannot enqueue {jobs.add.name}: argument 0"
    assert str(raised.value).startswith(expected)
    assert raised.value.position == 150  # type: ignore[attr-defined]
    assert len(inserts(queries)) == 1
    assert Job.objects.count() == 0


@pytest.mark.django_db
def test_no_calls_insert_nothing():
    with CaptureQueriesContext(connection) as queries:
        assert enqueue_many([]) == []
    assert queries.captured_queries == []


def test_batch_size_must_be_positive():
    with pytest.raises(ValueError, match="batch_size"):
        enqueue_many([jobs.add.bind(1, 1)], batch_size=0)


@pytest.mark.django_db
def test_job_enqueued_is_sent_once_per_job_with_its_saved_row():
    received: list[tuple[object, int | None]] = []

    def receiver(sender: object, job: Job, **kwargs: object) -> None:
        received.append((sender, job.pk))

    signals.job_enqueued.connect(receiver)
    try:
        rows = enqueue_rows(jobs.add.bind(i, i) for i in range(5))
    finally:
        signals.job_enqueued.disconnect(receiver)
    assert received == [(JobDefinition, job.pk) for job in rows]


@pytest.mark.django_db(transaction=True)
def test_jobs_enqueued_in_an_open_transaction_are_invisible_to_other_connections_until_commit():
    counts: list[int] = []

    def count_from_another_connection() -> None:
        try:
            counts.append(Job.objects.count())
        finally:
            connections.close_all()

    def count() -> None:
        other = threading.Thread(target=count_from_another_connection)
        other.start()
        other.join(timeout=30)

    with transaction.atomic():
        enqueue_many((jobs.add.bind(i, i) for i in range(30)), batch_size=10)
        count()
    count()
    assert counts == [0, 30]


@pytest.mark.django_db(transaction=True)
def test_a_rolled_back_transaction_takes_every_batch_with_it():
    with pytest.raises(RuntimeError), transaction.atomic():
        enqueue_many((jobs.add.bind(i, i) for i in range(30)), batch_size=10)
        raise RuntimeError("roll back")
    assert Job.objects.count() == 0


def test_envelopes_are_encoded_as_compact_json_that_keeps_non_ascii_text():
    envelopes: list[dict[str, Any]] = [
        {"v": 1, "args": [], "kwargs": {}},
        {"v": 1, "args": [1, 2.5, None, True, 'é\n"', [1, {"a": []}]], "kwargs": {"k": {"x": "中"}}},
        {"v": 1, "args": [1e300, -0.0, 10**30], "kwargs": {}, "backoff": [1, 2], "chain": {"id": "c", "step": 1}},
    ]
    for envelope in envelopes:
        assert payload.dumps(envelope) == json.dumps(envelope, separators=(",", ":"), ensure_ascii=False)
    with pytest.raises(TypeError, match="set"):
        payload.dumps({"v": 1, "args": [{1}], "kwargs": {}})


# -- PostgreSQL: the unnest INSERT ----------------------------------------------

postgres_only = pytest.mark.skipif(connection.vendor != "postgresql", reason="the unnest INSERT is PostgreSQL's")


@postgres_only
@pytest.mark.django_db
def test_on_postgresql_a_batch_is_one_unnest_insert_with_the_database_clock():
    with CaptureQueriesContext(connection) as queries:
        enqueue_many(jobs.add.bind(i, i) for i in range(3))
    (sql,) = inserts(queries)
    assert "unnest(" in sql and "statement_timestamp()" in sql


@postgres_only
@pytest.mark.django_db
def test_on_postgresql_a_thousand_rows_or_more_are_followed_by_analyze_while_the_statistics_count_fewer():
    def analyzed(call: Any) -> list[str]:
        with CaptureQueriesContext(connection) as queries:
            call()
        return [q["sql"] for q in queries.captured_queries if q["sql"].startswith("ANALYZE")]

    with connection.cursor() as cursor:
        # The statistics of an empty table (in the test's transaction, undone after it).
        cursor.execute('DELETE FROM "dbqueue_job"')
        cursor.execute('ANALYZE "dbqueue_job"')
    assert analyzed(lambda: enqueue_many(jobs.add.bind(i, i) for i in range(999))) == []
    assert analyzed(lambda: enqueue_many(jobs.add.bind(i, i) for i in range(1000))) == ['ANALYZE "dbqueue_job"']
    # The statistics now count 1,999 rows: 1,000 more leave them be, as in calls of 1,000 in a loop
    # (an ANALYZE each time cost 70 % of such a loop's time, docs/performance.md); 2,000 more do not.
    assert analyzed(lambda: enqueue_many([jobs.add.bind(i, i) for i in range(1000)])) == []
    assert analyzed(lambda: enqueue_many(jobs.add.bind(i, i) for i in range(2000))) == ['ANALYZE "dbqueue_job"']


@postgres_only
@pytest.mark.django_db(transaction=True)
def test_on_postgresql_one_batch_outside_a_transaction_is_one_statement_and_commits_by_itself():
    sent: list[tuple[str, bool]] = []

    def record(execute: Any, sql: str, params: Any, many: bool, context: Any) -> Any:
        sent.append((sql, connection.in_atomic_block))
        return execute(sql, params, many, context)

    with connection.execute_wrapper(record):
        handles = enqueue_many([jobs.add.bind(i, i) for i in range(10)])
    # No transaction of ours around it (no BEGIN and COMMIT to wait for).
    ((sql, in_transaction),) = sent
    assert "unnest(" in sql and not in_transaction
    # Committed: another connection sees all ten, with the ids the handles hold.
    other = connections.create_connection("default")
    try:
        with other.cursor() as cursor:
            cursor.execute('SELECT id FROM "dbqueue_job" ORDER BY id')
            assert [row[0] for row in cursor.fetchall()] == [h.id for h in handles]
    finally:
        other.close()


@postgres_only
@pytest.mark.django_db(transaction=True)
def test_on_postgresql_one_batch_with_a_value_too_long_is_refused_whole_outside_a_transaction():
    # The one statement in autocommit: the good rows beside the bad one are not stored either.
    calls = [jobs.add.bind(i, i) for i in range(3)] + [dataclasses.replace(jobs.add, name="n" * 201).bind(0, 0)]
    with pytest.raises(DatabaseError, match="too long"):
        enqueue_many(calls)
    assert not connection.in_atomic_block
    assert Job.objects.count() == 0


@postgres_only
@pytest.mark.django_db(transaction=True)
def test_on_postgresql_a_value_too_long_for_its_column_is_refused_and_earlier_batches_are_undone():
    calls = [jobs.add.bind(i, i) for i in range(20)] + [dataclasses.replace(jobs.add, name="n" * 201).bind(0, 0)]
    with pytest.raises(DatabaseError, match="too long"):
        enqueue_many(calls, batch_size=10)
    assert Job.objects.count() == 0


@postgres_only
@pytest.mark.django_db(transaction=True)
def test_on_postgresql_listeners_are_notified_once_the_transaction_commits():
    with listening() as listener:
        with transaction.atomic():
            enqueue_many(
                [jobs.add.bind(1, 1), jobs.add.using(queue="emails").bind(2, 2), jobs.add.using(delay=60).bind(3, 3)]
            )
            enqueue_many([jobs.add.using(queue="later", delay=60).bind(4, 4)])
            assert list(listener.notifies(timeout=0.3)) == []
        notified = sorted(note.payload for note in listener.notifies(timeout=2, stop_after=2))
        assert notified == ["default", "emails"]
        assert list(listener.notifies(timeout=0.3)) == []


def _kill_session(pid: int, after: float) -> threading.Thread:
    """End session ``pid`` from another connection after ``after`` seconds, as a restarted server would."""

    def kill() -> None:
        time.sleep(after)
        kill_session(pid)

    thread = threading.Thread(target=kill)
    thread.start()
    return thread


@pytest.mark.skipif("connection.vendor == 'sqlite'", reason="SQLite has no server session to lose")
@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("after", [0, 0.05, 0.2])
def test_a_killed_connection_during_a_bulk_enqueue_raises_the_connection_error_and_inserts_nothing(caplog, after):
    killer = _kill_session(session_id(), after)
    if after == 0:
        killer.join()
    try:
        with pytest.raises(DatabaseError) as raised:
            enqueue_many(jobs.add.bind(i, i) for i in range(30_000))
    finally:
        killer.join()
    # The cause, not psycopg's "cannot exit pipeline mode while busy", and no
    # "error ignored terminating" pipeline warning beside it.
    assert isinstance(raised.value, (django_db_utils.OperationalError, django_db_utils.InterfaceError)), raised.value
    assert "pipeline" not in str(raised.value).lower(), raised.value
    assert "error ignored" not in caplog.text
    connection.close()
    assert not Job.objects.exists()


def test_the_columns_an_insert_writes_are_the_models_and_a_new_row_starts_at_its_fields_defaults():
    from django_dbqueue import rows

    model = {field.attname for field in Job._meta.concrete_fields if not field.primary_key}
    assert set(rows.COLUMNS) == model and len(rows.COLUMNS) == len(model)
    fresh = Job()
    assert {name: getattr(fresh, name) for name in rows.START} == rows.START
    started = {"attempts", "given_back", "cancel", "exceptions", "reserved_at", "reserved_by", "blocked", "node_id"}
    assert set(rows.START) == started
