"""The admin pages through Django's test client: retry, permissions, CSRF, states, overview."""

import datetime as dt
import re

import pytest
from django.db import connection
from django.db.models import F
from django.db.models.functions import Now
from django.test import Client
from django.test.utils import CaptureQueriesContext
from django.urls import reverse

from django_dbqueue import claims, lifecycle
from django_dbqueue.models import FailedJob, Job, JobProgress
from tests.testapp import jobs

pytestmark = pytest.mark.django_db

FAILED_LIST = reverse("admin:django_dbqueue_failedjob_changelist")
JOB_LIST = reverse("admin:django_dbqueue_job_changelist")


def make_failed(key: str, queue: str = "default") -> FailedJob:
    """A failed job made the way the worker makes one."""
    jobs.always_fail.using(queue=queue).enqueue(key)
    job = claims.reserve([queue])
    failed = lifecycle.fail(
        job,
        error=f"Traceback (most recent call last):\n  ...\nValueError: {key} broke",
        exception_class="builtins.ValueError",
    )
    assert failed is not None
    return failed


def test_the_failed_job_list_shows_name_exception_and_the_errors_last_line(admin):
    make_failed("one")
    page = admin.get(FAILED_LIST).content.decode()
    assert "tests.testapp.jobs.always_fail" in page
    assert "builtins.ValueError" in page and "ValueError: one broke" in page


def test_the_failed_job_search_matches_name_queue_and_id_but_not_the_error_text(admin):
    failed = make_failed("one", queue="emails")
    other = make_failed("two")

    def found(term: str) -> list[int]:
        return [row.pk for row in admin.get(FAILED_LIST, {"q": term}).context["cl"].result_list]

    assert found("one broke") == [] and found("Traceback") == []
    assert found("emails") == [failed.pk]
    assert found(str(other.pk)) == [other.pk]
    assert sorted(found("always_fail")) == sorted([failed.pk, other.pk])


def test_the_job_search_matches_name_queue_and_id_but_not_the_payload(admin):
    row = jobs.add.using(queue="emails").enqueue(4242, 1)
    jobs.add.enqueue(1, 1)

    def found(term: str) -> list[int]:
        return [job.pk for job in admin.get(JOB_LIST, {"q": term}).context["cl"].result_list]

    assert found("4242") == [] and found("emails") == [row.pk] and found(str(row.pk)) == [row.pk]


def select_of(queries: CaptureQueriesContext, table: str) -> str:
    """The columns of the change list's SELECT of whole rows from ``table`` (the one that reads ``attempts``)."""
    selects = [
        query["sql"].split(f" FROM {quote(table)}", 1)[0]
        for query in queries.captured_queries
        if query["sql"].startswith("SELECT") and f"FROM {quote(table)}" in query["sql"]
    ]
    rows = [columns for columns in selects if f"{quote(table)}.{quote('attempts')}" in columns]
    assert len(rows) == 1, selects
    return rows[0]


def quote(name: str) -> str:
    return connection.ops.quote_name(name)


def test_the_job_list_does_not_read_the_payload(admin):
    jobs.add.enqueue(1, 1)
    with CaptureQueriesContext(connection) as queries:
        response = admin.get(JOB_LIST)
    assert response.status_code == 200 and len(response.context["cl"].result_list) == 1
    columns = select_of(queries, "dbqueue_job")
    assert quote("name") in columns and quote("payload") not in columns


def test_the_failed_job_list_reads_only_the_end_of_the_error_and_not_the_payload(admin):
    make_failed("tail")
    with CaptureQueriesContext(connection) as queries:
        page = admin.get(FAILED_LIST).content.decode()
    assert "ValueError: tail broke" in page
    columns = select_of(queries, "dbqueue_failed_job")
    assert quote("name") in columns and quote("payload") not in columns
    # The error column appears only inside the functions that read its end and its length.
    outside_functions = re.sub(r"(RIGHT|SUBSTR|SUBSTRING|LENGTH|CHAR_LENGTH)\((?:[^()]|\([^()]*\))*\)", "", columns)
    assert quote("error") in columns and quote("error") not in outside_functions, columns


def test_the_failed_job_list_summarises_an_error_whose_last_line_is_longer_than_the_part_read(admin):
    failed = make_failed("long")
    FailedJob.objects.filter(pk=failed.pk).update(error="Traceback\nValueError: " + "x" * 3000)
    page = admin.get(FAILED_LIST).content.decode()
    assert "…xxxx" in page and "Traceback" not in page.split('class="field-short_error"', 1)[1].split("</td>")[0]


def test_the_failed_job_page_shows_the_payload_as_indented_json_and_the_traceback(admin):
    failed = make_failed("detail")
    page = admin.get(reverse("admin:django_dbqueue_failedjob_change", args=[failed.pk])).content.decode()
    assert "&quot;args&quot;: [\n    &quot;detail&quot;\n  ]" in page
    assert "Traceback (most recent call last):" in page
    assert 'id="retry-failed-job"' in page


def test_retry_selected_puts_failed_jobs_back_as_fresh_jobs(admin):
    first, second, kept = make_failed("a"), make_failed("b"), make_failed("c")
    response = admin.post(
        FAILED_LIST, {"action": "retry_selected", "_selected_action": [first.pk, second.pk]}, follow=True
    )
    assert "2 jobs were put back on the queue." in response.content.decode()
    assert list(FailedJob.objects.values_list("pk", flat=True)) == [kept.pk]
    waiting = Job.objects.waiting()
    assert sorted(job.payload for job in waiting) == sorted([first.payload, second.payload])
    assert {job.attempts for job in waiting} == {0}


def test_the_retry_button_retries_one_job_and_only_by_post(admin):
    failed = make_failed("button")
    url = reverse("admin:django_dbqueue_failedjob_retry", args=[failed.pk])
    assert admin.get(url).status_code == 405
    response = admin.post(url, follow=True)
    assert f"Failed job {failed.pk} was put back on the queue." in response.content.decode()
    assert not FailedJob.objects.exists() and Job.objects.waiting().count() == 1


def test_a_retry_without_a_csrf_token_is_refused(admin_user):
    failed = make_failed("csrf")
    client = Client(enforce_csrf_checks=True)
    client.force_login(admin_user)
    response = client.post(reverse("admin:django_dbqueue_failedjob_retry", args=[failed.pk]))
    assert response.status_code == 403
    response = client.post(FAILED_LIST, {"action": "retry_selected", "_selected_action": [failed.pk]})
    assert response.status_code == 403
    assert FailedJob.objects.count() == 1 and not Job.objects.exists()


def test_a_user_who_may_only_view_sees_no_retry_or_delete_and_cannot_post_one(staff):
    failed = make_failed("guarded")
    client = staff("view_failedjob", "view_job")
    page = client.get(FAILED_LIST).content.decode()
    assert "retry_selected" not in page and "delete_selected" not in page
    detail = client.get(reverse("admin:django_dbqueue_failedjob_change", args=[failed.pk])).content.decode()
    assert 'id="retry-failed-job"' not in detail
    client.post(FAILED_LIST, {"action": "retry_selected", "_selected_action": [failed.pk]})
    client.post(FAILED_LIST, {"action": "delete_selected", "_selected_action": [failed.pk], "post": "yes"})
    assert client.post(reverse("admin:django_dbqueue_failedjob_retry", args=[failed.pk])).status_code == 403
    assert FailedJob.objects.count() == 1 and not Job.objects.exists()


def test_a_user_with_change_and_add_permissions_may_retry(staff):
    failed = make_failed("allowed")
    client = staff("view_failedjob", "change_failedjob", "add_job")
    client.post(FAILED_LIST, {"action": "retry_selected", "_selected_action": [failed.pk]})
    assert not FailedJob.objects.exists() and Job.objects.count() == 1


def test_delete_selected_forgets_failed_jobs(admin):
    failed = make_failed("forget")
    admin.post(FAILED_LIST, {"action": "delete_selected", "_selected_action": [failed.pk], "post": "yes"})
    assert not FailedJob.objects.exists()


def test_the_job_list_shows_each_state_and_filters_by_it(admin):
    jobs.add.enqueue(1, 1)
    jobs.add.using(delay=3600).enqueue(2, 2)
    jobs.add.using(queue="busy").enqueue(3, 3)
    jobs.add.using(queue="stale").enqueue(4, 4)
    claims.reserve(["busy"])
    stale = claims.reserve(["stale"])
    Job.objects.filter(pk=stale.pk).update(reserved_at=F("reserved_at") - dt.timedelta(hours=1))
    page = admin.get(JOB_LIST).content.decode()
    for state in ("waiting", "delayed", "reserved", "reservation expired"):
        assert f'<td class="field-state">{state}</td>' in page
    for state, queue in (("waiting", "default"), ("delayed", "default"), ("reserved", "busy"), ("expired", "stale")):
        rows = admin.get(JOB_LIST, {"state": state}).context["cl"].result_list
        assert [job.queue for job in rows] == [queue], state


def test_run_now_makes_a_delayed_job_available(admin):
    row = jobs.add.using(delay=3600).enqueue(1, 1)
    response = admin.post(JOB_LIST, {"action": "run_now", "_selected_action": [row.pk]}, follow=True)
    assert "1 job is available now." in response.content.decode()
    assert Job.objects.waiting().filter(pk=row.pk).exists()


def test_release_expired_reclaims_only_expired_reservations(admin):
    jobs.add.using(queue="stale").enqueue(1, 1)
    jobs.add.using(queue="busy").enqueue(2, 2)
    stale = claims.reserve(["stale"])
    busy = claims.reserve(["busy"])
    Job.objects.filter(pk=stale.pk).update(reserved_at=F("reserved_at") - dt.timedelta(hours=1))
    response = admin.post(JOB_LIST, {"action": "release_expired", "_selected_action": [stale.pk, busy.pk]}, follow=True)
    assert "1 expired reservation was released." in response.content.decode()
    assert Job.objects.get(pk=stale.pk).reserved_at is None
    assert Job.objects.get(pk=busy.pk).reserved_at is not None


def test_the_queue_overview_counts_each_queue_and_links_to_the_lists(admin):
    jobs.add.enqueue(1, 1)
    jobs.add.enqueue(2, 2)
    jobs.add.using(delay=3600).enqueue(3, 3)
    jobs.add.using(queue="emails").enqueue(4, 4)
    claims.reserve(["emails"])
    make_failed("x", queue="emails")
    response = admin.get(reverse("admin:django_dbqueue_overview"))
    rows = {row.queue: row for row in response.context["rows"]}
    assert (rows["default"].waiting, rows["default"].delayed, rows["default"].reserved) == (2, 1, 0)
    assert (rows["emails"].waiting, rows["emails"].reserved, rows["emails"].failed) == (0, 1, 1)
    assert rows["default"].oldest_waiting_seconds is not None and rows["emails"].oldest_waiting_seconds is None
    page = response.content.decode()
    assert f"{JOB_LIST}?queue=default&amp;state=waiting" in page
    assert f"{FAILED_LIST}?queue=emails" in page


def test_the_overview_needs_view_permission(staff):
    assert staff().get(reverse("admin:django_dbqueue_overview")).status_code == 403
    assert staff("view_job").get(reverse("admin:django_dbqueue_overview")).status_code == 200


def test_progress_is_drawn_as_a_bar(admin):
    JobProgress.objects.create(key="7", percent=42.5, stage="resizing", updated_at=Now())
    page = admin.get(reverse("admin:django_dbqueue_jobprogress_changelist")).content.decode()
    assert 'title="42%"' in page and "width:42.5%" in page and "resizing" in page


def test_the_overview_shows_job_counts_but_no_failed_count_without_view_failedjob(staff):
    jobs.add.using(queue="emails").enqueue(1, 1)
    make_failed("hidden", queue="emails")
    make_failed("only-failed", queue="reports")
    response = staff("view_job").get(reverse("admin:django_dbqueue_overview"))
    rows = {row.queue: row for row in response.context["rows"]}
    assert set(rows) == {"emails"}  # "reports" holds only failed jobs
    assert (rows["emails"].waiting, rows["emails"].failed) == (1, None)
    page = response.content.decode()
    assert f"{JOB_LIST}?queue=emails&amp;state=waiting" in page
    assert FAILED_LIST not in page and "<th>Failed</th>" not in page


def test_the_overview_shows_failed_counts_but_no_job_counts_with_only_view_failedjob(staff):
    jobs.add.using(queue="emails").enqueue(1, 1)
    jobs.add.using(queue="quiet").enqueue(2, 2)
    make_failed("shown", queue="emails")
    response = staff("view_failedjob").get(reverse("admin:django_dbqueue_overview"))
    assert response.status_code == 200
    rows = {row.queue: row for row in response.context["rows"]}
    assert set(rows) == {"emails"}  # "quiet" holds only jobs
    assert (rows["emails"].waiting, rows["emails"].reserved, rows["emails"].failed) == (None, None, 1)
    assert rows["emails"].oldest_waiting_seconds is None
    page = response.content.decode()
    assert f"{FAILED_LIST}?queue=emails" in page
    assert JOB_LIST not in page and "<th>Waiting</th>" not in page


def test_the_overview_shows_every_figure_with_both_view_permissions(staff):
    jobs.add.using(queue="emails").enqueue(1, 1)
    make_failed("x", queue="emails")
    rows = staff("view_job", "view_failedjob").get(reverse("admin:django_dbqueue_overview")).context["rows"]
    assert [(row.queue, row.waiting, row.failed) for row in rows] == [("emails", 1, 1)]


def reserved_and_waiting() -> tuple[Job, Job, Job]:
    jobs.add.using(queue="busy").enqueue(1, 1)
    running = claims.reserve(["busy"])
    assert running is not None
    return running, jobs.add.enqueue(2, 2), jobs.add.using(delay=3600).enqueue(3, 3)


def test_delete_selected_deletes_unreserved_jobs_and_refuses_reserved_ones(admin):
    running, waiting, delayed = reserved_and_waiting()
    selected = [running.pk, waiting.pk, delayed.pk]
    confirm = admin.post(JOB_LIST, {"action": "delete_selected", "_selected_action": selected})
    page = confirm.content.decode()
    assert confirm.status_code == 200 and "1 job was not deleted: a worker has reserved it" in page
    assert [job.pk for job in confirm.context["queryset"]] == [waiting.pk, delayed.pk]
    response = admin.post(
        JOB_LIST, {"action": "delete_selected", "_selected_action": selected, "post": "yes"}, follow=True
    )
    page = response.content.decode()
    assert "2 jobs were deleted." in page and "1 job was not deleted" in page
    assert list(Job.objects.values_list("pk", flat=True)) == [running.pk]
    assert Job.objects.get(pk=running.pk).reserved_at is not None


def test_a_job_reserved_after_the_confirmation_page_is_not_deleted(admin):
    jobs.add.enqueue(1, 1)
    claimed_later = Job.objects.get()
    confirm = admin.post(JOB_LIST, {"action": "delete_selected", "_selected_action": [claimed_later.pk]})
    assert [job.pk for job in confirm.context["queryset"]] == [claimed_later.pk]
    assert claims.reserve(["default"]) is not None  # a worker claims it before the POST
    response = admin.post(
        JOB_LIST, {"action": "delete_selected", "_selected_action": [claimed_later.pk], "post": "yes"}, follow=True
    )
    assert "1 job was not deleted" in response.content.decode() and "deleted." not in response.content.decode()
    assert Job.objects.filter(pk=claimed_later.pk, reserved_at__isnull=False).exists()


def test_the_delete_page_of_a_reserved_job_refuses_and_deletes_nothing(admin):
    running, waiting, _ = reserved_and_waiting()
    change = admin.get(reverse("admin:django_dbqueue_job_change", args=[running.pk])).content.decode()
    assert reverse("admin:django_dbqueue_job_delete", args=[running.pk]) not in change
    url = reverse("admin:django_dbqueue_job_delete", args=[running.pk])
    for response in (admin.get(url, follow=True), admin.post(url, {"post": "yes"}, follow=True)):
        assert f"Job {running.pk} was not deleted: a worker has reserved it" in response.content.decode()
    assert Job.objects.filter(pk=running.pk).exists()
    admin.post(reverse("admin:django_dbqueue_job_delete", args=[waiting.pk]), {"post": "yes"})
    assert not Job.objects.filter(pk=waiting.pk).exists()


def test_deleting_needs_the_delete_permission_and_a_csrf_token(staff, admin_user):
    _, waiting, _ = reserved_and_waiting()
    viewer = staff("view_job")
    assert "delete_selected" not in viewer.get(JOB_LIST).content.decode()
    viewer.post(JOB_LIST, {"action": "delete_selected", "_selected_action": [waiting.pk], "post": "yes"})
    assert (
        viewer.post(reverse("admin:django_dbqueue_job_delete", args=[waiting.pk]), {"post": "yes"}).status_code == 403
    )
    client = Client(enforce_csrf_checks=True)
    client.force_login(admin_user)
    response = client.post(JOB_LIST, {"action": "delete_selected", "_selected_action": [waiting.pk], "post": "yes"})
    assert response.status_code == 403
    assert Job.objects.filter(pk=waiting.pk).exists()
    assert "delete_selected" in staff("view_job", "delete_job").get(JOB_LIST).content.decode()


JOB_LIST = "/admin/django_dbqueue/job/"


def test_the_cancel_action_needs_the_cancel_permission_and_cancels_waiting_jobs(staff):
    from django_dbqueue.handles import JobStatus, get_job

    waiting = jobs.record.enqueue("cancel-me")
    without = staff("view_job", "change_job")
    assert "cancel_selected" not in without.get(JOB_LIST).content.decode()
    without.post(JOB_LIST, {"action": "cancel_selected", "_selected_action": [waiting.id]})
    assert get_job(waiting.id).status == JobStatus.WAITING
    allowed = staff("view_job", "cancel_job")
    assert "cancel_selected" in allowed.get(JOB_LIST).content.decode()
    response = allowed.post(JOB_LIST, {"action": "cancel_selected", "_selected_action": [waiting.id]}, follow=True)
    assert "1 job was cancelled" in response.content.decode()
    assert get_job(waiting.id).status == JobStatus.CANCELLED


def test_the_cancel_action_asks_a_reserved_job_to_stop(staff):
    handle = jobs.record.enqueue("running")
    job = claims.reserve(["default"], worker_id="w1")
    assert job is not None and job.pk == handle.id
    client = staff("view_job", "cancel_job")
    response = client.post(JOB_LIST, {"action": "cancel_selected_hard", "_selected_action": [handle.id]}, follow=True)
    assert "1 running job was asked to stop" in response.content.decode()
    assert Job.objects.get(pk=handle.id).cancel == 2


# Deeper than Python's JSON parser goes (RecursionError), as a row written by raw SQL may be.
DEEP_PAYLOAD = "[" * 100_000 + "]" * 100_000


def test_a_payload_nested_deeper_than_the_parser_goes_is_shown_as_stored(admin):
    failed = make_failed("deep")
    FailedJob.objects.filter(pk=failed.pk).update(payload=DEEP_PAYLOAD)
    jobs.always_fail.enqueue("deep job")
    job = Job.objects.get()
    Job.objects.filter(pk=job.pk).update(payload=DEEP_PAYLOAD)
    for page in (
        reverse("admin:django_dbqueue_failedjob_change", args=[failed.pk]),
        reverse("admin:django_dbqueue_job_change", args=[job.pk]),
    ):
        response = admin.get(page)
        assert response.status_code == 200
        assert f"<pre>{DEEP_PAYLOAD}</pre>" in response.content.decode()
