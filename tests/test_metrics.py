"""The Prometheus / OpenMetrics view: figures read back with prometheus_client's own parsers,
who may read them, and what it does without prometheus_client."""

from __future__ import annotations

import sys
from datetime import UTC, datetime, timedelta

import prometheus_client
import pytest
from django.contrib.auth.models import Permission, User
from django.db import DatabaseError
from django.db.models.functions import Now
from django.test import Client, override_settings
from django.urls import include, path, reverse
from django.utils import timezone
from prometheus_client.openmetrics.parser import text_string_to_metric_families as openmetrics_families
from prometheus_client.parser import text_string_to_metric_families

from django_dbqueue import claims, history, metrics, pauses
from django_dbqueue.checks import check_metrics_extra
from django_dbqueue.models import Job, JobHistory, QueueWorker
from tests.conftest import run_worker
from tests.testapp import jobs

# The monitoring views are opt-in: this module mounts them for its own tests.
urlpatterns = [path("queue/", include("django_dbqueue.metrics_urls"))]

# The figures do not depend on Django's version: scripts/test runs these with one.
pytestmark = [pytest.mark.django_db, pytest.mark.urls(__name__), pytest.mark.one_django]

TOKEN = "s3cret-metrics-token-0123456789"
WITH_TOKEN = override_settings(DBQUEUE={"METRICS_TOKEN": TOKEN})

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def url() -> str:
    return reverse("dbqueue_metrics:metrics")


def scrape(accept: str = "") -> str:
    with WITH_TOKEN:
        response = Client().get(url(), HTTP_AUTHORIZATION=f"Bearer {TOKEN}", HTTP_ACCEPT=accept)
    assert response.status_code == 200, response.content
    assert response["Cache-Control"] == "no-store"
    return response.content.decode()


def samples(text: str, parse=text_string_to_metric_families) -> Samples:
    """Every sample of the exposition text, by name and labels."""
    return {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in parse(text)
        for sample in family.samples
    }


def value(found: Samples, metric: str, /, **labels: str) -> float:
    return found[(metric, frozenset(labels.items()))]


def user_client(*codenames: str) -> Client:
    user = User.objects.create_user(f"user{User.objects.count()}")
    user.user_permissions.set(
        Permission.objects.filter(content_type__app_label="django_dbqueue", codename__in=codenames)
    )
    client = Client()
    client.force_login(user)
    return client


def viewer() -> Client:
    """A user who may read the metrics: view_job and view_failedjob."""
    return user_client("view_job", "view_failedjob")


def add_worker(name: str, *, seconds_ago: float = 0, running: int = 0, queues: str = "default") -> QueueWorker:
    seen = timezone.now() - timedelta(seconds=seconds_ago)
    return QueueWorker.objects.create(
        worker_id=name, hostname="elsewhere", pid=1, queues=queues, started_at=seen, last_seen_at=seen, running=running
    )


def test_the_counters_and_the_histogram_are_the_sums_of_the_history_rows():
    minute = datetime(2026, 1, 1, 12, 0, tzinfo=UTC)
    bins = dict.fromkeys(history.BINS, 0)
    JobHistory.objects.create(
        bucket=minute, queue="emails", name="send", started=4, succeeded=3, failed=0, retried=1, run_time=1.5,
        **{**bins, "h0": 2, "h7": 1, "h12": 1},
    )  # fmt: skip
    JobHistory.objects.create(
        bucket=minute + timedelta(minutes=1), queue="emails", name="send", started=2, succeeded=1, failed=1,
        run_time=70.25, **{**bins, "h7": 1, "h12": 1},
    )  # fmt: skip
    JobHistory.objects.create(bucket=minute, queue="default", name="send", started=1, succeeded=1, **bins)
    found = samples(scrape())
    send = {"queue": "emails", "name": "send"}
    assert value(found, "dbqueue_jobs_started_total", **send) == 6
    assert value(found, "dbqueue_jobs_succeeded_total", **send) == 4
    assert value(found, "dbqueue_jobs_failed_total", **send) == 1
    assert value(found, "dbqueue_jobs_retried_total", **send) == 1
    assert value(found, "dbqueue_jobs_started_total", queue="default", name="send") == 1
    # Cumulative buckets at history.BOUNDS: 2 runs <= 5 ms, 2 more <= 1 s, 2 longer than 60 s.
    expected = [2, 2, 2, 2, 2, 2, 2, 4, 4, 4, 4, 4]
    buckets = [value(found, "dbqueue_job_run_time_seconds_bucket", **send, le=str(bound)) for bound in history.BOUNDS]
    assert buckets == expected
    assert value(found, "dbqueue_job_run_time_seconds_bucket", **send, le="+Inf") == 6
    assert value(found, "dbqueue_job_run_time_seconds_count", **send) == 6
    assert value(found, "dbqueue_job_run_time_seconds_sum", **send) == pytest.approx(71.75)


def test_job_names_past_the_limit_are_summed_under_one_series(monkeypatch):
    monkeypatch.setattr(metrics, "MAX_NAMES", 3)
    minute = datetime(2026, 1, 1, 12, 0, tzinfo=UTC)
    bins = dict.fromkeys(history.BINS, 0)
    # A registered name sorts last but keeps its series; rows of names no code defines
    # (written by raw SQL, say) get the places left, by name, and the rest share one.
    names = ["raw.a", "raw.b", "raw.c", "raw.d", jobs.record.name]
    for index, name in enumerate(names):
        for queue in ("default", "emails"):
            JobHistory.objects.create(
                bucket=minute, queue=queue, name=name, started=index + 1, succeeded=index + 1, run_time=0.5,
                **{**bins, "h3": index + 1},
            )  # fmt: skip
    found = samples(scrape())
    labelled = {dict(labels)["name"] for metric, labels in found if metric == "dbqueue_jobs_started_total"}
    assert labelled == {jobs.record.name, "raw.a", "raw.b", metrics.OTHER_NAME}
    for queue in ("default", "emails"):
        other = {"queue": queue, "name": metrics.OTHER_NAME}
        assert value(found, "dbqueue_jobs_started_total", **other) == 3 + 4  # raw.c and raw.d
        assert value(found, "dbqueue_job_run_time_seconds_count", **other) == 3 + 4
        assert value(found, "dbqueue_job_run_time_seconds_sum", **other) == pytest.approx(1.0)
        assert value(found, "dbqueue_jobs_started_total", queue=queue, name=jobs.record.name) == 5


def test_the_gauges_count_jobs_per_queue_and_state_failed_jobs_paused_queues_and_workers():
    now = timezone.now()
    for key in ("a", "b"):
        jobs.record.enqueue(key)
    Job.objects.filter(queue="default").update(available_at=Now() - timedelta(seconds=120))
    jobs.record.using(delay=3600).enqueue("later")
    jobs.record.using(queue="emails").enqueue("c")
    reserved = claims.reserve(["emails"])
    assert reserved is not None
    jobs.always_fail.using(queue="reports", tries=1).enqueue("x")
    run_worker(queues=["reports"])
    pauses.pause("reports")
    add_worker("live-1", running=2, queues="default,idle")
    add_worker("live-2", running=1)
    add_worker("gone", seconds_ago=3600, running=5, queues="ghost")

    found = samples(scrape())
    state = {
        (queue, name): value(found, "dbqueue_jobs", queue=queue, state=name)
        for queue in ("default", "emails", "reports")
        for name in metrics.STATES
    }
    assert state == {
        ("default", "waiting"): 2, ("default", "delayed"): 1, ("default", "blocked"): 0, ("default", "reserved"): 0,
        ("emails", "waiting"): 0, ("emails", "delayed"): 0, ("emails", "blocked"): 0, ("emails", "reserved"): 1,
        ("reports", "waiting"): 0, ("reports", "delayed"): 0, ("reports", "blocked"): 0, ("reports", "reserved"): 0,
    }  # fmt: skip
    age = value(found, "dbqueue_oldest_waiting_seconds", queue="default")
    assert 120 <= age < 120 + (timezone.now() - now).total_seconds() + 5
    assert value(found, "dbqueue_oldest_waiting_seconds", queue="emails") == 0
    assert value(found, "dbqueue_failed_jobs", queue="reports") == 1
    assert value(found, "dbqueue_failed_jobs", queue="default") == 0
    assert value(found, "dbqueue_queue_paused", queue="reports") == 1
    assert value(found, "dbqueue_queue_paused", queue="default") == 0
    # A queue only a live worker serves is listed with zeros; one only a dead worker served is not.
    assert value(found, "dbqueue_jobs", queue="idle", state="waiting") == 0
    assert ("dbqueue_jobs", frozenset({"queue": "ghost", "state": "waiting"}.items())) not in found
    assert value(found, "dbqueue_workers", state="live") == 2
    assert value(found, "dbqueue_workers", state="dead") == 1
    assert value(found, "dbqueue_running_jobs") == 3
    # The in-process worker wrote its history at its stop: one run, failed for good.
    failing = {"queue": "reports", "name": jobs.always_fail.name}
    assert value(found, "dbqueue_jobs_started_total", **failing) == 1
    assert value(found, "dbqueue_jobs_failed_total", **failing) == 1
    assert value(found, "dbqueue_jobs_succeeded_total", **failing) == 0
    assert value(found, "dbqueue_job_run_time_seconds_count", **failing) == 1


def test_counters_after_a_worker_ran_successes_retries_and_failures():
    for key in ("a", "b", "c"):
        jobs.record.enqueue(key)
    jobs.always_fail.enqueue("x")  # tries=2: retried once, then failed
    jobs.fail_once.enqueue("y")  # retried once, then succeeds
    run_worker()
    found = samples(scrape())
    counts = {
        name: tuple(
            value(found, f"dbqueue_jobs_{count}_total", queue="default", name=name)
            for count in ("started", "succeeded", "failed", "retried")
        )
        for name in (jobs.record.name, jobs.always_fail.name, jobs.fail_once.name)
    }
    assert counts == {
        jobs.record.name: (3, 3, 0, 0),
        jobs.always_fail.name: (2, 0, 1, 1),
        jobs.fail_once.name: (2, 1, 0, 1),
    }
    assert value(found, "dbqueue_job_run_time_seconds_count", queue="default", name=jobs.record.name) == 3
    assert value(found, "dbqueue_workers", state="live") == 0  # the worker removed its row at its stop


def test_openmetrics_is_served_when_the_accept_header_asks_for_it():
    jobs.record.enqueue("a")
    with WITH_TOKEN:
        response = Client().get(
            url(), HTTP_AUTHORIZATION=f"Bearer {TOKEN}", HTTP_ACCEPT="application/openmetrics-text; version=1.0.0"
        )
    assert response["Content-Type"].startswith("application/openmetrics-text")
    text = response.content.decode()
    assert text.endswith("# EOF\n") and "# UNIT dbqueue_oldest_waiting_seconds seconds" in text
    assert value(samples(text, openmetrics_families), "dbqueue_jobs", queue="default", state="waiting") == 1
    plain = Client().get(url(), HTTP_AUTHORIZATION=f"Bearer {TOKEN}")
    assert plain.status_code == 403  # outside WITH_TOKEN: no token is configured


def test_each_request_builds_its_own_registry_and_leaves_the_global_one_alone():
    first, second = scrape(), scrape()
    assert "dbqueue_workers" in first and first == second
    assert not any(name.startswith("dbqueue_") for name in prometheus_client.REGISTRY._names_to_collectors)


def test_an_anonymous_client_gets_401_and_no_figures():
    response = Client().get(url())
    assert response.status_code == 401 and response["WWW-Authenticate"].startswith("Bearer")
    assert "dbqueue_" not in response.content.decode()


def test_a_user_needs_the_view_job_and_view_failedjob_permissions():
    assert user_client().get(url()).status_code == 403
    assert user_client("view_jobprogress").get(url()).status_code == 403
    # The figures count failed jobs, which the admin shows only with view_failedjob.
    response = user_client("view_job").get(url())
    assert response.status_code == 403 and "dbqueue_" not in response.content.decode()
    assert "django_dbqueue.view_failedjob" in response.content.decode()
    assert user_client("view_failedjob").get(url()).status_code == 403
    response = viewer().get(url())
    assert response.status_code == 200 and "dbqueue_failed_jobs" in response.content.decode()


@WITH_TOKEN
def test_the_token_works_as_a_bearer_header_or_a_query_parameter():
    assert Client().get(url(), HTTP_AUTHORIZATION=f"Bearer {TOKEN}").status_code == 200
    assert Client().get(url(), HTTP_AUTHORIZATION=f"bearer {TOKEN}").status_code == 200
    assert Client().get(url(), {"token": TOKEN}).status_code == 200


@WITH_TOKEN
def test_a_wrong_token_is_refused_even_to_a_user_with_the_permission():
    for wrong in (TOKEN[:-1], TOKEN + "x", TOKEN.upper()):
        assert Client().get(url(), HTTP_AUTHORIZATION=f"Bearer {wrong}").status_code == 403, wrong
        assert Client().get(url(), {"token": wrong}).status_code == 403, wrong
    assert Client().get(url(), {"token": "é" * 40}).status_code == 403
    assert viewer().get(url(), {"token": "wrong"}).status_code == 403
    # Another scheme carries no token: the client is anonymous.
    assert Client().get(url(), HTTP_AUTHORIZATION=f"Basic {TOKEN}").status_code == 401


def test_no_token_opens_the_view_when_none_is_configured():
    assert Client().get(url(), {"token": ""}).status_code == 403
    assert Client().get(url(), {"token": "None"}).status_code == 403


def test_without_prometheus_client_the_view_answers_501_and_a_check_warns(monkeypatch):
    monkeypatch.setitem(sys.modules, "prometheus_client", None)
    response = viewer().get(url())
    assert response.status_code == 501 and "django-dbqueue[prometheus]" in response.content.decode()
    assert Client().get(url()).status_code == 401  # refused before anything else
    [warning] = check_metrics_extra()
    assert warning.id == "dbqueue.W008"


@pytest.mark.urls("tests.urls")
def test_no_warning_when_the_metrics_urls_are_not_mounted(monkeypatch):
    monkeypatch.setitem(sys.modules, "prometheus_client", None)
    assert check_metrics_extra() == []


def test_no_warning_when_prometheus_client_is_installed():
    assert check_metrics_extra() == []


def test_a_database_error_answers_503(monkeypatch):
    def broken() -> None:
        raise DatabaseError("server closed the connection")

    monkeypatch.setattr(metrics, "snapshot", broken)
    response = viewer().get(url())
    assert response.status_code == 503 and "DatabaseError" in response.content.decode()


@pytest.mark.parametrize("token", ["short", "", 12345678901234567890, " " + "x" * 20, "x" * 20 + "\n"])
def test_a_short_or_non_string_token_is_reported(token):
    from django_dbqueue.checks import check_settings

    with override_settings(DBQUEUE={"METRICS_TOKEN": token}):
        [message] = check_settings()
    assert message.id == "dbqueue.E003" and "METRICS_TOKEN" in message.msg


def test_the_post_method_is_refused():
    assert viewer().post(url()).status_code == 405


def test_the_check_is_registered():
    from django.core import checks

    assert check_metrics_extra in checks.registry.registry.get_checks(include_deployment_checks=False)


def test_head_is_answered_like_get():
    response = viewer().head(url())
    assert response.status_code == 200 and response.content == b""
