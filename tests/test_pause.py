"""Paused queues: the pauses API, queue_pause / queue_resume, the admin's Pause and Resume
buttons, queue_monitor, and real ``queue_work`` processes that leave a paused queue alone."""

from __future__ import annotations

import io
import logging
import signal
import time
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import django
import pytest
from django.conf import settings
from django.contrib.auth.models import User
from django.core.management import call_command, load_command_class
from django.core.management.base import CommandError, OutputWrapper
from django.db import connection, connections
from django.test import Client, override_settings
from django.urls import reverse
from django.utils import timezone

import django_dbqueue
from django_dbqueue import claims, enqueue_many, operations, pauses, registry
from django_dbqueue.exceptions import UnknownQueue
from django_dbqueue.models import Job, PausedQueue
from django_dbqueue.signals import queue_paused, queue_resumed
from tests.conftest import needs_listen, wait_until
from tests.test_admin import make_failed
from tests.test_operations_commands import worker_row
from tests.testapp import jobs
from tests.testapp.models import Run

db = pytest.mark.django_db

OVERVIEW = reverse("admin:django_dbqueue_overview")
PAUSE = reverse("admin:django_dbqueue_pause")
RESUME = reverse("admin:django_dbqueue_resume")


def with_queues(*queues: str) -> Any:
    """Settings with ``DBQUEUE["QUEUES"]`` set to ``queues``."""
    return override_settings(DBQUEUE={**settings.DBQUEUE, "QUEUES": list(queues)})


@pytest.fixture
def reports_definition() -> Iterator[registry.JobDefinition[..., Any]]:
    """A job definition on the queue 'reports', registered for the test only."""
    definition = registry.JobDefinition(jobs.record.func, name="tests.pause.reports", queue="reports")
    registry.register(definition)
    yield definition
    registry.unregister(definition.name)


@pytest.fixture
def sent() -> Iterator[list[tuple[str, str]]]:
    """The pause signals sent during the test, as (signal, queue)."""
    received: list[tuple[str, str]] = []

    def on_paused(sender: Any, queue: str, **kwargs: Any) -> None:
        received.append(("paused", queue))

    def on_resumed(sender: Any, queue: str, **kwargs: Any) -> None:
        received.append(("resumed", queue))

    queue_paused.connect(on_paused)
    queue_resumed.connect(on_resumed)
    yield received
    queue_paused.disconnect(on_paused)
    queue_resumed.disconnect(on_resumed)


# -- the API -------------------------------------------------------------------


@db
def test_pause_stores_the_queue_with_the_database_clock_and_says_it_was_not_paused():
    before = timezone.now()
    assert pauses.pause("default") is True
    row = PausedQueue.objects.get()
    assert row.queue == "default"
    # The database's clock, read back from the row: within a few seconds of this process's.
    assert abs(row.paused_at - before) < timedelta(seconds=5)
    assert pauses.is_paused("default") and not pauses.is_paused("emails")
    assert pauses.paused_queues() == ["default"]


@db
def test_pausing_a_paused_queue_changes_nothing_and_returns_false():
    pauses.pause("default")
    first = PausedQueue.objects.get().paused_at
    assert pauses.pause("default") is False
    assert PausedQueue.objects.get().paused_at == first


@db
def test_resume_returns_whether_the_queue_was_paused():
    pauses.pause("default")
    assert pauses.resume("default") is True
    assert not pauses.is_paused("default") and pauses.paused_queues() == []
    assert pauses.resume("default") is False
    assert pauses.resume("never-paused") is False


@db
def test_resume_all_resumes_every_paused_queue():
    jobs.record.using(queue="emails").enqueue("a")
    pauses.pause_many(["default", "emails"])
    assert pauses.resume_all() == ["default", "emails"]
    assert pauses.paused_queues() == [] and pauses.resume_all() == []


@db
def test_an_unknown_queue_is_an_error_that_names_the_known_ones_and_pauses_nothing():
    jobs.record.using(queue="emails").enqueue("a")
    with pytest.raises(UnknownQueue) as info:
        pauses.pause("emials")
    message = str(info.value)
    assert "unknown queue 'emials'" in message
    assert "known queues: " in message and "default" in message
    assert "force=True (queue_pause --force)" in message
    assert isinstance(info.value, ValueError)
    assert pauses.paused_queues() == []


@db
def test_one_unknown_name_among_several_pauses_none_of_them():
    with pytest.raises(UnknownQueue, match="'nope', 'nada'"):
        pauses.pause_many(["default", "nope", "nada"])
    assert pauses.paused_queues() == []


@db
def test_force_pauses_a_queue_nothing_uses_yet():
    assert pauses.pause("tomorrow", force=True) is True
    assert pauses.paused_queues() == ["tomorrow"]
    # Paused, so known: pausing it again is no error.
    assert pauses.pause("tomorrow") is False


@pytest.mark.parametrize("name", ["", "bad name", "x" * 101, None])
@db
def test_an_invalid_name_is_a_value_error_for_pause_and_resume(name):
    with pytest.raises(ValueError):
        pauses.pause(name, force=True)
    with pytest.raises(ValueError):
        pauses.resume(name)
    assert not PausedQueue.objects.exists()


@db
def test_queues_are_known_from_definitions_jobs_failed_jobs_workers_and_the_default(reports_definition):
    assert pauses.is_known("default")  # DBQUEUE["QUEUE"]
    assert pauses.is_known("reports")  # a job definition's queue
    jobs.record.using(queue="adhoc").enqueue("a")
    assert pauses.is_known("adhoc")  # holds a job
    make_failed("f", queue="graveyard")
    assert pauses.is_known("graveyard")  # holds a failed job
    worker_row("w1", "default,served")
    assert pauses.is_known("served")  # served by a live worker
    worker_row("w2", "long-gone", seen_seconds_ago=3600)
    assert not pauses.is_known("long-gone")  # only by a dead one
    assert not pauses.is_known("emials")


@pytest.mark.skipif(django.VERSION < (6, 0), reason="django.tasks is new in Django 6.0")
@db
def test_the_queues_of_the_tasks_backend_are_known():
    # tests/settings.py: TASKS["default"]["QUEUES"] = ["default", "high", "low"]
    assert {"high", "low"} <= pauses.known_queues()


@db
def test_with_queues_set_only_the_listed_queues_are_known():
    jobs.record.using(queue="adhoc").enqueue("a")
    with with_queues("default", "emails"):
        assert pauses.pause("emails") is True  # listed, though nothing uses it
        with pytest.raises(UnknownQueue, match="DBQUEUE\\['QUEUES'\\] lists default, emails"):
            pauses.pause("adhoc")  # holds a job, but is not listed
        assert pauses.pause("adhoc", force=True) is True
    assert pauses.paused_queues() == ["adhoc", "emails"]


@db
def test_enqueueing_into_a_paused_queue_works():
    pauses.pause("default")
    jobs.record.enqueue("a")
    enqueue_many(jobs.record.bind(f"b{index}") for index in range(3))
    assert Job.objects.filter(queue="default").count() == 4


@db
def test_a_pause_made_elsewhere_holds_for_claims_that_start_pause_check_after_it():
    first, second = jobs.record.enqueue("a"), jobs.record.enqueue("b")
    assert claims.paused(connection.alias) == frozenset()
    # Another process pauses the queue: this one is not told, and reads it again when its read is PAUSE_CHECK old.
    PausedQueue.objects.create(queue="default", paused_at=timezone.now())
    assert claims.reserve(["default"]).pk == first.pk
    read_at, read = claims._paused[connection.alias]
    claims._paused[connection.alias] = (read_at - claims.PAUSE_CHECK, read)
    assert claims.paused(connection.alias) == frozenset({"default"})
    assert claims.reserve(["default"]) is None
    assert claims.reserve_many(["default"], limit=5) == []
    # A resume made in this process is seen by its next claim.
    pauses.resume("default")
    assert claims.reserve(["default"]).pk == second.pk


@db
def test_a_notification_naming_a_queue_read_as_paused_makes_the_next_claim_read_again():
    PausedQueue.objects.create(queue="reports", paused_at=timezone.now())
    assert claims.paused(connection.alias) == frozenset({"reports"})
    PausedQueue.objects.all().delete()
    claims.forget_paused(["default", "emails"])  # new jobs elsewhere: the read stands
    assert claims.paused(connection.alias) == frozenset({"reports"})
    claims.forget_paused(["reports"])  # the resume's NOTIFY
    assert claims.paused(connection.alias) == frozenset()


@db
def test_a_worker_whose_first_queue_is_paused_finishes_its_batch_and_claims_from_the_next():
    jobs.record.enqueue("a")
    done = claims.reserve_many(["default"], limit=1, worker_id="w")
    jobs.record.enqueue("b")
    low = jobs.record.using(queue="low").enqueue("c")
    pauses.pause("default", force=True)
    deleted, claimed = claims.finish_and_reserve(done, ["default", "low"], limit=5, worker_id="w")
    assert deleted == {job.pk for job in done} and len(done) == 1
    assert [job.pk for job in claimed] == [low.pk]
    assert list(Job.objects.filter(queue="default").values_list("attempts", flat=True)) == [0]


@db
def test_signals_are_sent_once_per_change(sent):
    pauses.pause("default")
    pauses.pause("default")
    pauses.resume("default")
    pauses.resume("default")
    assert sent == [("paused", "default"), ("resumed", "default")]


@db
def test_a_receiver_that_raises_is_logged_and_the_pause_stands(caplog):
    def broken(sender: Any, **kwargs: Any) -> None:
        raise RuntimeError("receiver broke")

    queue_paused.connect(broken)
    try:
        with caplog.at_level(logging.INFO, logger="django_dbqueue"):
            assert pauses.pause("default") is True
    finally:
        queue_paused.disconnect(broken)
    assert pauses.is_paused("default")
    messages = [record.getMessage() for record in caplog.records]
    assert "queue paused queue=default" in messages
    assert any("receiver" in message and "raised" in message for message in messages)


def test_the_package_root_exports_the_api():
    assert django_dbqueue.pause_queue is pauses.pause
    assert django_dbqueue.resume_queue is pauses.resume
    assert django_dbqueue.paused_queues is pauses.paused_queues
    assert {"pause_queue", "resume_queue", "paused_queues"} <= set(django_dbqueue.__all__)


@db
def test_the_overview_lists_a_paused_queue_without_jobs():
    jobs.record.enqueue("a")
    pauses.pause("emails", force=True)
    stats = {item.queue: item for item in operations.queue_overview()}
    assert stats["emails"].paused and stats["emails"].size == 0
    assert not stats["default"].paused and stats["default"].waiting == 1


# -- commands ------------------------------------------------------------------


def run(name: str, *args: str) -> str:
    out = io.StringIO()
    call_command(name, *args, stdout=out, stderr=io.StringIO())
    return out.getvalue()


def exit_code(monkeypatch: pytest.MonkeyPatch, *argv: str) -> int:
    """Run a command as ``manage.py`` does; return its exit status."""
    # run_from_argv closes every connection when it ends, the test's transaction with them.
    monkeypatch.setattr(connections, "close_all", lambda: None)
    command = load_command_class("django_dbqueue", argv[0])
    command.stdout, command.stderr = OutputWrapper(io.StringIO()), OutputWrapper(io.StringIO())
    try:
        # The system checks would query every alias, the replica too, which this test may not.
        command.run_from_argv(["manage.py", *argv, "--skip-checks"])
    except SystemExit as exc:
        return int(exc.code or 0)
    return 0


@db
def test_queue_pause_says_what_changed():
    jobs.record.using(queue="emails").enqueue("a")
    assert run("queue_pause", "emails") == "Paused queue 'emails'.\n"
    assert run("queue_pause", "emails", "default") == ("Queue 'emails' was already paused.\nPaused queue 'default'.\n")
    assert pauses.paused_queues() == ["default", "emails"]


@db
def test_queue_pause_of_an_unknown_queue_exits_1_and_pauses_none_of_the_names(monkeypatch):
    with pytest.raises(CommandError) as info:
        run("queue_pause", "default", "emials")
    assert str(info.value).startswith("Nothing was paused: unknown queue 'emials'")
    assert "--force" in str(info.value)
    assert exit_code(monkeypatch, "queue_pause", "default", "emials") == 1
    assert pauses.paused_queues() == []


@db
def test_queue_pause_force_pauses_an_unknown_queue():
    assert run("queue_pause", "--force", "tomorrow") == "Paused queue 'tomorrow'.\n"
    assert pauses.is_paused("tomorrow")


@db
def test_queue_pause_refuses_an_invalid_name_before_any_query():
    with pytest.raises(CommandError, match="may hold only letters"):
        run("queue_pause", "not/ok")
    assert pauses.paused_queues() == []


@db
def test_queue_resume_says_what_changed():
    pauses.pause("default")
    assert run("queue_resume", "default", "emails") == ("Resumed queue 'default'.\nQueue 'emails' was not paused.\n")
    assert pauses.paused_queues() == []


@db
def test_queue_resume_all():
    jobs.record.using(queue="emails").enqueue("a")
    pauses.pause_many(["default", "emails"])
    assert run("queue_resume", "--all") == "Resumed queue 'default'.\nResumed queue 'emails'.\n"
    assert run("queue_resume", "--all") == "No queue was paused.\n"


@pytest.mark.parametrize("args", [[], ["--all", "default"]])
def test_queue_resume_needs_names_or_all_but_not_both(args):
    with pytest.raises(CommandError, match="Name the queues to resume, or pass --all"):
        run("queue_resume", *args)


@db
def test_queue_monitor_marks_paused_queues_and_lists_empty_ones():
    jobs.record.enqueue("a")
    pauses.pause("default")
    pauses.pause("tomorrow", force=True)
    lines = run("queue_monitor").splitlines()
    assert [line.split()[:2] for line in lines[1:3]] == [["default", "1"], ["tomorrow", "0"]]
    assert lines[3:] == [
        "Queue 'default' is paused: no worker claims its jobs until queue_resume default.",
        "Queue 'tomorrow' is paused: no worker claims its jobs until queue_resume tomorrow.",
    ]


# -- the admin -----------------------------------------------------------------


@db
def test_the_overview_shows_which_queues_are_paused(admin):
    jobs.record.enqueue("a")
    pauses.pause("emails", force=True)
    response = admin.get(OVERVIEW)
    rows = {row.queue: row for row in response.context["rows"]}
    assert rows["emails"].paused and rows["emails"].waiting == 0
    assert not rows["default"].paused
    page = response.content.decode()
    assert "<strong>Paused</strong> since" in page
    assert f'action="{PAUSE}"' in page and f'action="{RESUME}"' in page


@db
def test_a_user_with_pause_queue_pauses_and_resumes_from_the_overview(staff):
    jobs.record.enqueue("a")
    client = staff("view_job", "pause_queue")
    response = client.post(PAUSE, {"queue": "default"}, follow=True)
    assert response.redirect_chain == [(OVERVIEW, 302)]
    assert pauses.is_paused("default")
    assert "Paused queue &#x27;default&#x27;" in response.content.decode()
    response = client.post(RESUME, {"queue": "default"}, follow=True)
    assert response.redirect_chain == [(OVERVIEW, 302)]
    assert not pauses.is_paused("default")
    assert "Resumed queue &#x27;default&#x27;" in response.content.decode()


@db
def test_an_unknown_queue_posted_to_pause_is_refused_with_a_message(staff):
    response = staff("view_job", "pause_queue").post(PAUSE, {"queue": "emials"}, follow=True)
    assert "Nothing was paused: unknown queue" in response.content.decode()
    assert pauses.paused_queues() == []


@db
def test_without_pause_queue_the_buttons_are_hidden_and_a_post_is_refused(staff):
    jobs.record.enqueue("a")
    pauses.pause("emails", force=True)
    client = staff("view_job")
    page = client.get(OVERVIEW).content.decode()
    assert "<strong>Paused</strong> since" in page  # the state is shown
    assert PAUSE not in page and RESUME not in page
    assert client.post(PAUSE, {"queue": "default"}).status_code == 403
    assert client.post(RESUME, {"queue": "emails"}).status_code == 403
    assert pauses.paused_queues() == ["emails"]


@db
def test_a_user_who_may_only_pause_sees_the_queue_names_to_pause(staff):
    jobs.record.using(queue="emails").enqueue("a")
    response = staff("pause_queue").get(OVERVIEW)
    assert response.status_code == 200
    rows = response.context["rows"]
    assert [(row.queue, row.waiting) for row in rows] == [("emails", None)]


@db
def test_a_get_of_the_pause_and_resume_urls_changes_nothing(admin):
    jobs.record.enqueue("a")
    assert admin.get(PAUSE, {"queue": "default"}).status_code == 405
    pauses.pause("emails", force=True)
    assert admin.get(RESUME, {"queue": "emails"}).status_code == 405
    assert pauses.paused_queues() == ["emails"]


@db
def test_a_pause_without_a_csrf_token_is_refused(admin_user):
    jobs.record.enqueue("a")
    client = Client(enforce_csrf_checks=True)
    client.force_login(admin_user)
    assert client.post(PAUSE, {"queue": "default"}).status_code == 403
    assert not pauses.is_paused("default")
    # The overview's form carries the token.
    client.get(OVERVIEW)
    token = client.cookies["csrftoken"].value
    response = client.post(PAUSE, {"queue": "default", "csrfmiddlewaretoken": token})
    assert response.status_code == 302 and pauses.is_paused("default")


@db
def test_a_resume_without_a_csrf_token_is_refused():
    pauses.pause("default")
    user = User.objects.create_superuser("root", password="pw")
    client = Client(enforce_csrf_checks=True)
    client.force_login(user)
    assert client.post(RESUME, {"queue": "default"}).status_code == 403
    assert pauses.is_paused("default")


# -- real workers --------------------------------------------------------------


def total_runs(prefix: str) -> int:
    return Run.objects.filter(key__startswith=prefix).count()


def untouched(queue: str, count: int) -> bool:
    """The ``count`` jobs of ``queue`` are all there, and none was ever reserved (attempts is never reset)."""
    jobs = Job.objects.filter(queue=queue)
    return jobs.count() == count and not jobs.filter(attempts__gt=0).exists()


@pytest.mark.one_django
@pytest.mark.acceptance
@pytest.mark.django_db(transaction=True)
def test_workers_leave_a_paused_queue_alone_while_they_drain_another_and_drain_it_once_resumed(worker_process):
    size = 40 if connection.vendor == "sqlite" else 100
    workers = [worker_process("--queue", "reports,default", "--sleep", "0.05") for _ in range(2)]
    for process in workers:
        process.wait_for_output("worker started")
    # Paused while the workers run; once their processes' reads of the paused queues are
    # PAUSE_CHECK old, filled at once: every claim must skip it.
    pauses.pause("reports", force=True)
    time.sleep(claims.PAUSE_CHECK + 0.5)
    enqueue_many(jobs.record.using(queue="reports").bind(f"reports-{index}") for index in range(size))
    enqueue_many(jobs.record.bind(f"default-{index}") for index in range(size))
    wait_until(lambda: total_runs("default-") == size, 60, "the workers did not drain the queue 'default'")
    # Five seconds more of idle workers polling every 50 ms: still nothing of 'reports' taken.
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        assert untouched("reports", size), "a worker claimed a job of the paused queue"
        time.sleep(0.1)
    assert total_runs("reports-") == 0
    # Enqueueing into the paused queue still works.
    jobs.record.using(queue="reports").enqueue("reports-late")
    assert Job.objects.filter(queue="reports").count() == size + 1
    time.sleep(1)
    assert untouched("reports", size + 1)

    assert pauses.resume("reports") is True
    wait_until(lambda: not Job.objects.exists(), 60, "the workers did not drain the resumed queue")
    assert total_runs("reports-") == size + 1
    for process in workers:
        process.signal(signal.SIGTERM)
    for process in workers:
        assert process.wait(timeout=30) == 0, process.output()


@pytest.mark.one_django
@pytest.mark.acceptance
@pytest.mark.django_db(transaction=True)
def test_a_job_running_when_its_queue_is_paused_finishes_and_the_next_waits(worker_process):
    process = worker_process("--queue", "reports", "--sleep", "0.05")
    process.wait_for_output("worker started")
    jobs.sleep_then_record.using(queue="reports").enqueue("running", 2)
    wait_until(lambda: Job.objects.filter(queue="reports", reserved_at__isnull=False).exists(), 30, "never started")
    pauses.pause("reports")
    time.sleep(claims.PAUSE_CHECK + 0.5)
    jobs.record.using(queue="reports").enqueue("waiting")
    wait_until(lambda: Run.objects.filter(key="running").exists(), 30, "the running job did not finish")
    time.sleep(1)
    assert list(Job.objects.values_list("queue", "attempts")) == [("reports", 0)]
    assert not Run.objects.filter(key="waiting").exists()
    pauses.resume("reports")
    wait_until(lambda: Run.objects.filter(key="waiting").exists(), 30, "the resumed queue was not served")
    process.signal(signal.SIGTERM)
    assert process.wait(timeout=30) == 0, process.output()


@pytest.mark.one_django
@pytest.mark.django_db(transaction=True)
@needs_listen
def test_a_resume_wakes_an_idle_listening_worker_which_reads_the_pause_again_and_claims_at_once(worker_process):
    pauses.pause("reports", force=True)
    jobs.record.using(queue="reports").enqueue("resumed")
    process = worker_process("--queue", "reports", "--sleep", "60")
    process.wait_for_output("worker started")
    time.sleep(1)  # idle: its claim found the queue paused, and it waits for a NOTIFY or 60 s
    assert not Run.objects.filter(key="resumed").exists()
    started = time.monotonic()
    pauses.resume("reports")
    wait_until(lambda: Run.objects.filter(key="resumed").exists(), 20, f"not woken:\n{process.output()}")
    # Woken by the resume's NOTIFY (which also drops a read of the paused queues younger than PAUSE_CHECK).
    assert time.monotonic() - started < 5
