"""The queue's depth for autoscalers (``scaling``): the jobs a worker could claim now, and the work
in flight, counted over rows in every state; on PostgreSQL by the SQL that KEDA runs, sent as KEDA
sends it (the page's own queries, through the driver's cursor, no parameters)."""

from __future__ import annotations

import re
from datetime import timedelta

import pytest
from django.db import connection, transaction
from django.db.models.functions import Now

from django_dbqueue import claims, pauses, scaling, workflow
from django_dbqueue.models import FailedJob, Job
from django_dbqueue.scaling import IN_FLIGHT_SQL, WAITING_SQL, in_flight_count, scaler_query, waiting_count
from tests.conftest import run_worker
from tests.test_docs_pages import keda_triggers
from tests.testapp import jobs

pytestmark = [pytest.mark.django_db, pytest.mark.one_django]

needs_postgresql = pytest.mark.skipif(
    "connection.vendor != 'postgresql'", reason="the scaler's SQL is PostgreSQL's; elsewhere the ORM counts"
)

# The fixture's rows: what each listed queue holds (``elsewhere`` is never listed).
DEFAULT_WAITING, DEFAULT_RESERVED = 3, 2  # one of the reservations expired
EMAILS_WAITING = 2
REPORTS_WAITING, REPORTS_RESERVED = 4, 1  # reports is paused
LISTED = ["default", "emails", "reports"]
WAITING = DEFAULT_WAITING + EMAILS_WAITING
IN_FLIGHT = WAITING + DEFAULT_RESERVED + REPORTS_RESERVED


@pytest.fixture
def rows() -> None:
    """Jobs in every state: waiting, delayed, blocked, reserved (one expired), failed, in a paused
    queue and in a queue not listed."""
    jobs.always_fail.using(tries=1).enqueue("dead letter")
    run_worker(["default"])
    assert FailedJob.objects.filter(queue="default").count() == 1
    for key in range(DEFAULT_WAITING + DEFAULT_RESERVED):
        jobs.record.enqueue(f"default-{key}")
    held = claims.reserve_many(["default"], limit=DEFAULT_RESERVED, worker_id="test:1:held")
    assert len(held) == DEFAULT_RESERVED
    Job.objects.filter(pk=held[0].pk).update(reserved_at=Now() - timedelta(hours=1))
    assert len(Job.objects.expired()) == 1
    jobs.record.using(delay=3600).enqueue("later")
    # A workflow node waits for its parent, in a queue not listed: blocked.
    nodes = workflow("scaling")
    nodes.add("parent", jobs.record.using(queue="elsewhere").bind("parent"))
    nodes.add("child", jobs.record.bind("child"), after=["parent"])
    nodes.enqueue()
    assert Job.objects.blocked().filter(queue="default").count() == 1
    jobs.record.using(queue="emails", priority=10).enqueue("urgent")
    for key in range(EMAILS_WAITING - 1):
        jobs.record.using(queue="emails").enqueue(f"emails-{key}")
    for key in range(REPORTS_WAITING + REPORTS_RESERVED):
        jobs.record.using(queue="reports").enqueue(f"reports-{key}")
    assert len(claims.reserve_many(["reports"], limit=REPORTS_RESERVED, worker_id="test:1:held")) == REPORTS_RESERVED
    pauses.pause("reports", force=True)
    for key in range(3):
        jobs.record.using(queue="elsewhere").enqueue(f"elsewhere-{key}")


def test_the_waiting_count_leaves_out_delayed_blocked_reserved_failed_paused_and_unlisted_jobs(rows: None) -> None:
    assert waiting_count(LISTED) == WAITING
    assert waiting_count(["default"]) == DEFAULT_WAITING
    assert waiting_count(["reports"]) == 0
    assert waiting_count(["elsewhere"]) == 3 + 1  # and the workflow's parent


def test_the_work_in_flight_adds_every_reservation_of_the_queues_paused_or_expired(rows: None) -> None:
    assert in_flight_count(LISTED) == IN_FLIGHT
    assert in_flight_count(["reports"]) == REPORTS_RESERVED
    assert in_flight_count(["emails"]) == EMAILS_WAITING


def test_a_limit_caps_both_counts(rows: None) -> None:
    assert waiting_count(LISTED, limit=WAITING - 1) == WAITING - 1
    assert waiting_count(LISTED, limit=WAITING + 1) == WAITING
    # The reservations are counted first, then the waiting jobs up to what is left.
    assert in_flight_count(LISTED, limit=2) == 2
    assert in_flight_count(LISTED, limit=IN_FLIGHT - 1) == IN_FLIGHT - 1
    assert in_flight_count(LISTED, limit=IN_FLIGHT + 1) == IN_FLIGHT


def test_the_waiting_count_is_what_the_claim_takes(rows: None) -> None:
    expected = waiting_count(LISTED)
    claimed = 0
    while taken := claims.claim(Job.objects.get_queryset().db, LISTED, 2, "test:1:claim"):
        claimed += len(taken)
    assert claimed == expected
    assert waiting_count(LISTED) == 0
    assert in_flight_count(LISTED) == IN_FLIGHT


def test_jobs_come_into_the_count_as_they_come_due_are_released_and_their_queue_resumes(rows: None) -> None:
    Job.objects.filter(queue="default", available_at__gt=Now()).update(available_at=Now() - timedelta(seconds=1))
    assert waiting_count(LISTED) == WAITING + 1
    Job.objects.filter(blocked=True).update(blocked=False)
    assert waiting_count(LISTED) == WAITING + 2
    pauses.resume("reports")
    assert waiting_count(LISTED) == WAITING + 2 + REPORTS_WAITING
    pauses.pause("emails")
    assert waiting_count(LISTED) == WAITING + 2 + REPORTS_WAITING - EMAILS_WAITING


@needs_postgresql
def test_the_sql_and_the_orm_agree(rows: None) -> None:
    for queues in (LISTED, ["default"], ["reports"], ["emails", "nothing-here"]):
        for limit in (None, 1, 4):
            assert waiting_count(queues, limit=limit) == scaling._capped(
                scaling._waiting(connection.alias, queues), limit
            )


@needs_postgresql
def test_the_keda_queries_of_the_page_count_as_sent_by_keda(rows: None) -> None:
    """Each query of the page's ScaledObject, run through the driver's own cursor as one literal
    statement: KEDA's scaler sends no parameters."""
    waiting = DEFAULT_WAITING + EMAILS_WAITING
    expected = {"waiting": waiting, "in_flight": waiting + DEFAULT_RESERVED}
    triggers = keda_triggers("postgresql")
    assert sorted(trigger["name"] for _, trigger in triggers) == ["in-flight", "waiting"]
    connection.ensure_connection()
    for _, trigger in triggers:
        query = trigger["metadata"]["query"]
        limit = int(re.findall(r"LIMIT (\d+)", query)[-1])
        with connection.connection.cursor() as cursor:
            cursor.execute(query)
            (count,) = cursor.fetchone()
        assert count == min(expected[trigger["name"].replace("-", "_")], limit), trigger["name"]
    # The same queries without their cap.
    with connection.connection.cursor() as cursor:
        cursor.execute(scaler_query(WAITING_SQL, ["default", "emails"], limit=None))
        assert cursor.fetchone() == (expected["waiting"],)
        cursor.execute(scaler_query(IN_FLIGHT_SQL, ["default", "emails"], limit=None))
        assert cursor.fetchone() == (expected["in_flight"],)


@needs_postgresql
@pytest.mark.parametrize("sql", [WAITING_SQL, IN_FLIGHT_SQL], ids=["waiting", "in_flight"])
def test_the_sql_reads_the_claims_partial_index_in_its_order(sql: str) -> None:
    # A test table is too small for the planner to choose an index; forbid the other ways in.
    with transaction.atomic(), connection.cursor() as cursor:
        cursor.execute("SET LOCAL enable_seqscan = off")
        cursor.execute("SET LOCAL enable_bitmapscan = off")
        cursor.execute("EXPLAIN " + scaler_query(sql, ["default", "emails"], limit=100))
        plan = "\n".join(row[0] for row in cursor.fetchall())
    assert re.search(r"Index (Only )?Scan using dbqueue_job_waiting on dbqueue_job", plan), plan
    assert "Sort" not in plan, plan


def test_the_query_names_each_queue_once_as_a_literal() -> None:
    query = scaler_query(WAITING_SQL, ["default", "emails", "default"], limit=50)
    assert "ARRAY['default', 'emails']" in query
    assert "LIMIT 50" in query
    assert "LIMIT ALL" in scaler_query(IN_FLIGHT_SQL, ["default"], limit=None)
    assert "{" not in scaler_query(IN_FLIGHT_SQL, ["default"], limit=1)


@pytest.mark.parametrize(
    ("queues", "limit", "message"),
    [
        (["it's"], 10, "may hold only letters"),
        ([], 10, "at least one queue"),
        ("default", 10, "a list of queue names"),
        (["default"], 0, "limit must be"),
        (["default"], True, "limit must be"),
        (["default"], 2.5, "limit must be"),
    ],
)
def test_a_bad_queue_list_or_limit_is_refused(queues: list[str], limit: int, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        scaler_query(WAITING_SQL, queues, limit=limit)
    if isinstance(queues, str) or not queues or "'" in queues[0]:
        with pytest.raises(ValueError, match=message):
            waiting_count(queues)
