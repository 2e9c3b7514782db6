"""System checks: each one, and that they are registered."""

import json
import os
import subprocess
import sys

import pytest
from django.core import checks
from django.db import connection
from django.test import override_settings

from django_dbqueue import conf, job, registry
from django_dbqueue.checks import (
    check_database,
    check_queues,
    check_settings,
    check_timeouts,
    check_worker,
    check_worker_queues,
)
from tests.conftest import ROOT


def ids(messages):
    return [message.id for message in messages]


def test_the_checks_are_registered():
    registered = checks.registry.registry.get_checks(include_deployment_checks=False)
    assert {check_settings, check_timeouts, check_database, check_queues} <= set(registered)


def test_no_messages_for_the_test_settings():
    assert check_settings() == [] and check_timeouts() == []


@override_settings(DBQUEUE=["not", "a", "dict"])
def test_dbqueue_must_be_a_dict():
    assert ids(check_settings()) == ["dbqueue.E001"]


@override_settings(DBQUEUE={"RETRY_AFTR": 10})
def test_an_unknown_key_is_reported_with_the_closest_known_key():
    [message] = check_settings()
    assert message.id == "dbqueue.E002" and message.hint == "Did you mean 'RETRY_AFTER'?"


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("TRIES", 0),
        ("TRIES", "3"),
        ("RETRY_AFTER", 1.5),
        ("TIMEOUT", -1),
        ("BACKOFF", [1, "x"]),
        ("SLEEP", -1),
        ("AUTODISCOVER", "yes"),
        ("QUEUE", ""),
        ("QUEUE", "two words"),
        ("QUEUE", "q" * 101),
        ("TRIES", 32768),
        ("RETRY_AFTER", 2**31),
        ("TIMEOUT", 2**31),
        ("BACKOFF", [10, 2**31]),
        ("QUEUES", ["default", "bad name"]),
        ("DATABASE", 3),
    ],
)
def test_a_value_of_the_wrong_type_is_reported(key, value):
    with override_settings(DBQUEUE={key: value}):
        [message] = check_settings()
    assert message.id == "dbqueue.E003" and f"DBQUEUE[{key!r}] must be" in message.msg


@override_settings(DBQUEUE={"DATABASE": "queue"})
def test_a_database_alias_that_does_not_exist_is_reported():
    assert ids(check_settings()) == ["dbqueue.E004"]


@override_settings(DBQUEUE={"RETRY_AFTER": 30, "TIMEOUT": 30})
def test_retry_after_not_longer_than_timeout_is_reported():
    assert "dbqueue.W001" in ids(check_timeouts())


def test_a_job_whose_retry_after_is_not_longer_than_its_timeout_is_reported():
    @job(name="tests.checks.too_short", timeout=120, retry_after=60)
    def too_short():
        pass

    try:
        messages = [m for m in check_timeouts() if m.id == "dbqueue.W002"]
    finally:
        registry.unregister("tests.checks.too_short")
    assert len(messages) == 1 and "'tests.checks.too_short' has retry_after 60 s" in messages[0].msg


def test_settings_changes_are_seen_at_once():
    assert conf.get("TRIES") == 3
    with override_settings(DBQUEUE={"TRIES": 7}):
        assert conf.get("TRIES") == 7
    assert conf.get("TRIES") == 3


@pytest.mark.django_db
def test_the_test_database_can_claim_safely():
    assert check_database(databases=["default"]) == []


@pytest.mark.django_db
def test_sqlite_with_several_workers_is_warned_about(settings):
    from django.db import connection

    messages = check_worker(concurrency=4, timeout=10)
    expected = ["dbqueue.W003"] if connection.vendor == "sqlite" else []
    assert ids(messages) == expected
    assert ids(check_worker(concurrency=1, timeout=10)) == []


def test_a_worker_timeout_not_shorter_than_retry_after_is_warned_about():
    assert ids(check_worker(concurrency=None, timeout=60)) == ["dbqueue.W004"]


def test_the_tasks_backend_on_django_before_6_is_reported():
    import django

    from django_dbqueue.checks import check_tasks_backend

    with override_settings(TASKS={"default": {"BACKEND": "django_dbqueue.tasks.DatabaseBackend"}}):
        messages = check_tasks_backend()
    assert [m.id for m in messages] == (["dbqueue.E009"] if django.VERSION < (6, 0) else [])


@override_settings(DBQUEUE={"QUEUES": ["default", "emails"]})
def test_a_job_whose_queue_is_not_in_queues_is_reported():
    job(name="tests.check_reports", queue="reports")(lambda: None)
    job(name="tests.check_emails", queue="emails")(lambda: None)
    try:
        messages = check_queues()
    finally:
        registry.unregister("tests.check_reports")
        registry.unregister("tests.check_emails")
    # Only this test's jobs: another test file's module may have registered jobs of other queues at import.
    [message] = [message for message in messages if "'tests.check_" in message.msg]
    assert message.id == "dbqueue.W005" and message.hint
    assert message.msg == (
        "Job 'tests.check_reports' uses the queue 'reports', which is not in DBQUEUE['QUEUES'] ('default', 'emails')."
    )


@override_settings(DBQUEUE={"QUEUES": ["emails"]})
def test_a_default_queue_not_in_queues_is_reported():
    [message] = [message for message in check_queues() if message.msg.startswith("DBQUEUE['QUEUE']")]
    assert message.id == "dbqueue.W005"
    assert message.msg == "DBQUEUE['QUEUE'] is 'default', which is not in DBQUEUE['QUEUES'] ('emails')."


def test_no_queue_is_reported_without_queues():
    job(name="tests.check_anywhere", queue="anywhere")(lambda: None)
    try:
        assert check_queues() == []
    finally:
        registry.unregister("tests.check_anywhere")


@override_settings(DBQUEUE={"QUEUES": ["default", "emails"]})
def test_a_worker_serving_a_queue_not_in_queues_is_warned():
    [message] = check_worker_queues(["emails", "emials"])
    assert message.id == "dbqueue.W006" and "serves 'emials', not in DBQUEUE['QUEUES']" in message.msg
    assert check_worker_queues(["default", "emails"]) == []


def test_a_worker_may_serve_any_queue_without_queues():
    assert check_worker_queues(["anything"]) == []


# Every check of the package, run in a process of its own against settings with
# only INSTALLED_APPS, DATABASES and SECRET_KEY (a worker-only settings module has
# no ROOT_URLCONF, TEMPLATES or MIDDLEWARE). ``block`` hides prometheus_client.
MINIMAL_RUN = """
import json, sys
if sys.argv[1] == "block":
    sys.modules["prometheus_client"] = None
import django
django.setup()
from django.core.checks.registry import registry
from django.core.management import call_command
ran = {}
for check in sorted(registry.registered_checks | registry.deployment_checks, key=lambda c: c.__name__):
    if check.__module__.startswith("django_dbqueue."):
        ran[check.__name__] = [message.id for message in check(app_configs=None, databases=["default"])]
call_command("check", databases=["default"])
print(json.dumps(ran))
"""


@pytest.mark.django_db
@pytest.mark.parametrize("prometheus", ["installed", "block"])
def test_every_check_reports_and_never_raises_with_minimal_settings(tmp_path, prometheus):
    database = {
        key: value
        for key, value in connection.settings_dict.items()
        if key in ("ENGINE", "NAME", "USER", "PASSWORD", "HOST", "PORT", "OPTIONS")
    }
    if connection.vendor == "sqlite":
        # A file of its own: this test's transaction may hold the test database's lock.
        database = {"ENGINE": database["ENGINE"], "NAME": str(tmp_path / "minimal.sqlite3")}
    (tmp_path / "minimal_settings.py").write_text(
        f'INSTALLED_APPS = ["django_dbqueue"]\nDATABASES = {{"default": {database!r}}}\nSECRET_KEY = "x" * 50\n'
    )
    env = {key: value for key, value in os.environ.items() if not key.startswith(("DJANGO_", "DBQUEUE_", "PYTHON"))}
    env.update(DJANGO_SETTINGS_MODULE="minimal_settings", PYTHONPATH=os.pathsep.join([str(tmp_path), str(ROOT)]))
    result = subprocess.run(
        [sys.executable, "-c", MINIMAL_RUN, prometheus],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    ran = json.loads(result.stdout.splitlines()[-1])
    # Every check of checks.py that Django runs, each reporting nothing for these settings but, on
    # SQLite's fresh file, the missing migrations and the settings a worker needs there.
    assert {"check_settings", "check_timeouts", "check_database", "check_metrics_extra"} <= set(ran)
    fresh = {"check_migrations": ["dbqueue.W009"], "check_sqlite": ["dbqueue.W011"]}
    expected = fresh if connection.vendor == "sqlite" else {}
    assert all(messages == expected.get(name, []) for name, messages in ran.items()), ran
