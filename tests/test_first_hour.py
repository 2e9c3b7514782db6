"""Errors where a new user makes them (issue 28): a database not migrated, a queue name with a
typo, SQLite's settings, a ticker that meets a lock; and ``queue_work --until-done``, which waits
for retries.

The last test follows a new project's first steps in processes of its own, on a database of its
own: SQLite with ``startproject``'s settings, or a fresh database on the server under test.
"""

from __future__ import annotations

import io
import logging
import os
import sqlite3
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from django.core import checks
from django.core.management import call_command
from django.core.management.base import CommandError
from django.db import DatabaseError, OperationalError, connection, transaction
from django.db.migrations.loader import MigrationLoader
from django.db.migrations.recorder import MigrationRecorder
from django.db.models import F
from django.test import override_settings

from django_dbqueue import claims, db, health, job, pauses, registry, schedules, schema, ticker
from django_dbqueue.checks import check_migrations, check_sqlite, check_worker_queues_used
from django_dbqueue.db import DbNow
from django_dbqueue.execution import Defaults
from django_dbqueue.models import Job
from django_dbqueue.worker import StopReason
from tests.conftest import ROOT, run_worker
from tests.testapp import jobs
from tests.testapp.models import Run

MIGRATE = "run `manage.py migrate django_dbqueue`."
NO_TABLES = f"The queue's database 'default' has none of django_dbqueue's tables: {MIGRATE}"


def latest_migration() -> str:
    [(_, name)] = MigrationLoader(None, ignore_no_migrations=True).graph.leaf_nodes("django_dbqueue")
    return name


def catalogue_without(patch: pytest.MonkeyPatch, *names: str) -> None:
    """Make the database's catalogue show none of ``names`` (default: the app's tables)."""
    keep = [table for table in connection.introspection.table_names() if table not in (names or schema.tables())]
    patch.setattr(connection.introspection, "table_names", lambda *args, **kwargs: keep)


@contextmanager
def tables_gone(*names: str) -> Iterator[None]:
    with pytest.MonkeyPatch.context() as patch:
        catalogue_without(patch, *names)
        yield


def without_latest_migration(monkeypatch: pytest.MonkeyPatch) -> None:
    applied = MigrationRecorder.applied_migrations
    latest = ("django_dbqueue", latest_migration())
    monkeypatch.setattr(
        MigrationRecorder,
        "applied_migrations",
        lambda self: {key: value for key, value in applied(self).items() if key != latest},
    )


# -- tables and migrations -------------------------------------------------------


@pytest.mark.django_db
def test_a_migrated_database_lacks_nothing():
    assert schema.missing_tables("default") == []
    assert schema.unapplied_migrations("default") == []
    assert schema.problem("default") is None
    assert check_migrations(databases=["default"]) == []


@pytest.mark.django_db
def test_missing_tables_are_named_and_say_what_to_run():
    with tables_gone():
        assert schema.problem("default") == NO_TABLES
    with tables_gone("dbqueue_job", "dbqueue_batch"):
        assert schema.missing_tables("default") == ["dbqueue_batch", "dbqueue_job"]
        assert schema.problem("default") == (
            f"The queue's database 'default' lacks django_dbqueue's tables dbqueue_batch, dbqueue_job: {MIGRATE}"
        )


@pytest.mark.django_db
def test_a_missing_latest_migration_is_named(monkeypatch):
    without_latest_migration(monkeypatch)
    assert schema.unapplied_migrations("default") == [latest_migration()]
    expected = (
        "The queue's database 'default' lacks the latest migration of django_dbqueue "
        f"(1 migration not applied, the last {latest_migration()}): {MIGRATE}"
    )
    assert schema.problem("default") == expected
    # The tables alone are all there.
    assert schema.problem("default", migrations=False) is None
    [message] = check_migrations(databases=["default"])
    assert message.id == "dbqueue.W009" and message.msg == expected


@pytest.mark.django_db
def test_the_database_checks_are_registered_with_the_database_tag(monkeypatch):
    registered = checks.registry.registry.get_checks(include_deployment_checks=False)
    for check in (check_migrations, check_sqlite):
        assert check in registered and "database" in check.tags
    without_latest_migration(monkeypatch)
    # Run by `check --database default` and by migrate (a warning: migrate must still run) ...
    found = checks.run_checks(databases=["default"], tags=[checks.Tags.database])
    assert [message.id for message in found if message.id == "dbqueue.W009"] == ["dbqueue.W009"]
    assert all(message.level < checks.ERROR for message in found if message.id == "dbqueue.W009")
    # ... not by a plain `check`, which opens no connection.
    assert check_migrations() == []


@pytest.mark.django_db
def test_the_drivers_errors_for_a_missing_table_or_column_are_told_apart():
    for sql in ("SELECT 1 FROM dbqueue_no_such_table", "SELECT no_such_column FROM dbqueue_job"):
        with pytest.raises(DatabaseError) as raised, transaction.atomic():
            with connection.cursor() as cursor:
                cursor.execute(sql)
        assert schema.names_missing_schema(raised.value), raised.value
    assert not schema.names_missing_schema(OperationalError("database is locked"))


@pytest.mark.django_db
def test_a_worker_stops_at_start_when_the_tables_are_missing(caplog):
    with tables_gone(), pytest.raises(schema.NotMigrated) as raised:
        run_worker(max_time=5)
    assert str(raised.value) == NO_TABLES
    assert any(record.levelno == logging.ERROR and NO_TABLES in record.getMessage() for record in caplog.records)


@pytest.mark.django_db
def test_queue_work_refuses_to_start_with_exit_code_1_when_the_tables_are_missing():
    with tables_gone(), pytest.raises(CommandError) as raised:
        call_command("queue_work", "--until-done", stderr=io.StringIO())
    assert str(raised.value) == NO_TABLES and raised.value.returncode == 1


@pytest.mark.django_db
def test_queue_work_refuses_to_start_when_the_latest_migration_is_missing(monkeypatch):
    without_latest_migration(monkeypatch)
    with pytest.raises(CommandError, match="lacks the latest migration of django_dbqueue"):
        call_command("queue_work", "--until-done", stderr=io.StringIO())


@pytest.mark.django_db
def test_a_worker_whose_tables_go_missing_stops_instead_of_retrying_for_ever(monkeypatch):
    def claim_without_tables(*args: Any, **kwargs: Any) -> Any:
        catalogue_without(monkeypatch)
        with transaction.atomic(), connection.cursor() as cursor:  # the driver's own error
            cursor.execute("SELECT 1 FROM dbqueue_no_such_table")

    monkeypatch.setattr(claims, "finish_and_reserve", claim_without_tables)
    # Without the stop, the worker would retry until --max-time.
    with pytest.raises(schema.NotMigrated) as raised:
        run_worker(max_time=5, stop_when_empty=False)
    assert str(raised.value) == NO_TABLES


@pytest.mark.django_db
def test_queue_health_is_unhealthy_and_says_what_to_run():
    with tables_gone():
        report = health.probe(health.Thresholds(workers=0))
        with pytest.raises(CommandError) as raised:
            call_command("queue_health", "--workers", "0", stdout=io.StringIO())
    assert report.status == health.Status.UNHEALTHY
    assert [finding.check for finding in report.findings] == ["database", "migrations"]
    assert str(raised.value) == f"unhealthy: {NO_TABLES}" and raised.value.returncode == 1


# -- a queue nothing uses ----------------------------------------------------------


@pytest.fixture
def emails_job() -> Iterator[None]:
    job(name="tests.first_hour_receipt", queue="emails")(lambda: None)
    yield
    registry.unregister("tests.first_hour_receipt")


@pytest.mark.django_db
def test_a_worker_serving_a_queue_nothing_uses_is_warned_with_the_closest_known_queue(emails_job):
    [message] = check_worker_queues_used(["default", "emials"])
    assert message.id == "dbqueue.W010"
    assert message.msg == (
        "This worker serves the queue 'emials', which no registered job, schedule, job row or other worker "
        "uses: it has nothing to run there."
    )
    assert message.hint.startswith("Did you mean 'emails'? Known queues: ")
    assert "'default'" in message.hint and "'emails'" in message.hint


@pytest.mark.django_db
def test_a_queue_that_holds_a_job_is_used():
    jobs.record.using(queue="first-hour-rows").enqueue("x")
    assert check_worker_queues_used(["first-hour-rows"]) == []


@pytest.mark.django_db
@override_settings(DBQUEUE={"QUEUES": ["default", "emails"]})
def test_with_queues_set_the_list_decides_not_the_rows():
    # dbqueue.W006 (check_worker_queues) names it instead.
    assert check_worker_queues_used(["emials"]) == []


@pytest.mark.django_db
def test_queue_work_warns_about_a_queue_nothing_uses_and_runs(emails_job):
    err = io.StringIO()
    call_command("queue_work", "--queue", "emials", "--until-done", stderr=err)
    assert "(dbqueue.W010) This worker serves the queue 'emials'" in err.getvalue()
    assert "Did you mean 'emails'?" in err.getvalue()


# -- SQLite's settings -------------------------------------------------------------


@pytest.mark.django_db
def test_sqlite_without_the_settings_a_worker_needs_is_warned(monkeypatch):
    # The test settings have them all (WAL, a 30 s timeout, IMMEDIATE).
    assert check_sqlite(databases=["default"]) == []
    monkeypatch.setitem(connection.settings_dict, "OPTIONS", {})
    messages = check_sqlite(databases=["default"])
    if connection.vendor != "sqlite":
        assert messages == []
        return
    [message] = messages
    assert message.id == "dbqueue.W011"
    # The journal mode is the file's own (the test database's is WAL); the others are the connection's.
    assert message.msg == (
        "The queue's database 'default' is SQLite with a busy timeout of 5 s (a write waits that long for "
        "another's); deferred transactions (one that reads then writes fails with 'database is locked')."
    )
    assert message.hint == "Add to DATABASES['default']['OPTIONS']: {'timeout': 20, 'transaction_mode': 'IMMEDIATE'}."
    assert check_sqlite() == []  # a plain `check` opens no connection


# -- the ticker and a lock ---------------------------------------------------------


def sqlite_lock_error(tmp_path: Path) -> DatabaseError:
    """A real "database is locked", as Django raises it."""
    path = tmp_path / "locked.sqlite3"
    holder = sqlite3.connect(path, timeout=0)
    holder.execute("CREATE TABLE IF NOT EXISTS t (x)")
    holder.execute("BEGIN IMMEDIATE")
    other = sqlite3.connect(path, timeout=0)
    try:
        other.execute("BEGIN IMMEDIATE")
    except sqlite3.OperationalError as driver_error:
        error = OperationalError(*driver_error.args)
        error.__cause__ = driver_error
        return error
    finally:
        other.close()
        holder.close()
    raise AssertionError("no lock")


def run_ticker(monkeypatch: pytest.MonkeyPatch, failures: list[DatabaseError | None]) -> None:
    """Run a ticker's loop in its thread: each look raises the next of ``failures`` (None: it
    succeeds), then it stops."""
    running = ticker.Ticker("first-hour")

    def look(self: ticker.Ticker, declared: Any) -> float:
        if failures:
            failure = failures.pop(0)
            if failure is not None:
                raise failure
            return 0
        self._stopping.set()
        return 0

    monkeypatch.setattr(schedules, "sync", lambda declared: None)
    monkeypatch.setattr(ticker.Ticker, "look", look)
    monkeypatch.setattr(ticker, "LOCK_RETRY", (0,))
    thread = threading.Thread(target=running._run, args=({},))
    thread.start()
    thread.join(30)
    assert not thread.is_alive()


def test_the_locks_of_each_database_are_told_from_other_errors(tmp_path):
    assert db.is_lock(sqlite_lock_error(tmp_path))

    class Driver(Exception):
        def __init__(self, *args: Any, sqlstate: str | None = None) -> None:
            super().__init__(*args)
            self.sqlstate = sqlstate

    def error(driver: Exception) -> DatabaseError:
        wrapped = OperationalError(*driver.args)
        wrapped.__cause__ = driver
        return wrapped

    assert db.is_lock(error(Driver("deadlock detected", sqlstate="40P01")))
    assert db.is_lock(error(Driver("could not obtain lock", sqlstate="55P03")))
    assert not db.is_lock(error(Driver("relation does not exist", sqlstate="42P01")))
    assert db.is_lock(error(Driver(1205, "Lock wait timeout exceeded; try restarting transaction")))
    assert not db.is_lock(error(Driver(2006, "MySQL server has gone away")))


@pytest.mark.django_db
def test_a_ticker_that_meets_a_lock_says_so_once_at_info_and_retries(monkeypatch, tmp_path, caplog):
    caplog.set_level(logging.DEBUG, logger="django_dbqueue")
    # A lock met twice, a look that succeeds, a lock again (as workers that start together meet).
    locked = sqlite_lock_error(tmp_path)
    run_ticker(monkeypatch, [locked, locked, None, locked])
    records = [record for record in caplog.records if record.name == "django_dbqueue"]
    assert [(record.levelname, record.getMessage().split(" worker_id")[0]) for record in records] == [
        ("INFO", "ticker waits for a lock"),
        ("DEBUG", "ticker waits for a lock"),
        ("DEBUG", "ticker waits for a lock"),
    ]


@pytest.mark.django_db
def test_a_lock_that_persists_is_an_error(monkeypatch, tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="django_dbqueue")
    monkeypatch.setattr(ticker, "LOCK_PERSISTS", 0)
    locked = sqlite_lock_error(tmp_path)
    run_ticker(monkeypatch, [locked, locked])
    said = [(record.levelname, record.getMessage()) for record in caplog.records if "lock" in record.getMessage()]
    assert [level for level, _ in said] == ["INFO", "ERROR"]
    assert said[1][1].startswith("ticker locked out for ")


# -- queue_work --until-done -------------------------------------------------------

BACKOFF = Defaults(tries=3, timeout=30, backoff=1, timeout_grace=2)


@pytest.mark.django_db
def test_stop_when_empty_leaves_a_retry_in_its_backoff_and_until_done_runs_it():
    jobs.fail_once.enqueue("retried")
    _, reason = run_worker(defaults=BACKOFF)
    assert reason is StopReason.EMPTY
    assert Job.objects.filter(attempts=1).exists() and not Run.objects.exists()

    _, reason = run_worker(defaults=BACKOFF, stop_when_empty=False, until_done=True, max_time=60)
    assert reason is StopReason.DONE
    assert Run.objects.filter(key="retried").exists() and not Job.objects.exists()


@pytest.mark.django_db
def test_until_done_waits_for_a_job_another_worker_runs():
    jobs.record.enqueue("elsewhere")
    Job.objects.update(reserved_at=DbNow(), reserved_by="another-worker", attempts=F("attempts") + 1)
    _, reason = run_worker(stop_when_empty=False, until_done=True, max_time=1, sleep=0.05)
    assert reason is StopReason.MAX_TIME
    _, reason = run_worker()
    assert reason is StopReason.EMPTY


@pytest.mark.django_db
def test_until_done_does_not_wait_for_the_jobs_of_a_paused_queue():
    jobs.record.using(queue="first-hour-paused").enqueue("paused")
    pauses.pause("first-hour-paused")
    _, reason = run_worker(["first-hour-paused"], stop_when_empty=False, until_done=True, max_time=60)
    assert reason is StopReason.DONE
    assert Job.objects.count() == 1


@pytest.mark.django_db
def test_until_done_and_stop_when_empty_cannot_be_combined():
    with pytest.raises(CommandError, match="not allowed with argument"):
        call_command("queue_work", "--until-done", "--stop-when-empty", stderr=io.StringIO())


# -- a new project's first hour, in processes of its own ----------------------------

SHOP_JOBS = """
from django_dbqueue import job


@job(queue="emails")
def send_receipt(order_id):
    return order_id
"""


@pytest.fixture
def fresh_database(tmp_path: Path, transactional_db: None) -> Iterator[dict[str, Any]]:
    """A database nothing was migrated into: SQLite with startproject's settings, or a new
    database on the server under test."""
    if connection.vendor == "sqlite":
        yield {"ENGINE": "django.db.backends.sqlite3", "NAME": str(tmp_path / "db.sqlite3")}
        return
    name = f"{connection.settings_dict['NAME']}_fresh"
    quoted = connection.ops.quote_name(name)
    charset = " CHARACTER SET utf8mb4" if connection.vendor == "mysql" else ""
    with connection.cursor() as cursor:
        cursor.execute(f"DROP DATABASE IF EXISTS {quoted}")
        cursor.execute(f"CREATE DATABASE {quoted}{charset}")
    keys = ("ENGINE", "USER", "PASSWORD", "HOST", "PORT", "OPTIONS")
    yield {key: value for key, value in connection.settings_dict.items() if key in keys} | {"NAME": name}
    with connection.cursor() as cursor:
        cursor.execute(f"DROP DATABASE IF EXISTS {quoted}")


@pytest.mark.acceptance
def test_the_first_hour_of_a_new_project(tmp_path, fresh_database):
    (tmp_path / "shop").mkdir()
    (tmp_path / "shop" / "__init__.py").write_text("")
    (tmp_path / "shop" / "jobs.py").write_text(SHOP_JOBS)
    (tmp_path / "first_hour_settings.py").write_text(
        'INSTALLED_APPS = ["django_dbqueue", "shop"]\n'
        f'DATABASES = {{"default": {fresh_database!r}}}\n'
        'SECRET_KEY = "x" * 50\nUSE_TZ = True\n'
    )
    env = {key: value for key, value in os.environ.items() if not key.startswith(("DJANGO_", "DBQUEUE_", "PYTHON"))}
    env.update(DJANGO_SETTINGS_MODULE="first_hour_settings", PYTHONPATH=os.pathsep.join([str(tmp_path), str(ROOT)]))

    def manage(*args: str) -> subprocess.CompletedProcess[str]:
        command = [sys.executable, "-m", "django", *args]
        return subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)

    sqlite = connection.vendor == "sqlite"
    checked = manage("check", "--database", "default")
    assert checked.returncode == 0, checked.stderr
    assert f"(dbqueue.W009) {NO_TABLES}" in checked.stderr
    assert ("(dbqueue.W011)" in checked.stderr) == sqlite
    if sqlite:  # startproject's settings lack all three
        assert "journal mode 'delete', not WAL" in checked.stderr and "a busy timeout of 5 s" in checked.stderr

    # The worker stops at once, it does not retry "no such table".
    worker = manage("queue_work", "--until-done")
    assert worker.returncode == 1, worker.stderr
    assert worker.stderr.strip().splitlines()[-1] == f"CommandError: {NO_TABLES}"
    probe = manage("queue_health", "--workers", "0")
    assert probe.returncode == 1 and probe.stderr.strip() == f"CommandError: unhealthy: {NO_TABLES}"

    # migrate runs the database checks too: W009 is a warning, so it migrates.
    migrated = manage("migrate")
    assert migrated.returncode == 0, migrated.stderr
    assert "dbqueue.W009" in migrated.stderr
    checked = manage("check", "--database", "default")
    assert checked.returncode == 0 and "dbqueue.W009" not in checked.stderr + checked.stdout

    enqueued = manage("shell", "-c", "from shop.jobs import send_receipt; send_receipt.enqueue(42)")
    assert enqueued.returncode == 0, enqueued.stderr
    typo = manage("queue_work", "--queue", "emials", "--until-done")
    assert typo.returncode == 0, typo.stderr
    assert "(dbqueue.W010) This worker serves the queue 'emials'" in typo.stderr
    assert "Did you mean 'emails'?" in typo.stderr and "reason=done processed=0" in typo.stderr
    served = manage("queue_work", "--queue", "emails", "--until-done")
    assert served.returncode == 0, served.stderr
    assert "outcome=succeeded" in served.stderr and "reason=done processed=1" in served.stderr
    assert " ERROR " not in served.stderr, served.stderr
