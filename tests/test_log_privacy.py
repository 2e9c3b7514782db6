"""Logs of database errors name the error, never the row it quotes (issue 26).

PostgreSQL's DETAIL (``Failing row contains (...)``, ``Key (payload)=(...) already
exists``) and MariaDB's ``Duplicate entry '...'`` quote the values of the statement,
that is a job's arguments: what the ``django_dbqueue`` logger writes of a database
error is ``db.error_text``, its class, code and primary message.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator

import pytest
from django.db import DatabaseError, IntegrityError, connection, transaction

from django_dbqueue import schedules
from django_dbqueue.db import error_text
from django_dbqueue.models import Job, ScheduleState
from django_dbqueue.schedules import periodic
from django_dbqueue.ticker import Ticker
from tests.testapp import jobs
from tests.testapp.models import Run

pytestmark = [pytest.mark.one_django, pytest.mark.django_db(transaction=True)]

# A value a job is given; looks like nothing the error scrubber knows, so only
# error_text keeps it out of the logs.
SECRET = "Zq7-order-note-4471"


def _raised(sql: str, params: list[object]) -> DatabaseError:
    with pytest.raises(DatabaseError) as caught, transaction.atomic(), connection.cursor() as cursor:
        cursor.execute(sql, params)
    return caught.value


def test_error_text_of_a_unique_violation_names_the_code_and_not_the_value():
    Run.objects.create(key=SECRET)
    with pytest.raises(IntegrityError) as caught, transaction.atomic():
        Run.objects.create(key=SECRET)
    whole = str(caught.value)
    text = error_text(caught.value)

    assert SECRET not in text
    assert text.startswith("IntegrityError ")
    if connection.vendor == "postgresql":
        assert SECRET in whole  # DETAIL:  Key (key)=(...) already exists.
        assert text.startswith("IntegrityError sqlstate=23505: duplicate key value violates unique constraint")
    elif connection.vendor == "mysql":
        assert SECRET in whole  # Duplicate entry '...' for key '...'
        assert text.startswith("IntegrityError code=1062: Duplicate entry '...' for key '")
        assert text.endswith("key'")
    else:
        assert text == "IntegrityError code=SQLITE_CONSTRAINT_UNIQUE: UNIQUE constraint failed: testapp_run.key"


def test_error_text_cuts_a_message_that_quotes_the_input_before_the_value():
    if connection.vendor == "postgresql":
        # 22P02: invalid input syntax for type integer: "..."
        exc = _raised("SELECT %s::integer", [SECRET])
        assert SECRET in str(exc)
        assert error_text(exc) == "DataError sqlstate=22P02: invalid input syntax for type integer"
    elif connection.vendor == "mysql":
        # 1064: the driver formats the parameters into the SQL, which the message quotes.
        exc = _raised("SELECT * FROM WHERE x = %s", [SECRET])
        assert SECRET in str(exc)
        text = error_text(exc)
        assert text.startswith("ProgrammingError code=1064: You have an error in your SQL syntax")
        assert SECRET not in text
    else:
        exc = _raised("SELECT * FROM no_such_table WHERE x = %s", [SECRET])
        assert error_text(exc) == "OperationalError code=SQLITE_ERROR: no such table: no_such_table"


def test_error_text_of_anything_else_is_its_class():
    assert error_text(ValueError(f"invalid literal for int() with base 10: {SECRET!r}")) == "ValueError"
    assert error_text(DatabaseError(SECRET)) == "DatabaseError"
    assert error_text(KeyError(SECRET)) == "KeyError"


@pytest.fixture
def unique_payload() -> Iterator[None]:
    """A unique index on the job's payload: a second job with the same arguments is refused,
    and the database's error quotes the payload."""
    column = "payload(255)" if connection.vendor == "mysql" else "payload"
    with connection.cursor() as cursor:
        cursor.execute(f"CREATE UNIQUE INDEX hd_unique_payload ON dbqueue_job ({column})")
    try:
        yield
    finally:
        with connection.cursor() as cursor:
            if connection.vendor == "mysql":
                cursor.execute("DROP INDEX hd_unique_payload ON dbqueue_job")
            else:
                cursor.execute("DROP INDEX hd_unique_payload")


class Captured(logging.Handler):
    """Records of the ``django_dbqueue`` logger, with an event set at the first WARNING."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []
        self.warned = threading.Event()

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)
        if record.levelno >= logging.WARNING:
            self.warned.set()


def test_a_ticker_that_cannot_enqueue_logs_the_error_without_the_jobs_arguments(unique_payload, caplog):
    """The ticker's insert of a job whose arguments are a row's secret fails; its WARNING
    names the error's code, and neither the message nor the formatted line quotes the secret."""
    schedule = periodic(jobs.record, every=3600, args=[SECRET], name="hd-privacy")
    by_name = {schedule.name: schedule}
    try:
        jobs.record.enqueue(SECRET)
        schedules.sync(by_name)
        ScheduleState.objects.filter(name=schedule.name).update(next_tick=None)
        Ticker("hd-seed", schedules=by_name).look(by_name)  # next_tick from the database clock
        state = ScheduleState.objects.get(name=schedule.name)
        ScheduleState.objects.filter(pk=state.pk).update(next_tick=state.updated_at)
        captured = Captured()
        logger = logging.getLogger("django_dbqueue")
        logger.addHandler(captured)
        try:
            with caplog.at_level(logging.INFO, logger="django_dbqueue"), Ticker("hd", schedules=by_name):
                assert captured.warned.wait(30), [record.getMessage() for record in captured.records]
        finally:
            logger.removeHandler(captured)
    finally:
        schedules.unschedule(schedule.name)
    warnings = [record.getMessage() for record in captured.records if record.levelno >= logging.WARNING]
    assert warnings[0].startswith("ticker failed worker_id=hd retry_in=1.0s: IntegrityError ")
    for message in warnings:
        assert SECRET not in message
    assert SECRET not in caplog.text
    if connection.vendor == "postgresql":
        assert "sqlstate=23505: duplicate key value violates unique constraint" in warnings[0]
    elif connection.vendor == "mysql":
        assert "code=1062: Duplicate entry '...' for key '" in warnings[0]
    else:
        assert "code=SQLITE_CONSTRAINT_UNIQUE: UNIQUE constraint failed: dbqueue_job.payload" in warnings[0]
    assert Job.objects.count() == 1
