"""The batches' admin page through Django's test client (and once in a real Chromium):
counts, state, progress, member links, cancel, retry of failed members, permissions, CSRF.

Set DBQUEUE_SCREENSHOTS=1 to refresh docs/batches.png.
"""

from __future__ import annotations

import re

import pytest
from django.contrib.auth.models import Permission, User
from django.test import Client
from django.urls import reverse

from django_dbqueue import batch, batches, claims, lifecycle
from django_dbqueue.admin import batches as batch_admin
from django_dbqueue.models import FailedJob, FailedJobQuerySet, Job, JobBatch
from tests.test_browser import live_url, page, screenshot_path  # noqa: F401  (fixtures)
from tests.testapp import jobs

BATCH_LIST = reverse("admin:django_dbqueue_jobbatch_changelist")
FAILED_LIST = reverse("admin:django_dbqueue_failedjob_changelist")
JOB_LIST = reverse("admin:django_dbqueue_job_changelist")
# What a user needs to retry failed jobs (FailedJobAdmin.has_retry_permission).
RETRY = ("change_failedjob", "add_job")


def make_batch(
    name: str, *, succeed: int = 0, fail: int = 0, run: int = 0, wait: int = 0, callbacks: bool = False
) -> int:
    """A batch whose members succeeded, failed, are reserved (running) and waiting, made
    the way a worker makes them; the waiting ones are on the queue "low", which nothing reserves here."""
    members = [jobs.member.bind(f"{name}-{i}") for i in range(succeed + fail + run)]
    members += [jobs.member.using(queue="low").bind(f"{name}-waiting-{i}") for i in range(wait)]
    declared = batch(*members, name=name)
    if callbacks:
        declared = (
            declared.then(jobs.batch_callback.bind("cb-then"))
            .on_failure(jobs.batch_callback.bind("cb-failure"))
            .on_finish(jobs.batch_callback.bind("cb-finish"))
        )
    handle = declared.enqueue()
    for i in range(succeed + fail + run):
        job = claims.reserve(["default"])
        assert job is not None and job.batch_id == handle.id
        if i < succeed:
            assert lifecycle.delete(job)
        elif i < succeed + fail:
            error = f"Traceback (most recent call last):\n  ...\nRuntimeError: member {name}-{i} fails on purpose"
            assert lifecycle.fail(job, error=error, exception_class="builtins.RuntimeError") is not None
    return handle.id


def change_url(batch_id: int) -> str:
    return reverse("admin:django_dbqueue_jobbatch_change", args=[batch_id])


def login(*codenames: str, csrf: bool = False) -> Client:
    """A client logged in as a staff user with these permissions of the app."""
    user = User.objects.create_user(f"user{User.objects.count()}", is_staff=True)  # no password: fast
    user.user_permissions.set(
        Permission.objects.filter(content_type__app_label="django_dbqueue", codename__in=codenames)
    )
    client = Client(enforce_csrf_checks=csrf)
    client.force_login(user)
    return client


def csrf_token(client: Client, url: str) -> str:
    match = re.search(r'name="csrfmiddlewaretoken" value="([^"]+)"', client.get(url).content.decode())
    assert match is not None
    return match.group(1)


def row_of(html: str, batch_id: int) -> str:
    """The change list's row of the batch: from its checkbox to the end of the row."""
    start = html.index(f'name="_selected_action" value="{batch_id}"')
    return html[start : html.index("</tr>", start)]


# -- the list and the page -----------------------------------------------------------


@pytest.mark.django_db
def test_the_list_shows_each_batchs_state_counts_and_progress(admin):
    photos = make_batch("photos", succeed=3, fail=1, run=1, wait=3)
    emails = make_batch("emails", succeed=2)
    html = admin.get(BATCH_LIST).content.decode()
    row = row_of(html, photos)
    assert "photos" in row and ">running<" in row
    # total, succeeded, failed, cancelled, pending
    assert re.findall(r'<td class="field-(?:total|succeeded|failed|cancelled|pending)">(\d+)</td>', row) == [
        "8",
        "3",
        "1",
        "0",
        "4",
    ]
    assert 'role="progressbar"' in row and 'aria-valuenow="50"' in row and "50% (4/8)" in row
    assert 'class="succeeded" style="width:37.50%' in row and 'class="failed" style="width:12.50%' in row
    row = row_of(html, emails)
    assert ">finished<" in row and 'aria-valuenow="100"' in row and "100% (2/2)" in row


@pytest.mark.django_db
def test_the_state_filter_and_the_search(admin):
    ids = {
        "running": make_batch("a-running", succeed=1, wait=1),
        "finished": make_batch("a-finished", succeed=1),
        "failed": make_batch("a-failed", succeed=1, fail=1),
        "cancelling": make_batch("a-cancelling", run=1, wait=1),
        "cancelled": make_batch("a-cancelled", wait=2),
    }
    for state in ("cancelling", "cancelled"):
        batches.cancel(ids[state])

    def found(**params: str) -> list[int]:
        return [row.pk for row in admin.get(BATCH_LIST, params).context["cl"].result_list]

    for state, batch_id in ids.items():
        assert found(state=state) == [batch_id], state
        assert JobBatch.objects.get(pk=batch_id).state == state
    assert found(q="a-failed") == [ids["failed"]]
    assert found(q=str(ids["running"])) == [ids["running"]]


@pytest.mark.django_db
def test_the_batch_page_shows_counts_callbacks_and_links_to_its_members(admin):
    other = make_batch("other", fail=1, wait=1)
    batch_id = make_batch("photos", succeed=1, fail=2, run=1, wait=2, callbacks=True)
    html = admin.get(change_url(batch_id)).content.decode()
    assert "photos" in html and "running" in html and "50% (3/6)" in html
    assert "<b>on_failure</b>: tests.testapp.jobs.batch_callback" in html
    assert "<b>then</b>: tests.testapp.jobs.batch_callback" in html
    assert "<b>on_finish</b>: tests.testapp.jobs.batch_callback" in html
    assert "2 waiting, 1 running" in html
    assert f'href="{JOB_LIST}?batch_id={batch_id}"' in html
    assert f'href="{FAILED_LIST}?batch_id={batch_id}">2 in the failed job list' in html
    failed = FailedJob.objects.filter(batch_id=batch_id)
    assert failed.count() == 2
    for row in failed:
        assert f'href="{reverse("admin:django_dbqueue_failedjob_change", args=[row.pk])}"' in html
    assert 'id="cancel-batch"' in html and 'id="retry-batch-failed"' in html

    # The links' filters hold only this batch's members.
    listed = admin.get(FAILED_LIST, {"batch_id": batch_id}).context["cl"].result_list
    assert sorted(row.pk for row in listed) == sorted(row.pk for row in failed)
    listed = admin.get(JOB_LIST, {"batch_id": batch_id}).context["cl"].result_list
    assert {row.batch_id for row in listed} == {batch_id} and len(listed) == 3
    assert FailedJob.objects.filter(batch_id=other).exists()


@pytest.mark.django_db
def test_the_member_links_are_shown_only_to_users_who_may_see_those_lists(admin):
    batch_id = make_batch("photos", fail=1, wait=1)
    html = login("view_jobbatch").get(change_url(batch_id)).content.decode()
    assert "photos" in html
    assert "batch-members" not in html and "?batch_id=" not in html
    html = login("view_jobbatch", "view_failedjob").get(change_url(batch_id)).content.decode()
    assert f"{FAILED_LIST}?batch_id={batch_id}" in html and f"{JOB_LIST}?batch_id=" not in html


@pytest.mark.django_db
def test_batches_cannot_be_added_or_changed_through_the_admin(admin):
    batch_id = make_batch("photos", wait=1)
    assert admin.get(reverse("admin:django_dbqueue_jobbatch_add")).status_code == 403
    admin.post(change_url(batch_id), {"name": "renamed", "total": 99})
    assert JobBatch.objects.get(pk=batch_id).name == "photos"
    assert JobBatch.objects.get(pk=batch_id).total == 1


# -- cancel ----------------------------------------------------------------------


@pytest.mark.django_db
def test_a_staff_user_without_cancel_batch_cannot_cancel(admin):
    batch_id = make_batch("photos", wait=2)
    client = login("view_jobbatch", "delete_jobbatch", *RETRY)
    assert "cancel_selected" not in client.get(BATCH_LIST).content.decode()
    assert 'id="cancel-batch"' not in client.get(change_url(batch_id)).content.decode()
    client.post(BATCH_LIST, {"action": "cancel_selected", "_selected_action": [batch_id]})
    assert client.post(reverse("admin:django_dbqueue_jobbatch_cancel", args=[batch_id])).status_code == 403
    assert JobBatch.objects.get(pk=batch_id).cancelled_at is None and Job.objects.count() == 2


@pytest.mark.django_db
def test_the_cancel_action_cancels_running_batches_and_reports_the_others():
    running = make_batch("photos", succeed=1, run=1, wait=2)
    finished = make_batch("done", succeed=1)
    client = login("view_jobbatch", "cancel_batch")
    response = client.post(
        BATCH_LIST, {"action": "cancel_selected", "_selected_action": [running, finished]}, follow=True
    )
    html = response.content.decode()
    assert "1 batch was cancelled: 2 waiting members were deleted; running members finish." in html
    assert "1 batch was cancelled or finished already." in html
    row = JobBatch.objects.get(pk=running)
    assert (row.state, row.cancelled, row.pending) == ("cancelling", 2, 1)
    assert JobBatch.objects.get(pk=finished).cancelled_at is None
    assert list(Job.objects.filter(batch_id=running).values_list("reserved_at", flat=True)) != [None]


@pytest.mark.django_db
def test_the_cancel_button_cancels_refuses_get_and_needs_a_csrf_token():
    batch_id = make_batch("photos", succeed=1, wait=2)
    client = login("view_jobbatch", "cancel_batch", csrf=True)
    url = reverse("admin:django_dbqueue_jobbatch_cancel", args=[batch_id])
    assert client.get(url).status_code == 405
    assert client.post(url).status_code == 403  # no token
    assert JobBatch.objects.get(pk=batch_id).cancelled_at is None
    response = client.post(url, {"csrfmiddlewaretoken": csrf_token(client, change_url(batch_id))}, follow=True)
    assert response.redirect_chain[-1][0] == change_url(batch_id)
    html = response.content.decode()
    assert f"Batch {batch_id} was cancelled: 2 waiting members were deleted; running members finish." in html
    assert 'id="cancel-batch"' not in html  # cancelled: no button any more
    row = JobBatch.objects.get(pk=batch_id)
    assert (row.state, row.cancelled, row.pending) == ("cancelled", 2, 0)
    assert not Job.objects.exists()
    response = client.post(url, {"csrfmiddlewaretoken": csrf_token(client, change_url(batch_id))}, follow=True)
    assert f"Batch {batch_id} was cancelled or finished already." in response.content.decode()


# -- retry -------------------------------------------------------------------------


@pytest.mark.django_db
def test_retrying_failed_members_needs_the_failed_jobs_retry_permission():
    batch_id = make_batch("photos", succeed=1, fail=2)
    client = login("view_jobbatch", "cancel_batch", "change_failedjob")  # no add_job
    assert "retry_failed_selected" not in client.get(BATCH_LIST).content.decode()
    assert 'id="retry-batch-failed"' not in client.get(change_url(batch_id)).content.decode()
    client.post(BATCH_LIST, {"action": "retry_failed_selected", "_selected_action": [batch_id]})
    assert client.post(reverse("admin:django_dbqueue_jobbatch_retry", args=[batch_id])).status_code == 403
    assert FailedJob.objects.filter(batch_id=batch_id).count() == 2 and not Job.objects.exists()


@pytest.mark.django_db
def test_the_retry_action_puts_the_failed_members_back_and_reopens_their_batches():
    photos = make_batch("photos", succeed=1, fail=2)
    clean = make_batch("clean", succeed=1)
    client = login("view_jobbatch", *RETRY)
    response = client.post(
        BATCH_LIST, {"action": "retry_failed_selected", "_selected_action": [photos, clean]}, follow=True
    )
    assert "2 failed members of 1 batch were put back on the queue." in response.content.decode()
    row = JobBatch.objects.get(pk=photos)
    assert (row.state, row.failed, row.pending) == ("running", 0, 2)
    assert not FailedJob.objects.exists() and Job.objects.filter(batch_id=photos).count() == 2
    response = client.post(BATCH_LIST, {"action": "retry_failed_selected", "_selected_action": [clean]}, follow=True)
    assert "The selected batches have no failed members to retry." in response.content.decode()


@pytest.mark.django_db
def test_the_retry_button_retries_refuses_get_and_needs_a_csrf_token():
    batch_id = make_batch("photos", succeed=1, fail=1)
    client = login("view_jobbatch", *RETRY, csrf=True)
    url = reverse("admin:django_dbqueue_jobbatch_retry", args=[batch_id])
    assert client.get(url).status_code == 405
    assert client.post(url).status_code == 403
    assert FailedJob.objects.filter(batch_id=batch_id).count() == 1
    response = client.post(url, {"csrfmiddlewaretoken": csrf_token(client, change_url(batch_id))}, follow=True)
    assert f"1 failed member of batch {batch_id} was put back on the queue." in response.content.decode()
    assert JobBatch.objects.get(pk=batch_id).state == "running"
    assert not FailedJob.objects.exists() and Job.objects.get().batch_id == batch_id


@pytest.mark.django_db
def test_a_cancelled_batch_offers_no_retry_and_says_why():
    batch_id = make_batch("photos", fail=2, wait=1)
    batches.cancel(batch_id)
    client = login("view_jobbatch", "view_failedjob", *RETRY)
    html = client.get(change_url(batch_id)).content.decode()
    assert 'id="retry-batch-failed"' not in html and 'id="batch-retry-refusal"' in html
    assert "it was cancelled, so its failed members are not retried into it" in html
    # A form posted before the cancel: a message, not a server error, and nothing retried.
    response = client.post(reverse("admin:django_dbqueue_jobbatch_retry", args=[batch_id]), follow=True)
    assert response.status_code == 200
    assert f"Batch {batch_id} was not retried: it was cancelled" in response.content.decode()
    response = client.post(BATCH_LIST, {"action": "retry_failed_selected", "_selected_action": [batch_id]}, follow=True)
    assert (
        response.status_code == 200 and f"Not retried: batch {batch_id}: it was cancelled" in response.content.decode()
    )
    assert FailedJob.objects.filter(batch_id=batch_id).count() == 2 and not Job.objects.exists()


@pytest.mark.django_db
def test_the_retry_button_retries_a_chunk_per_transaction(monkeypatch):
    batch_id = make_batch("photos", succeed=1, fail=5)
    chunks: list[int] = []
    retry = lifecycle.retry

    def counted(failed: FailedJobQuerySet) -> list[Job]:
        jobs = retry(failed)
        chunks.append(len(jobs))
        return jobs

    monkeypatch.setattr(lifecycle, "retry", counted)
    monkeypatch.setattr(batch_admin, "RETRY_CHUNK", 2)
    client = login("view_jobbatch", *RETRY)
    response = client.post(reverse("admin:django_dbqueue_jobbatch_retry", args=[batch_id]), follow=True)
    assert f"5 failed members of batch {batch_id} were put back on the queue." in response.content.decode()
    assert chunks == [2, 2, 1]
    row = JobBatch.objects.get(pk=batch_id)
    assert (row.state, row.failed, row.pending) == ("running", 0, 5)
    assert not FailedJob.objects.exists() and Job.objects.filter(batch_id=batch_id).count() == 5


# -- delete ---------------------------------------------------------------------------


@pytest.mark.django_db
def test_only_finished_batches_may_be_deleted(admin):
    running = make_batch("running", succeed=1, wait=1)
    finished = make_batch("finished", succeed=1, fail=1)
    assert admin.get(reverse("admin:django_dbqueue_jobbatch_delete", args=[running])).status_code == 403
    assert "Delete</a>" not in admin.get(change_url(running)).content.decode()
    response = admin.post(
        BATCH_LIST, {"action": "delete_selected", "_selected_action": [running, finished], "post": "yes"}, follow=True
    )
    assert "Successfully deleted 1 batch." in response.content.decode()
    assert list(JobBatch.objects.values_list("pk", flat=True)) == [running]
    # Its failed member stays in the failed jobs.
    assert FailedJob.objects.filter(batch_id=finished).count() == 1
    response = admin.post(BATCH_LIST, {"action": "delete_selected", "_selected_action": [running]}, follow=True)
    assert "1 batch is not deleted: it has not finished" in response.content.decode()
    assert JobBatch.objects.filter(pk=running).exists()


@pytest.mark.django_db
def test_deleting_a_batch_needs_the_delete_permission():
    finished = make_batch("finished", succeed=1)
    viewer = login("view_jobbatch")
    assert "delete_selected" not in viewer.get(BATCH_LIST).content.decode()
    viewer.post(BATCH_LIST, {"action": "delete_selected", "_selected_action": [finished], "post": "yes"})
    delete_url = reverse("admin:django_dbqueue_jobbatch_delete", args=[finished])
    assert viewer.post(delete_url, {"post": "yes"}).status_code == 403
    assert JobBatch.objects.filter(pk=finished).exists()
    deleter = login("view_jobbatch", "delete_jobbatch")
    deleter.post(delete_url, {"post": "yes"})
    assert not JobBatch.objects.exists()


# -- in a real browser ------------------------------------------------------------------


@pytest.mark.django_db(transaction=True)
@pytest.mark.acceptance
@pytest.mark.one_django
def test_an_operator_follows_a_batch_and_cancels_it_in_a_browser(live_url, page, tmp_path):  # noqa: F811
    make_batch("welcome-emails", succeed=5)
    make_batch("nightly-import", succeed=3, fail=1)
    photos = make_batch("resize-photos", succeed=4, fail=2, run=1, wait=3)
    make_batch("thumbnails", wait=4)
    User.objects.create_superuser("ops", "ops@example.com", "s3cret-pass")
    page.goto(f"{live_url}{reverse('admin:login')}?next={BATCH_LIST}")
    page.fill("#id_username", "ops")
    page.fill("#id_password", "s3cret-pass")
    page.click("input[type=submit]")
    page.wait_for_selector("#result_list")
    assert page.locator("#result_list tbody tr").count() == 4
    row = page.locator("#result_list tbody tr", has_text="resize-photos")
    assert row.locator("td.field-state").inner_text() == "running"
    assert row.locator("[role=progressbar]").get_attribute("aria-valuenow") == "60"
    assert row.locator("td.field-progress").inner_text().strip() == "60% (6/10)"
    counts = [row.locator(f"td.field-{name}").inner_text() for name in ("total", "succeeded", "failed", "pending")]
    assert counts == ["10", "4", "2", "4"]

    row.locator("th.field-id a").click()
    page.wait_for_selector("#batch-members")
    assert page.inner_text("#batch-queued").startswith("3 waiting, 1 running")
    failed_links = page.locator("#batch-failed-members li a")
    assert failed_links.count() == 2
    failed = FailedJob.objects.filter(batch_id=photos).order_by("id").first()
    assert failed is not None
    assert failed_links.first.get_attribute("href") == reverse(
        "admin:django_dbqueue_failedjob_change", args=[failed.pk]
    )

    page.click("#cancel-batch")
    page.wait_for_selector(".messagelist")
    assert f"Batch {photos} was cancelled: 3 waiting members were deleted; running members finish." in page.inner_text(
        ".messagelist"
    )
    assert page.inner_text("div.field-state div.readonly") == "cancelling"
    assert page.locator("[role=progressbar]").get_attribute("aria-valuenow") == "90"
    assert page.locator("#cancel-batch").count() == 0
    assert page.inner_text("#batch-queued").startswith("0 waiting, 1 running")

    page.goto(f"{live_url}{BATCH_LIST}")
    page.wait_for_selector("#result_list")
    page.click("#toggle-nav-sidebar")  # room for every column
    page.set_viewport_size({"width": 1800, "height": 500})
    row = page.locator("#result_list tbody tr", has_text="resize-photos")
    assert row.locator("td.field-state").inner_text() == "cancelling"
    page.screenshot(path=str(screenshot_path("batches.png", tmp_path)), full_page=True)
