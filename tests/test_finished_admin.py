"""The finished jobs' admin pages (admin/finished.py): the list and its search, each run's page with
its stored result, enqueue again (permissions, CSRF), and a list that never counts the whole table."""

from __future__ import annotations

import re
from collections.abc import Iterator
from datetime import timedelta

import pytest
from django.db import connection
from django.test import Client, override_settings
from django.test.utils import CaptureQueriesContext
from django.urls import reverse
from django.utils import timezone

from django_dbqueue import lifecycle
from django_dbqueue.admin import finished as finished_admin
from django_dbqueue.models import FinishedJob, Job
from tests.conftest import run_worker
from tests.testapp import jobs

pytestmark = pytest.mark.django_db

KEEP = {"DBQUEUE": {"KEEP_FINISHED": 24, "SLEEP": 0.05, "RETRY_AFTER": 60, "TIMEOUT": 30}}
LIST = reverse("admin:django_dbqueue_finishedjob_changelist")


@pytest.fixture
def keep() -> Iterator[None]:
    with override_settings(**KEEP):
        yield


@pytest.fixture
def history(keep: None) -> dict[str, FinishedJob]:
    """Four finished runs: two additions and a record that succeeded, a failure, and a cancelled job."""
    jobs.add.enqueue(1, 2)
    jobs.add.enqueue(40, 2)
    jobs.record.enqueue("eu", note="42")
    jobs.always_fail.using(tries=1).enqueue("f1")
    cancelled = jobs.record.enqueue("never")
    assert lifecycle.cancel(cancelled.id, reason="not needed") == "cancelled"
    run_worker()
    rows = {str(row.payload["args"][0]): row for row in FinishedJob.objects.all()}
    assert len(rows) == 5
    return rows


def found(client: Client, **params: str) -> list[int]:
    response = client.get(LIST, params)
    assert response.status_code == 200
    return sorted(row.pk for row in response.context["cl"].result_list)


def messages_of(response) -> list[str]:
    """The messages a page showed (``follow=True`` for those of a redirect's page)."""
    return [str(message) for message in response.context["messages"]]


def again(row: FinishedJob) -> str:
    return reverse("admin:django_dbqueue_finishedjob_enqueue_again", args=[row.pk])


def pks(*rows: FinishedJob) -> list[int]:
    return sorted(row.pk for row in rows)


def test_the_list_shows_each_run_newest_first_with_its_outcome(admin, history):
    response = admin.get(LIST)
    page = response.content.decode()
    shown = [row.pk for row in response.context["cl"].result_list]
    assert shown == list(FinishedJob.objects.order_by("-finished_at", "-id").values_list("pk", flat=True))
    for text in ("tests.add", "succeeded", "failed", "cancelled", str(history["1"].job_id), history["1"].worker):
        assert text in page
    assert "5 finished jobs" in page and 'id="history-off"' not in page


def test_the_filters_select_by_name_queue_outcome_job_id_and_time(admin, history):
    ok, failed, cancelled = history["40"], history["f1"], history["never"]
    assert found(admin, name="tests.add") == pks(history["1"], ok)
    assert found(admin, name="tests.ad") == []  # exact: the index on (name, finished_at) answers
    assert found(admin, queue="default") == pks(*history.values()) and found(admin, queue="emails") == []
    assert found(admin, outcome__exact="failed") == [failed.pk]
    assert found(admin, outcome__exact="cancelled") == [cancelled.pk]
    assert found(admin, job_id=str(ok.job_id)) == [ok.pk]
    day = timezone.localdate(ok.finished_at).isoformat()  # a date: its day in the current time zone
    assert found(admin, since=day, until=day) == pks(*history.values())
    assert found(admin, until="2000-01-31") == [] and found(admin, since="2000-01-31 14:00") == pks(*history.values())
    minute = timezone.localtime(ok.finished_at).replace(second=0, microsecond=0)
    assert found(admin, since=f"{minute:%Y-%m-%d %H:%M}") == pks(*history.values())
    assert found(admin, since=f"{minute + timedelta(minutes=1):%Y-%m-%d %H:%M}") == []


def test_the_search_box_reads_arguments_as_json(admin, history):
    assert found(admin, q="40") == [history["40"].pk]
    assert found(admin, q="[2, 1]") == [history["1"].pk]
    assert found(admin, q='{"note": "42"}') == [history["eu"].pk]
    assert found(admin, q='["f1"]') == [history["f1"].pk]
    assert found(admin, q='{"note": "43"}') == []
    assert found(admin, q="40", name="tests.add", outcome__exact="succeeded") == [history["40"].pk]


def test_text_that_is_not_json_is_said_as_an_error_not_a_server_error(admin, history):
    response = admin.get(LIST, {"q": "order_id=42"})
    assert response.status_code == 200 and list(response.context["cl"].result_list) == []
    assert any("must be JSON" in message for message in messages_of(response))
    response = admin.get(LIST, {"since": "yesterday"})
    assert response.status_code == 200 and list(response.context["cl"].result_list) == []
    assert any("finished since: use a date" in message for message in messages_of(response))
    assert any("a job id is a number" in message for message in messages_of(admin.get(LIST, {"job_id": "abc"})))


def test_with_the_history_off_the_list_says_how_to_turn_it_on(admin):
    page = admin.get(LIST).content.decode()
    assert 'id="history-off"' in page and "KEEP_FINISHED" in page


def test_the_list_never_counts_the_whole_table(admin, history, monkeypatch):
    with CaptureQueriesContext(connection) as queries:
        admin.get(LIST)
    table = connection.ops.quote_name(FinishedJob._meta.db_table)
    counts = [query["sql"] for query in queries.captured_queries if "COUNT(" in query["sql"].upper()]
    counts = [sql for sql in counts if table in sql]
    assert len(counts) == 1 and "LIMIT" in counts[0].upper(), counts
    # No filter reads its choices from the table (as a list filter on a column would: DISTINCT).
    assert not [query for query in queries.captured_queries if "DISTINCT" in query["sql"].upper()]
    monkeypatch.setattr(finished_admin, "COUNT_LIMIT", 2)
    monkeypatch.setattr(finished_admin.CappedPaginator, "limit", "2")
    page = admin.get(LIST).content.decode()
    assert "More than 2 finished jobs" in page


def test_the_page_of_a_run_shows_its_payload_error_and_stored_result(admin, keep):
    kept = jobs.keep_result.enqueue(5)
    jobs.always_fail.using(tries=1).enqueue("f1")
    run_worker()
    with_result = FinishedJob.objects.get(job_id=kept.id)
    failed = FinishedJob.objects.get(outcome="failed")
    page = admin.get(reverse("admin:django_dbqueue_finishedjob_change", args=[with_result.pk])).content.decode()
    assert "&quot;x&quot;: 5" in page and "2030-01-02" in page and "succeeded, returned:" in page
    assert "&quot;args&quot;: [\n    5\n  ]" in page
    page = admin.get(reverse("admin:django_dbqueue_finishedjob_change", args=[failed.pk])).content.decode()
    assert "not stored" in page and "f1 always fails" in page and "Traceback" in page
    assert 'id="enqueue-again"' in page


def test_nobody_adds_changes_or_deletes_a_row_by_hand(admin, history):
    row = history["1"]
    assert admin.get(reverse("admin:django_dbqueue_finishedjob_add")).status_code == 403
    assert admin.get(reverse("admin:django_dbqueue_finishedjob_delete", args=[row.pk])).status_code == 403
    actions = admin.get(LIST).context["action_form"].fields["action"].choices
    assert [name for name, _ in actions if name] == ["enqueue_again_selected"]


def test_enqueue_again_from_a_runs_page_says_the_new_jobs_id(admin, history):
    row = history["40"]
    response = admin.post(again(row), follow=True)
    job = Job.objects.get()
    assert (job.name, job.pk != row.job_id) == ("tests.add", True)
    assert f"1 finished job was enqueued again: job {job.pk}." in messages_of(response)
    assert admin.get(again(row)).status_code == 405


def test_the_enqueue_again_action_enqueues_each_selected_run(admin, history):
    selected = [history["1"].pk, history["eu"].pk]
    response = admin.post(LIST, {"action": "enqueue_again_selected", "_selected_action": selected}, follow=True)
    ids = sorted(Job.objects.values_list("pk", flat=True))
    assert len(ids) == 2
    assert f"2 finished jobs were enqueued again: jobs {ids[0]}, {ids[1]}." in messages_of(response)


def test_a_run_that_cannot_be_enqueued_again_is_said_as_an_error(admin, history):
    row = history["1"]
    FinishedJob.objects.filter(pk=row.pk).update(name="tests.gone")
    response = admin.post(again(row), follow=True)
    assert response.status_code == 200 and not Job.objects.exists()
    assert any("no job is registered as 'tests.gone'" in message for message in messages_of(response))


def test_a_staff_user_needs_the_view_permission_to_see_the_list(staff, history):
    assert staff().get(LIST).status_code == 403
    assert staff("view_job").get(LIST).status_code == 403
    viewer = staff("view_finishedjob")
    assert viewer.get(LIST).status_code == 200
    assert viewer.get(reverse("admin:django_dbqueue_finishedjob_change", args=[history["1"].pk])).status_code == 200


def test_enqueue_again_needs_the_add_job_permission(staff, history):
    row = history["1"]
    viewer = staff("view_finishedjob")
    page = viewer.get(reverse("admin:django_dbqueue_finishedjob_change", args=[row.pk])).content.decode()
    assert 'id="enqueue-again"' not in page
    assert viewer.get(LIST).context["action_form"] is None  # no action
    assert viewer.post(again(row)).status_code == 403
    viewer.post(LIST, {"action": "enqueue_again_selected", "_selected_action": [row.pk]})
    assert staff("add_job").post(again(row)).status_code == 403
    assert not Job.objects.exists()
    allowed = staff("view_finishedjob", "add_job")
    assert allowed.post(again(row)).status_code == 302
    assert Job.objects.count() == 1


def test_enqueue_again_is_csrf_protected(admin_user, history):
    client = Client(enforce_csrf_checks=True)
    client.force_login(admin_user)
    row = history["1"]
    assert client.post(again(row)).status_code == 403
    assert client.post(LIST, {"action": "enqueue_again_selected", "_selected_action": [row.pk]}).status_code == 403
    assert not Job.objects.exists()
    page = client.get(reverse("admin:django_dbqueue_finishedjob_change", args=[row.pk])).content.decode()
    token = re.search(r'name="csrfmiddlewaretoken" value="([^"]+)"', page)
    assert token is not None
    assert client.post(again(row), {"csrfmiddlewaretoken": token.group(1)}).status_code == 302
    assert Job.objects.count() == 1
