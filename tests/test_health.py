"""Health checks: ``queue_health``'s exit code and line for each condition, and the JSON health view."""

from __future__ import annotations

import io
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta

import pytest
from django.contrib.auth.models import Permission, User
from django.core.management import call_command
from django.core.management.base import CommandError
from django.db import connection, connections, transaction
from django.db.models.functions import Now
from django.test import Client, override_settings
from django.urls import include, path, reverse
from django.utils import timezone

from django_dbqueue import health, pauses
from django_dbqueue.models import Job, QueueWorker
from tests.conftest import ROOT, wait_until
from tests.testapp import jobs

urlpatterns = [path("queue/", include("django_dbqueue.metrics_urls"))]

# The checks do not depend on Django's version: scripts/test runs these with one.
pytestmark = [pytest.mark.django_db, pytest.mark.urls(__name__), pytest.mark.one_django]

TOKEN = "s3cret-health-token-0123456789"
HOST = health.this_host()


def add_worker(name: str, *, host: str = HOST, seconds_ago: float = 0) -> QueueWorker:
    seen = timezone.now() - timedelta(seconds=seconds_ago)
    return QueueWorker.objects.create(
        worker_id=name, hostname=host, pid=1, queues="default", started_at=seen, last_seen_at=seen
    )


def probe(*args: str) -> tuple[int, str]:
    """Run queue_health in this process; return its exit code and its line (stdout, or the error)."""
    out = io.StringIO()
    try:
        call_command("queue_health", *args, stdout=out, stderr=io.StringIO())
    except CommandError as error:
        return error.returncode, str(error)
    return 0, out.getvalue().strip()


# -- queue_health ---------------------------------------------------------------


def test_healthy_with_a_live_worker_on_this_host():
    add_worker("w1")
    code, line = probe()
    assert code == 0 and line == f"healthy: database 'default' reachable; 1 live worker on host {HOST!r}"


def test_unhealthy_without_a_live_worker_on_this_host():
    add_worker("other", host="elsewhere")
    add_worker("dead", seconds_ago=3600)
    code, line = probe()
    assert code == 1
    assert line.startswith(f"unhealthy: 0 live workers on host {HOST!r}, 1 needed (a worker is live if it beat within")


def test_workers_are_counted_on_the_host_asked_or_on_any_host():
    add_worker("w1")
    add_worker("w2", host="elsewhere")
    assert probe("--workers", "2")[0] == 1
    assert probe("--workers", "2", "--any-host") == (
        0,
        "healthy: database 'default' reachable; 2 live workers on any host",
    )
    assert probe("--host", "elsewhere")[0] == 0
    assert probe("--host", "nowhere")[0] == 1
    assert probe("--workers", "0") == (0, "healthy: database 'default' reachable")


def test_a_worker_silent_for_three_beats_is_not_live():
    add_worker("w1", seconds_ago=25)
    assert probe()[0] == 0
    QueueWorker.objects.update(last_seen_at=Now() - timedelta(seconds=31))
    assert probe()[0] == 1
    with override_settings(DBQUEUE={"WORKER_BEAT": 20}):
        assert probe()[0] == 0


def test_a_queue_over_max_depth_is_unhealthy():
    for key in ("a", "b", "c"):
        jobs.record.enqueue(key)
    jobs.record.using(delay=3600).enqueue("later")  # delayed: not counted
    code, line = probe("--workers", "0", "--max-depth", "2")
    assert (code, line) == (1, "unhealthy: queue 'default' has 3 waiting jobs (max 2)")
    assert probe("--workers", "0", "--max-depth", "3") == (
        0,
        "healthy: database 'default' reachable; no queue over 3 waiting jobs",
    )
    assert probe("--workers", "0", "--max-depth", "2", "--queue", "emails")[0] == 0


def test_a_queue_whose_oldest_job_waited_too_long_is_unhealthy():
    jobs.record.enqueue("a")
    jobs.record.using(queue="emails").enqueue("b")
    Job.objects.filter(queue="default").update(available_at=Now() - timedelta(seconds=120))
    code, line = probe("--workers", "0", "--max-age", "60")
    assert code == 1 and line.startswith("unhealthy: queue 'default' has a job waiting for 12")
    assert line.endswith(" s (max 60 s)")
    assert probe("--workers", "0", "--max-age", "300")[0] == 0
    assert probe("--workers", "0", "--max-age", "60", "--queue", "emails")[0] == 0


def test_every_problem_is_named_on_the_line():
    jobs.record.enqueue("a")
    Job.objects.update(available_at=Now() - timedelta(seconds=120))
    code, line = probe("--max-age", "60", "--max-depth", "0")
    assert code == 1
    assert "0 live workers" in line and "1 waiting job (max 0)" in line and "waiting for" in line
    assert "\n" not in line


def test_a_paused_queue_is_not_judged():
    for key in ("a", "b"):
        jobs.record.enqueue(key)
    pauses.pause("default")
    assert probe("--workers", "0", "--max-depth", "1")[0] == 0


def test_tables_that_cannot_be_read_cannot_tell(monkeypatch):
    from django.db import ProgrammingError

    def missing(*args, **kwargs):
        raise ProgrammingError('relation "dbqueue_worker" does not exist')

    monkeypatch.setattr(health, "check_workers", missing)
    code, line = probe()
    assert code == 2 and line == 'unknown: the queue\'s tables cannot be read: relation "dbqueue_worker" does not exist'


def test_help_shows_the_defaults():
    from django.core.management import load_command_class

    text = " ".join(
        load_command_class("django_dbqueue", "queue_health")
        .create_parser("manage.py", "queue_health")
        .format_help()
        .split()
    )
    assert "(default: 1)" in text and f"this machine's, {HOST}" in text


# -- exit codes of the real command -------------------------------------------


def run_command(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """Run ``manage.py queue_health`` in its own process on the test database."""
    environment = {
        **os.environ,
        "DJANGO_SETTINGS_MODULE": "tests.settings",
        "DBQUEUE_TEST_USE_TEST_DB": "1",
        "PYTHONPATH": str(ROOT),
        **(env or {}),
    }
    return subprocess.run(
        [sys.executable, "-m", "django", "queue_health", *args],
        cwd=ROOT,
        env=environment,
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.mark.acceptance
@pytest.mark.django_db(transaction=True)
def test_exit_codes_with_a_real_worker(worker_process):
    worker = worker_process("--sleep", "0.05", env={"DBQUEUE_TEST_WORKER_BEAT": "0.5"})
    wait_until(lambda: QueueWorker.objects.filter(pid=worker.pid).exists(), 30, "the worker wrote no row")
    alive = run_command()
    assert alive.returncode == 0, alive.stderr
    assert alive.stdout.strip().splitlines() == [
        f"healthy: database 'default' reachable; 1 live worker on host {HOST!r}"
    ]
    worker.signal(signal.SIGTERM)
    assert worker.wait(timeout=30) == 0
    gone = run_command()
    assert gone.returncode == 1 and gone.stdout == ""
    assert gone.stderr.strip().splitlines() == [
        f"CommandError: unhealthy: 0 live workers on host {HOST!r}, 1 needed (a worker is live if it beat within 30 s)"
    ]


@pytest.mark.acceptance
def test_exit_code_2_when_the_database_cannot_be_reached_or_the_options_are_bad(tmp_path):
    unreachable = {
        "DBQUEUE_SQLITE_PATH": str(tmp_path / "no" / "such" / "dir" / "db.sqlite3"),
        "PGPORT": "1",
        "MYSQL_PORT": "1",
        "DBQUEUE_TEST_CONNECT_TIMEOUT": "2",
    }
    down = run_command(env=unreachable)
    assert down.returncode == 2, down.stderr
    [line] = down.stderr.strip().splitlines()
    assert line.startswith("CommandError: unknown: database 'default' unreachable: ")
    bad = run_command("--workers", "-1")
    assert bad.returncode == 2 and "--workers: '-1' must be at least 0" in bad.stderr


# -- the JSON view --------------------------------------------------------------


def url(**query: str) -> str:
    path = reverse("dbqueue_metrics:health")
    return path + ("?" + "&".join(f"{key}={value}" for key, value in query.items()) if query else "")


def user_client(*codenames: str) -> Client:
    user = User.objects.create_user(f"user{User.objects.count()}")
    user.user_permissions.set(
        Permission.objects.filter(content_type__app_label="django_dbqueue", codename__in=codenames)
    )
    client = Client()
    client.force_login(user)
    return client


def test_the_view_answers_200_with_the_checks_when_healthy():
    add_worker("w1", host="worker-host")
    response = user_client("view_job").get(url(max_depth="5"))
    assert response.status_code == 200 and response["Cache-Control"] == "no-store"
    assert response.json() == {
        "status": "healthy",
        "reason": "healthy: database 'default' reachable; 1 live worker on any host; no queue over 5 waiting jobs",
        "checks": [
            {"check": "database", "status": "healthy", "reason": "database 'default' reachable"},
            {"check": "workers", "status": "healthy", "reason": "1 live worker on any host"},
            {"check": "queues", "status": "healthy", "reason": "no queue over 5 waiting jobs"},
        ],
    }


def test_the_view_answers_503_when_unhealthy():
    for key in ("a", "b"):
        jobs.record.using(queue="emails").enqueue(key)
    client = user_client("view_job")
    response = client.get(url())
    assert response.status_code == 503 and response.json()["status"] == "unhealthy"
    assert response.json()["checks"][1] == {
        "check": "workers",
        "status": "unhealthy",
        "reason": "0 live workers on any host, 1 needed (a worker is live if it beat within 30 s)",
    }
    assert client.get(url(workers="0")).status_code == 200
    assert client.get(url(workers="0", max_depth="1")).status_code == 503
    assert client.get(url(workers="0", max_depth="1", queue="default,low")).status_code == 200
    add_worker("w1", host="worker-host")
    assert client.get(url(host="worker-host")).status_code == 200
    assert client.get(url(host="other-host")).status_code == 503


def test_the_view_refuses_bad_thresholds_with_400():
    client = user_client("view_job")
    for query in ({"workers": "-1"}, {"max_depth": "x"}, {"max_age": "-5"}, {"queue": "bad name"}):
        response = client.get(url(**query))
        assert response.status_code == 400 and next(iter(query)) in response.json()["detail"], query


def test_the_view_is_access_controlled_like_the_metrics_view():
    response = Client().get(url())
    assert response.status_code == 401 and "checks" not in response.json()
    assert user_client().get(url()).status_code == 403
    with override_settings(DBQUEUE={"METRICS_TOKEN": TOKEN}):
        assert Client().get(url(workers="0"), HTTP_AUTHORIZATION=f"Bearer {TOKEN}").status_code == 200
        assert Client().get(url(workers="0", token=TOKEN)).status_code == 200
        assert Client().get(url(workers="0"), HTTP_AUTHORIZATION="Bearer wrong-token").status_code == 403


DRIVER_TEXT = (
    'connection to server at "10.1.2.3", port 5432 failed: FATAL: password authentication failed for user "app"'
)


def test_the_view_names_a_database_error_by_its_class_and_the_command_by_its_text(monkeypatch):
    from django.db import OperationalError, ProgrammingError

    class Refused:
        def cursor(self):
            raise OperationalError(DRIVER_TEXT + "\nmore")

    monkeypatch.setattr(health, "connections", {"default": Refused(), "replica": Refused()})
    with override_settings(DBQUEUE={"METRICS_TOKEN": TOKEN}):
        response = Client().get(url(), HTTP_AUTHORIZATION=f"Bearer {TOKEN}")
    assert response.status_code == 503
    assert response.json()["reason"] == "unknown: database 'default' unreachable: OperationalError"
    assert "10.1.2.3" not in response.content.decode() and "app" not in response.content.decode()
    # The operator at the command line reads the driver's first line.
    code, line = probe()
    assert code == 2 and line == f"unknown: database 'default' unreachable: {DRIVER_TEXT}"

    monkeypatch.undo()

    def missing(*args, **kwargs):
        raise ProgrammingError('permission denied for table dbqueue_worker (user "app")')

    monkeypatch.setattr(health, "check_workers", missing)
    response = user_client("view_job").get(url())
    assert response.json()["reason"] == "unknown: the queue's tables cannot be read: ProgrammingError"


# -- transactions left open ------------------------------------------------------


@contextmanager
def transaction_left_open() -> Iterator[None]:
    """A session of another thread that holds a transaction open (a snapshot and a write) until the block ends."""
    opened, done = threading.Event(), threading.Event()

    def hold() -> None:
        try:
            with transaction.atomic():
                QueueWorker.objects.create(
                    worker_id="open",
                    hostname="h",
                    pid=1,
                    queues="q",
                    started_at=timezone.now(),
                    last_seen_at=timezone.now(),
                )
                opened.set()
                done.wait(30)
        finally:
            connections.close_all()

    thread = threading.Thread(target=hold)
    thread.start()
    try:
        assert opened.wait(10)
        yield
    finally:
        done.set()
        thread.join(30)


@pytest.mark.django_db(transaction=True)
@pytest.mark.skipif(connection.vendor == "sqlite", reason="SQLite's readers hold nothing back: nothing to judge")
def test_a_transaction_left_open_longer_than_max_transaction_age_is_unhealthy():
    add_worker("w1")
    with transaction_left_open():
        time.sleep(1.2)  # and past InnoDB's cache of its transactions (0.1 s)
        code, line = probe("--max-transaction-age", "0.5")
        assert code == 1
        opened = r"a transaction has been open for \d+ s by session \d+ \(.*\), max 0.5 s: until it ends, vacuum"
        assert re.search(f"unhealthy: {opened}", line)
        assert probe("--max-transaction-age", "60")[0] == 0
        response = user_client("view_job").get(url(max_transaction_age="0.5"))
        assert response.status_code == 503 and response.json()["checks"][-1]["check"] == "transactions"
    time.sleep(0.3)
    code, line = probe("--max-transaction-age", "0.5")
    assert code == 0 and line.endswith("; no transaction open longer than 0.5 s")
