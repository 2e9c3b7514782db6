"""The admin pages through Django's test client: retry, permissions, CSRF, states, overview."""

import datetime as dt

import pytest
from django.contrib.auth.models import Permission, User
from django.db.models import F
from django.db.models.functions import Now
from django.test import Client
from django.urls import reverse

from django_dbqueue.models import FailedJob, Job, JobProgress
from tests.testapp import jobs

pytestmark = pytest.mark.django_db

FAILED_LIST = reverse("admin:django_dbqueue_failedjob_changelist")
JOB_LIST = reverse("admin:django_dbqueue_job_changelist")


def make_failed(key: str, queue: str = "default") -> FailedJob:
    """A failed job made the way the worker makes one."""
    jobs.always_fail.using(queue=queue).enqueue(key)
    job = Job.objects.reserve([queue])
    failed = Job.objects.fail(
        job,
        error=f"Traceback (most recent call last):\n  ...\nValueError: {key} broke",
        exception_class="builtins.ValueError",
    )
    assert failed is not None
    return failed


@pytest.fixture
def staff(db):
    def make(*codenames: str) -> Client:
        user = User.objects.create_user(f"user{User.objects.count()}", password="pw", is_staff=True)
        user.user_permissions.set(
            Permission.objects.filter(content_type__app_label="django_dbqueue", codename__in=codenames)
        )
        client = Client()
        client.force_login(user)
        return client

    return make


@pytest.fixture
def admin(admin_user) -> Client:
    client = Client()
    client.force_login(admin_user)
    return client


def test_the_failed_job_list_shows_name_exception_and_the_errors_last_line(admin):
    make_failed("one")
    page = admin.get(FAILED_LIST).content.decode()
    assert "tests.testapp.jobs.always_fail" in page
    assert "builtins.ValueError" in page and "ValueError: one broke" in page
    assert admin.get(FAILED_LIST, {"q": "one broke"}).content.decode().count("ValueError: one broke") == 1


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
    Job.objects.reserve(["busy"])
    stale = Job.objects.reserve(["stale"])
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
    stale = Job.objects.reserve(["stale"])
    busy = Job.objects.reserve(["busy"])
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
    Job.objects.reserve(["emails"])
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
