"""Bulk actions on a filter (bulk.py): retry the failed jobs, or cancel the waiting jobs, that a filter
selects, a chunk per transaction, from the admin's "all matching" pages and from queue_retry / queue_cancel.

Failed jobs are made the way a worker makes them: enqueue, reserve, fail.
"""

from __future__ import annotations

import datetime as dt
import io
from typing import Any

import pytest
from django.test import Client
from django.urls import reverse
from django.utils import timezone

from django_dbqueue import bulk, claims, lifecycle
from django_dbqueue.admin import failed as failed_admin
from django_dbqueue.admin import jobs as jobs_admin
from django_dbqueue.management.options import moment as parse
from django_dbqueue.models import CANCELLED_CLASS, FailedJob, Job
from tests.test_operations_commands import error_of, run
from tests.testapp import jobs

pytestmark = pytest.mark.django_db

RECORD = "tests.testapp.jobs.record"
RETRY_MATCHING = reverse("admin:django_dbqueue_failedjob_retry_matching")
CANCEL_MATCHING = reverse("admin:django_dbqueue_job_cancel_matching")
FAILED_LIST = reverse("admin:django_dbqueue_failedjob_changelist")
JOB_LIST = reverse("admin:django_dbqueue_job_changelist")


def make_failed(key: str, error: str, definition: Any = jobs.record, queue: str = "default") -> FailedJob:
    """A failed job made the way the worker makes one, with ``error`` as its exception's message."""
    definition.using(queue=queue).enqueue(key)
    job = claims.reserve([queue])
    assert job is not None
    failed = lifecycle.fail(job, error=f"Traceback ...\n{error}", exception_class="builtins.RuntimeError")
    assert failed is not None
    return failed


@pytest.fixture
def failed_mix() -> dict[str, list[FailedJob]]:
    """Five failed ``record`` jobs that timed out, and four that match only in part."""
    return {
        "matching": [make_failed(f"t{index}", "TimeoutError: read timed out") for index in range(5)],
        "other_error": [make_failed(f"v{index}", "ValueError: bad") for index in range(2)],
        "other_name": [make_failed(f"n{index}", "Timeout", definition=jobs.always_fail) for index in range(2)],
    }


def assert_each_job_in_one_place(failed: list[FailedJob], retried: list[FailedJob]) -> None:
    """Each retried job is a Job and no FailedJob; each other one a FailedJob and no Job: never both, never neither."""
    jobs_payloads = list(Job.objects.values_list("payload", flat=True))
    failed_payloads = list(FailedJob.objects.values_list("payload", flat=True))
    for row in failed:
        in_jobs, in_failed = jobs_payloads.count(row.payload), failed_payloads.count(row.payload)
        assert (in_jobs, in_failed) == ((1, 0) if row in retried else (0, 1)), row.payload


def enqueue_emails() -> dict[str, Any]:
    """Jobs of two queues, enqueued now and two days ago; one of the recent emails reserved by a worker."""
    reserved = jobs.record.using(queue="emails").enqueue("running")
    assert claims.reserve(["emails"]).pk == reserved.id
    recent = [jobs.record.using(queue="emails").enqueue(f"e{index}") for index in range(5)]
    old = jobs.record.using(queue="emails").enqueue("old")
    Job.objects.filter(pk=old.id).update(created_at=timezone.now() - dt.timedelta(days=2))
    other = jobs.record.enqueue("default")
    return {"reserved": reserved.id, "recent": [h.id for h in recent], "old": old.id, "other": other.id}


# -- the one home: filter, count, chunks ------------------------------------------------


def test_a_bulk_retry_by_name_and_error_text_retries_exactly_the_matching_jobs_a_chunk_at_a_time(failed_mix):
    selection = bulk.JobFilter(name=RECORD, error_contains="timeout").failed()
    counted = bulk.failed_to_retry(selection)
    assert counted.count == 5
    seen: list[int] = []
    assert bulk.retry_all(counted, chunk_size=2, progress=seen.append) == 5
    assert seen == [2, 4, 5]
    assert_each_job_in_one_place([row for rows in failed_mix.values() for row in rows], failed_mix["matching"])


def test_a_bulk_retry_leaves_a_job_that_failed_after_the_count():
    first = make_failed("before", "TimeoutError")
    counted = bulk.failed_to_retry(bulk.JobFilter(error_contains="TIMEOUT").failed())
    later = make_failed("after", "TimeoutError")
    assert bulk.retry_all(counted, chunk_size=1) == 1
    assert_each_job_in_one_place([first, later], [first])


def test_a_bulk_cancel_by_queue_and_time_cancels_the_waiting_jobs_and_leaves_the_running_one():
    made = enqueue_emails()
    selection = bulk.JobFilter(queue="emails", since=timezone.now() - dt.timedelta(hours=1)).jobs()
    counted = bulk.waiting_to_cancel(selection)
    assert counted.count == 5 and bulk.running(selection) == 1
    seen: list[int] = []
    assert bulk.cancel_all(counted, reason="bad batch", chunk_size=2, progress=seen.append) == 5
    assert seen == [2, 4, 5]
    assert set(Job.objects.values_list("pk", flat=True)) == {made["reserved"], made["old"], made["other"]}
    running = Job.objects.get(pk=made["reserved"])
    assert running.reserved_at is not None and running.cancel == 0
    cancelled = FailedJob.objects.filter(exception_class=CANCELLED_CLASS)
    assert sorted(cancelled.values_list("job_id", flat=True)) == sorted(made["recent"])
    assert all(
        error.endswith("was cancelled before it ran: bad batch") for error in cancelled.values_list("error", flat=True)
    )


def test_a_bulk_cancel_until_a_time_leaves_the_jobs_enqueued_since():
    made = enqueue_emails()
    counted = bulk.waiting_to_cancel(bulk.JobFilter(until=timezone.now() - dt.timedelta(days=1)).jobs())
    assert counted.count == 1 and bulk.cancel_all(counted) == 1
    assert list(FailedJob.objects.values_list("job_id", flat=True)) == [made["old"]]


@pytest.mark.parametrize(
    ("parts", "message"),
    [
        ({"since": timezone.now(), "until": timezone.now() - dt.timedelta(hours=1)}, "the time range ends"),
        ({"error_contains": "  "}, "the error text to match is empty"),
    ],
)
def test_a_filter_that_selects_nothing_sensible_is_refused(parts, message):
    with pytest.raises(ValueError, match=message):
        bulk.JobFilter(**parts)


def test_a_job_filter_refuses_an_error_text_for_jobs_and_says_what_it_selects():
    with pytest.raises(ValueError, match="only failed jobs have an error text"):
        bulk.JobFilter(error_contains="x").jobs()
    assert (
        bulk.JobFilter(queue="emails", error_contains="timeout").describe() == "queue=emails, error contains 'timeout'"
    )
    assert bulk.JobFilter().empty and bulk.JobFilter().describe() == "every job"


# -- the admin's "all matching" pages ---------------------------------------------------


FILTER = {"name__exact": RECORD, "error": "timeout"}


def test_the_failed_list_filters_by_error_text_and_links_its_filter_to_retry_all_matching(admin, failed_mix):
    page = admin.get(FAILED_LIST, FILTER)
    assert sorted(row.pk for row in page.context["cl"].result_list) == sorted(row.pk for row in failed_mix["matching"])
    assert 'id="retry-matching"' in page.content.decode()
    assert f"{RETRY_MATCHING}?error=timeout&amp;name__exact={RECORD}" in page.content.decode()


def test_retry_all_matching_shows_the_count_first_and_a_get_changes_nothing(admin, failed_mix):
    page = admin.get(RETRY_MATCHING, {**FILTER, "p": "2"})
    text = page.content.decode()
    assert page.status_code == 200
    assert f"Retry 5 failed jobs matching: name={RECORD}, error contains &#x27;timeout&#x27;?" in text
    assert 'name="last_id"' in text and 'id="matching-confirm"' in text
    assert FailedJob.objects.count() == 9 and not Job.objects.exists()


def test_retry_all_matching_retries_the_whole_filter_not_only_the_page_a_chunk_at_a_time(
    admin, failed_mix, monkeypatch
):
    monkeypatch.setattr(failed_admin, "RETRY_CHUNK", 2)
    monkeypatch.setattr(failed_admin.FailedJobAdmin, "list_per_page", 2)
    last_id = admin.get(RETRY_MATCHING, FILTER).context["counted"].last_id
    response = admin.post(f"{RETRY_MATCHING}?name__exact={RECORD}&error=timeout", {"last_id": last_id}, follow=True)
    assert response.redirect_chain[-1][0] == f"{FAILED_LIST}?name__exact={RECORD}&error=timeout"
    assert "5 jobs were put back on the queue." in [str(message) for message in response.context["messages"]]
    assert_each_job_in_one_place([row for rows in failed_mix.values() for row in rows], failed_mix["matching"])


def test_retry_all_matching_needs_the_retry_permissions(staff, failed_mix):
    viewer = staff("view_failedjob")
    assert 'id="retry-matching"' not in viewer.get(FAILED_LIST).content.decode()
    assert viewer.get(RETRY_MATCHING).status_code == 403
    assert viewer.post(RETRY_MATCHING, {"last_id": 10**6}).status_code == 403
    assert staff("view_failedjob", "change_failedjob").post(RETRY_MATCHING, {"last_id": 10**6}).status_code == 403
    assert FailedJob.objects.count() == 9 and not Job.objects.exists()
    allowed = staff("view_failedjob", "change_failedjob", "add_job")
    assert allowed.post(RETRY_MATCHING, {"last_id": 10**6}).status_code == 302
    assert not FailedJob.objects.exists()


def test_retry_all_matching_refuses_a_post_without_a_csrf_token_or_a_count(admin_user, admin, failed_mix):
    client = Client(enforce_csrf_checks=True)
    client.force_login(admin_user)
    assert client.post(RETRY_MATCHING, {"last_id": 10**6}).status_code == 403
    assert admin.post(RETRY_MATCHING, {}).status_code == 400
    assert admin.post(RETRY_MATCHING, {"last_id": "2**63"}).status_code == 400
    assert FailedJob.objects.count() == 9 and not Job.objects.exists()


def test_retry_all_matching_with_no_match_says_so_and_offers_nothing(admin, failed_mix):
    text = admin.get(RETRY_MATCHING, {"error": "no such words"}).content.decode()
    assert "No failed jobs match: error contains &#x27;no such words&#x27;." in text
    assert 'id="matching-confirm"' not in text


def test_cancel_all_matching_cancels_the_waiting_jobs_of_the_filter_and_leaves_the_running_one(admin, monkeypatch):
    monkeypatch.setattr(jobs_admin, "CANCEL_CHUNK", 2)
    made = enqueue_emails()
    assert 'id="cancel-matching"' in admin.get(JOB_LIST, {"queue__exact": "emails"}).content.decode()
    page = admin.get(CANCEL_MATCHING, {"queue__exact": "emails"})
    text = page.content.decode()
    assert "Cancel 6 waiting jobs matching: queue=emails?" in text
    assert "1 running job(s) match too and are left to run" in text
    assert Job.objects.count() == 8 and not FailedJob.objects.exists()
    response = admin.post(
        f"{CANCEL_MATCHING}?queue__exact=emails", {"last_id": page.context["counted"].last_id}, follow=True
    )
    messages = [str(message) for message in response.context["messages"]]
    assert "6 jobs were cancelled; they are listed with the failed jobs." in messages
    assert set(Job.objects.values_list("pk", flat=True)) == {made["reserved"], made["other"]}
    assert Job.objects.get(pk=made["reserved"]).cancel == 0
    assert FailedJob.objects.filter(exception_class=CANCELLED_CLASS).count() == 6
    assert f"cancelled in the admin by {response.context['user'].get_username()}" in FailedJob.objects.first().error


def test_cancel_all_matching_needs_the_cancel_permission_and_a_csrf_token(staff, admin_user):
    made = enqueue_emails()
    viewer = staff("view_job", "change_job")
    assert 'id="cancel-matching"' not in viewer.get(JOB_LIST).content.decode()
    assert viewer.get(CANCEL_MATCHING).status_code == 403
    assert viewer.post(CANCEL_MATCHING, {"last_id": made["other"]}).status_code == 403
    client = Client(enforce_csrf_checks=True)
    client.force_login(admin_user)
    assert client.post(CANCEL_MATCHING, {"last_id": made["other"]}).status_code == 403
    assert Job.objects.count() == 8 and not FailedJob.objects.exists()
    assert staff("view_job", "cancel_job").post(CANCEL_MATCHING, {"last_id": made["other"]}).status_code == 302
    assert list(Job.objects.values_list("pk", flat=True)) == [made["reserved"]]


# -- the commands ----------------------------------------------------------------------


class Terminal(io.StringIO):
    """A stdin that answers the confirmation and claims to be a terminal."""

    def isatty(self) -> bool:
        return True


def test_queue_retry_of_a_selection_asks_first_and_retries_only_on_yes(failed_mix):
    args = ("--name", RECORD, "--error-contains", "timeout")
    asked = f"Retry 5 failed job(s) matching name={RECORD}, error contains 'timeout'? [y/N] "
    assert error_of("queue_retry", *args) == (
        f"Retrying 5 failed job(s) matching name={RECORD}, error contains 'timeout' needs a confirmation, "
        "and stdin is not a terminal: pass --force to retry without asking."
    )
    assert "--no-input was given" in error_of("queue_retry", *args, "--no-input", stdin=Terminal("y\n"))
    assert run("queue_retry", *args, stdin=Terminal("n\n")) == f"{asked}Nothing was retried.\n"
    assert FailedJob.objects.count() == 9 and not Job.objects.exists()
    assert run("queue_retry", *args, stdin=Terminal("y\n")) == f"{asked}5 job(s) were put back on the queue.\n"
    assert_each_job_in_one_place([row for rows in failed_mix.values() for row in rows], failed_mix["matching"])


def test_queue_retry_with_force_retries_a_time_range_without_asking(monkeypatch):
    monkeypatch.setattr("django_dbqueue.operations.RETRY_CHUNK", 2)
    old = [make_failed(f"o{index}", "boom") for index in range(3)]
    FailedJob.objects.filter(pk__in=[row.pk for row in old]).update(failed_at=timezone.now() - dt.timedelta(days=3))
    recent = make_failed("recent", "boom")
    until = (timezone.now() - dt.timedelta(days=1)).isoformat()
    assert run("queue_retry", "--until", until, "--force") == "3 job(s) were put back on the queue.\n"
    assert_each_job_in_one_place([*old, recent], old)


def test_queue_cancel_of_a_selection_asks_first_then_cancels_the_waiting_jobs_and_names_the_running_ones(monkeypatch):
    monkeypatch.setattr(bulk, "CHUNK", 2)
    made = enqueue_emails()
    since = (timezone.now() - dt.timedelta(hours=1)).isoformat()
    args = ("--queue", "emails", "--since", since)
    message = error_of("queue_cancel", *args, "--no-input")
    assert message.startswith("Cancelling 5 waiting job(s) matching queue=emails, since ")
    assert message.endswith("needs a confirmation, and --no-input was given: pass --force to cancel without asking.")
    assert Job.objects.count() == 8
    out = run("queue_cancel", *args, "--force", "--reason", "wrong template")
    assert out == "5 job(s) were cancelled; 1 running job matched and was left to run.\n"
    assert set(Job.objects.values_list("pk", flat=True)) == {made["reserved"], made["old"], made["other"]}
    assert sorted(FailedJob.objects.values_list("job_id", flat=True)) == sorted(made["recent"])


def test_queue_cancel_by_id_still_asks_running_jobs_to_stop_without_a_question():
    made = enqueue_emails()
    out = run("queue_cancel", str(made["reserved"]), str(made["old"]))
    assert (
        f"Cancelled 1 job(s): {made['old']}." in out and f"1 running job(s) asked to stop: {made['reserved']}." in out
    )
    assert Job.objects.get(pk=made["reserved"]).cancel == 1


@pytest.mark.parametrize(
    ("command", "args", "message"),
    [
        ("queue_retry", ["--since", "yesterday"], "'yesterday' is not a date or time like 2026-12-01"),
        ("queue_retry", ["--until", "2026-02-30"], "'2026-02-30' is no such date or time"),
        ("queue_retry", ["--error-contains", " "], "--error-contains is empty"),
        ("queue_retry", ["--since", "2026-12-02", "--until", "2026-12-01"], "Nothing was changed: the time range ends"),
        ("queue_retry", ["all", "--error-contains", "x"], "one kind of selection at a time"),
        ("queue_cancel", [], "Say which jobs to cancel: ids (queue_cancel 3 5-9 12,14), a selection"),
        ("queue_cancel", ["3", "--queue", "emails"], "one kind of selection at a time"),
        ("queue_cancel", ["--queue", "emails", "--hard"], "Nothing was cancelled: --hard stops running jobs"),
        ("queue_cancel", ["--error-contains=x"], "unrecognized arguments: --error-contains=x"),
        ("queue_cancel", ["--queue", "two words"], "may hold only letters, digits"),
    ],
)
def test_a_bad_selection_is_refused_with_the_reason(command, args, message):
    made = enqueue_emails()
    assert message in error_of(command, *args)
    assert Job.objects.count() == 8 and not FailedJob.objects.exists()
    assert Job.objects.filter(pk=made["reserved"], cancel=0).exists()


def test_a_date_without_an_offset_is_read_in_the_current_time_zone():
    assert parse("2026-12-01") == timezone.make_aware(dt.datetime(2026, 12, 1))
    assert parse("2026-12-01T14:30+00:00") == dt.datetime(2026, 12, 1, 14, 30, tzinfo=dt.UTC)
