"""Jobs about an object (issue 30 part 3, about.py): the objects among a job's arguments are recorded
with its row, in its transaction; ``jobs_for`` finds them back; the admin mixin lists them on the
object's page with Retry and Cancel."""

from __future__ import annotations

from collections.abc import Iterator
from unittest import mock

import pytest
from django.conf import settings
from django.contrib import admin
from django.contrib.auth.models import Permission, User
from django.db import IntegrityError, connection, transaction
from django.test import Client, override_settings
from django.test.utils import CaptureQueriesContext
from django.urls import path, reverse

from django_dbqueue import about, batch, chain, enqueue_many, job, jobs_for, lifecycle, operations, payload
from django_dbqueue.admin.about import JobsAboutMixin
from django_dbqueue.admin.failed import FailedJobAdmin
from django_dbqueue.admin.jobs import JobAdmin
from django_dbqueue.handles import JobStatus
from django_dbqueue.models import CANCELLED_CLASS, FailedJob, FinishedJob, Job, JobReference
from tests.conftest import run_worker
from tests.testapp import jobs
from tests.testapp.models import Order

pytestmark = pytest.mark.django_db


@job(name="tests.about.charge")
def charge(order: Order) -> None:
    pass


@job(name="tests.about.ship", tries=1)
def ship(order: Order, carrier: str = "post") -> None:
    if carrier == "broken":
        raise ConnectionError(f"carrier unreachable for order {order.number}")


@job(name="tests.about.compare")
def compare(orders: list[Order], best: Order | None = None, pair: tuple[Order, ...] = ()) -> None:
    pass


@pytest.fixture
def keep() -> Iterator[None]:
    with override_settings(DBQUEUE={**settings.DBQUEUE, "KEEP_FINISHED": 24}):
        yield


@pytest.fixture
def order() -> Order:
    return Order.objects.create(number="A-1")


@pytest.fixture
def other() -> Order:
    return Order.objects.create(number="B-2")


def referenced(obj: Order) -> set[int]:
    return set(JobReference.objects.filter(ref=payload.reference(Order, obj.pk)).values_list("job_id", flat=True))


# -- recorded at enqueue, found by jobs_for -----------------------------------------------------


@pytest.mark.django_db(transaction=True)  # chain progress is written on a connection of its own
def test_jobs_for_an_order_after_a_chain_and_a_batch_about_it(keep, order, other):
    plain = jobs.touch_order.enqueue(order)
    first = chain(charge.bind(order), ship.bind(order, carrier="van")).enqueue()
    members = batch(charge.bind(order), charge.bind(other), jobs.add.bind(1, 2)).enqueue()
    in_batch = set(Job.objects.filter(batch_id=members.id).values_list("pk", flat=True))
    (member,) = in_batch & referenced(order)
    (member_of_other,) = in_batch & referenced(other)
    found = jobs_for(order)
    # Newest first: the batch's member, the chain's first step, the plain job; not the other order's.
    assert [handle.id for handle in found.queued] == [member, first.id, plain.id]
    assert [handle.name for handle in found.queued] == [
        "tests.about.charge",
        "tests.about.charge",
        "tests.testapp.jobs.touch_order",
    ]
    assert all(handle.status == JobStatus.WAITING and handle.job is not None for handle in found.queued)
    assert found.failed == [] and found.finished == []
    assert [handle.id for handle in jobs_for(other).queued] == [member_of_other]

    run_worker()
    # The chain's next step was recorded when it was enqueued, in the transaction that ended the first.
    found = jobs_for(order)
    assert found.queued == [] and found.failed == []
    names = [row.name for row in found.finished]
    assert sorted(names) == [
        "tests.about.charge",
        "tests.about.charge",
        "tests.about.ship",
        "tests.testapp.jobs.touch_order",
    ]
    assert {row.outcome for row in found.finished} == {"succeeded"}
    assert found.finished[0].name == "tests.about.ship"  # newest first
    assert len(jobs_for(order, limit=2).finished) == 2


def test_the_handles_follow_a_failed_job_retried_and_a_cancelled_one(keep, order):
    failing = ship.enqueue(order, carrier="broken")
    waiting = charge.enqueue(order)
    assert lifecycle.cancel(waiting.id, reason="not needed") == "cancelled"
    run_worker()
    found = jobs_for(order)
    assert found.queued == []
    statuses = {handle.id: handle.status for handle in found.failed}
    assert statuses == {failing.id: JobStatus.FAILED, waiting.id: JobStatus.CANCELLED}
    assert {row.job_id: row.outcome for row in found.finished} == {failing.id: "failed", waiting.id: "cancelled"}

    failed_id = FailedJob.objects.get(job_id=failing.id).pk
    assert operations.retry_failed_ids([failed_id]) == 1
    new = Job.objects.get(name="tests.about.ship")
    # The new run is recorded in the retry's transaction; the failed run's stay with its history row.
    assert {failing.id, new.pk} <= referenced(order)
    found = jobs_for(order)
    assert [(handle.id, handle.status) for handle in found.queued] == [(new.pk, JobStatus.WAITING)]
    assert [handle.id for handle in found.failed] == [waiting.id]
    assert failing.id in {row.job_id for row in found.finished}


def test_a_retry_without_history_moves_the_job_to_its_new_id(order):
    failing = ship.enqueue(order, carrier="broken")
    run_worker()
    assert [handle.status for handle in jobs_for(order).failed] == [JobStatus.FAILED]
    lifecycle.retry(FailedJob.objects.filter(job_id=failing.id))
    new = Job.objects.get()
    found = jobs_for(order)
    assert [handle.id for handle in found.queued] == [new.pk] and found.failed == [] and found.finished == []
    # The failed run's references are in no table's job now: pruned.
    assert about.prune() == 1
    assert referenced(order) == {new.pk}


def test_every_object_among_the_arguments_is_recorded_once(order, other):
    third = Order.objects.create(number="C-3")
    handle = compare.enqueue([order, other, order], best=third, pair=(other,))
    refs = set(JobReference.objects.filter(job_id=handle.id).values_list("ref", flat=True))
    assert refs == {payload.reference(Order, obj.pk) for obj in (order, other, third)}
    assert [h.id for h in jobs_for(third).queued] == [handle.id]


def test_enqueue_many_records_each_job_it_inserts(order, other):
    handles = enqueue_many([charge.bind(order), charge.bind(other), jobs.add.bind(1, 2), charge.bind(order)])
    counted = enqueue_many([charge.bind(order), jobs.add.bind(3, 4)], handles=False)
    assert counted == 2
    if not connection.features.can_return_rows_from_bulk_insert:
        pytest.skip("plain MySQL returns no ids from a multi-row insert: its jobs are not recorded")
    assert len(referenced(order)) == 3 and referenced(other) == {handles[1].id}
    assert JobReference.objects.count() == 4


@pytest.mark.django_db(transaction=True)  # chain progress is written on a connection of its own
def test_a_job_without_model_arguments_writes_no_reference_row(order):
    with CaptureQueriesContext(connection) as queries:
        jobs.add.enqueue(1, 2)
        enqueue_many([jobs.add.bind(i, i) for i in range(5)])
        enqueue_many([jobs.add.bind(i, i) for i in range(5)], handles=False)
        chain(jobs.add.bind(1, 2), jobs.record.bind("x")).enqueue()
        batch(jobs.add.bind(1, 2), jobs.add.bind(3, 4)).enqueue()
    assert not any("dbqueue_job_reference" in query["sql"] for query in queries.captured_queries)
    run_worker()
    assert not JobReference.objects.exists()
    # One statement for one job on PostgreSQL, as before; one too for a job about an order, its references with it.
    with CaptureQueriesContext(connection) as queries:
        jobs.add.enqueue(1, 2)
    with CaptureQueriesContext(connection) as about_order:
        jobs.touch_order.enqueue(order)
    if connection.vendor == "postgresql":
        assert len(queries.captured_queries) == 1 and len(about_order.captured_queries) == 1
    assert JobReference.objects.count() == 1


def test_references_roll_back_with_a_rolled_back_enqueue(order):
    with pytest.raises(RuntimeError), transaction.atomic():
        jobs.touch_order.enqueue(order)
        enqueue_many([charge.bind(order), charge.bind(order)])
        chain(charge.bind(order), ship.bind(order)).enqueue()
        raise RuntimeError("the order's transaction fails")
    assert not Job.objects.exists() and not JobReference.objects.exists()
    assert len(jobs_for(order)) == 0


@pytest.mark.django_db(transaction=True)
def test_a_job_outside_a_transaction_is_stored_with_its_references_or_not_at_all(order):
    handle = jobs.touch_order.enqueue(order)
    assert referenced(order) == {handle.id}
    # References the table refuses (twice the same object for one job): the job is not stored either.
    twice = [payload.reference(Order, order.pk)] * 2
    with mock.patch("django_dbqueue.insert.references", return_value=twice), pytest.raises(IntegrityError):
        jobs.touch_order.enqueue(order)
    assert list(Job.objects.values_list("pk", flat=True)) == [handle.id]
    assert referenced(order) == {handle.id}


def test_prune_deletes_only_the_references_of_jobs_in_no_table(order, other):
    charge.enqueue(other)
    queued = charge.enqueue(order)
    failing = ship.enqueue(order, carrier="broken")
    Job.objects.filter(pk=queued.id).update(available_at=Job.objects.get(pk=queued.id).available_at.replace(year=2999))
    run_worker()
    assert about.prune() == 1  # the job that succeeded, without history
    assert referenced(other) == set()
    assert referenced(order) == {queued.id, failing.id}
    assert about.prune() == 0


def test_jobs_for_refuses_an_unsaved_object_and_a_bad_limit(order):
    with pytest.raises(ValueError, match="not saved"):
        jobs_for(Order(number="new"))
    with pytest.raises(ValueError, match="limit"):
        jobs_for(order, limit=0)


def test_a_reference_names_the_concrete_model_and_the_pk():
    assert payload.reference(Order, 42) == "testapp.order:42"
    text = payload.dumps({"v": 1, "args": [{"__dbq__": "model", "v": ["nosuch.thing", 7]}], "kwargs": {}})
    assert payload.references(text) == ["nosuch.thing:7"]
    assert payload.references('{"args":[1],"kwargs":{}}') == []
    assert payload.references('{"__dbq__":"model" not json') == []


# -- the admin mixin --------------------------------------------------------------------------

site = admin.AdminSite(name="about_admin")


class OrderAdmin(JobsAboutMixin, admin.ModelAdmin):  # type: ignore[type-arg]
    pass


site.register(Order, OrderAdmin)
site.register(Job, JobAdmin)
site.register(FailedJob, FailedJobAdmin)
urlpatterns = [path("about-admin/", site.urls)]
on_this_site = override_settings(ROOT_URLCONF=__name__)


def client_with(*permissions: str, csrf: bool = False) -> Client:
    """A staff user's client with these permissions (``app_label.codename``)."""
    user = User.objects.create_user(f"user{User.objects.count()}", password="pw", is_staff=True)
    for permission in permissions:
        app_label, codename = permission.split(".")
        user.user_permissions.add(Permission.objects.get(content_type__app_label=app_label, codename=codename))
    client = Client(enforce_csrf_checks=csrf)
    client.force_login(user)
    return client


def page(order: Order) -> str:
    return reverse("about_admin:testapp_order_change", args=[order.pk])


def action(order: Order) -> str:
    return reverse("about_admin:testapp_order_jobs_about", args=[order.pk])


@on_this_site
def test_the_order_page_lists_its_jobs_with_retry_and_cancel(admin_client, order, other):
    waiting = charge.enqueue(order)
    failing = ship.enqueue(order, carrier="broken")
    charge.enqueue(other)
    Job.objects.filter(pk=waiting.id).update(
        available_at=Job.objects.get(pk=waiting.id).available_at.replace(year=2999)
    )
    run_worker()
    html = admin_client.get(page(order)).content.decode()
    assert "Jobs about this order" in html and "In the queue" in html and "Failed or cancelled" in html
    assert f'value="cancel:{waiting.id}"' in html and f'value="retry:{failing.id}"' in html
    assert "ConnectionError: carrier unreachable for order A-1" in html
    assert html.count('class="jobs-about-job"') == 2  # not the other order's job
    failed = FailedJob.objects.get(job_id=failing.id)
    assert reverse("about_admin:django_dbqueue_failedjob_change", args=[failed.pk]) in html
    assert '<form id="jobs-about-form" method="post"' in html

    response = admin_client.post(action(order), {"jobs_about": f"retry:{failing.id}"})
    assert response.status_code == 302 and response["Location"] == page(order)
    assert not FailedJob.objects.filter(job_id=failing.id).exists()
    new = Job.objects.get(name="tests.about.ship")
    assert [handle.id for handle in jobs_for(order).queued] == [new.pk, waiting.id]

    response = admin_client.post(action(order), {"jobs_about": f"cancel:{waiting.id}"})
    assert response.status_code == 302
    assert FailedJob.objects.get(job_id=waiting.id).exception_class == CANCELLED_CLASS
    messages = [str(m) for m in response.wsgi_request._messages]  # type: ignore[attr-defined]
    assert messages[-1] == f"Job {waiting.id} was cancelled; it is listed with the failed jobs."


@on_this_site
def test_the_buttons_check_permissions_csrf_and_the_object(order, other):
    waiting = charge.enqueue(order)
    failing = ship.enqueue(order, carrier="broken")
    elsewhere = charge.enqueue(other)
    Job.objects.exclude(pk=failing.id).update(
        available_at=Job.objects.get(pk=waiting.id).available_at.replace(year=2999)
    )
    run_worker()

    # Without the queue's view permissions, the page shows no job.
    viewer = client_with("testapp.view_order")
    html = viewer.get(page(order)).content.decode()
    assert viewer.get(page(order)).status_code == 200 and "Jobs about this order" not in html
    # Viewing the jobs shows no buttons without the permissions to act; posting is refused.
    reader = client_with("testapp.view_order", "django_dbqueue.view_job", "django_dbqueue.view_failedjob")
    html = reader.get(page(order)).content.decode()
    assert "Jobs about this order" in html and html.count('class="jobs-about-job"') == 2
    assert "cancel:" not in html and "retry:" not in html
    assert reader.post(action(order), {"jobs_about": f"cancel:{waiting.id}"}).status_code == 403
    assert reader.post(action(order), {"jobs_about": f"retry:{failing.id}"}).status_code == 403
    assert Job.objects.filter(pk=waiting.id).exists() and FailedJob.objects.filter(job_id=failing.id).exists()
    # Cancel needs cancel_job; retry change_failedjob and add_job.
    canceller = client_with("testapp.view_order", "django_dbqueue.view_job", "django_dbqueue.cancel_job")
    assert canceller.post(action(order), {"jobs_about": f"retry:{failing.id}"}).status_code == 403
    # A job not about this order is left alone.
    response = canceller.post(action(order), {"jobs_about": f"cancel:{elsewhere.id}"}, follow=True)
    assert f"Job {elsewhere.id} is not about this order." in response.content.decode()
    assert Job.objects.filter(pk=elsewhere.id).exists()
    assert canceller.post(action(order), {"jobs_about": "cancel:x"}).status_code == 400
    assert canceller.get(action(order)).status_code == 405
    # No user without the object's own permission, and none without the page's CSRF token.
    stranger = client_with("django_dbqueue.view_job", "django_dbqueue.cancel_job")
    assert stranger.post(action(order), {"jobs_about": f"cancel:{waiting.id}"}).status_code == 403
    guarded = client_with("testapp.view_order", "django_dbqueue.cancel_job", csrf=True)
    assert guarded.post(action(order), {"jobs_about": f"cancel:{waiting.id}"}).status_code == 403
    assert Job.objects.filter(pk=waiting.id).exists()
    assert canceller.post(action(order), {"jobs_about": f"cancel:{waiting.id}"}).status_code == 302
    assert not Job.objects.filter(pk=waiting.id).exists()


@on_this_site
def test_finished_jobs_show_with_history_kept(keep, admin_client, order):
    charge.enqueue(order)
    run_worker()
    html = admin_client.get(page(order)).content.decode()
    assert "Finished (history)" in html and "succeeded" in html
    assert FinishedJob.objects.count() == 1
