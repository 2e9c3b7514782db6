"""The demo's own tests, written as a project tests its jobs: ``python manage.py test demo`` (with
``DJANGO_SECRET_KEY`` set: the test runner turns ``DEBUG`` off, and then check demo.E001 refuses the
example's published key).

``JobsTestMixin`` (django_dbqueue.testing) runs the enqueued jobs in the test, through the
worker's own path, and asserts what was enqueued without running it (docs/howto/testing.md).
"""

from decimal import Decimal

from django.test import TestCase, TransactionTestCase
from django.urls import reverse

from django_dbqueue.models import FailedJob
from django_dbqueue.testing import JobsTestMixin

from . import jobs
from .models import Order


class JobTests(JobsTestMixin, TestCase):
    def test_a_welcome_email_is_enqueued_with_its_address(self) -> None:
        jobs.send_welcome_email.enqueue("ada@example.com")

        self.assertEnqueued(jobs.send_welcome_email, "ada@example.com")
        self.assertNotEnqueued(jobs.send_welcome_email, "bob@example.com")

    def test_an_order_is_confirmed_by_its_job(self) -> None:
        order = Order.objects.create(number="A-1", email="ada@example.com", total=Decimal("9.90"))
        jobs.confirm_order.enqueue(order)
        self.assertEnqueued(jobs.confirm_order, order)

        self.run_jobs().assert_succeeded()

        order.refresh_from_db()
        self.assertEqual(order.status, Order.Status.CONFIRMED)

    def test_the_crm_sync_succeeds_on_its_retry(self) -> None:
        jobs.sync_customer_to_crm.enqueue("ada@example.com")

        ran = self.run_jobs()

        self.assertEqual([(run.outcome, run.attempt) for run in ran], [("released", 1), ("succeeded", 2)])
        self.assertIn("CRM did not answer", ran[0].error)

    def test_the_warehouse_job_fails_for_good_after_its_tries(self) -> None:
        jobs.notify_warehouse.enqueue("A-2")

        ran = self.run_jobs()

        self.assertEqual([run.outcome for run in ran], ["released", "failed"])
        self.assertEqual(FailedJob.objects.get().name, "demo.jobs.notify_warehouse")

    def test_the_album_batch_counts_its_broken_images_and_runs_on_finish_once(self) -> None:
        handle = jobs.process_album("holiday", images=30, seconds=0).enqueue()

        ran = self.run_jobs()

        self.assertEqual(len(ran.failed), len(jobs.BROKEN_IMAGES))
        self.assertEqual(len(ran.of(jobs.album_processed)), 1)
        handle.refresh()
        self.assertEqual((handle.state, handle.failed), ("failed", len(jobs.BROKEN_IMAGES)))

    def test_the_batch_page_enqueues_one_job_per_image(self) -> None:
        response = self.client.post(reverse("demo:start_batch"), {"album": "holiday"})

        self.assertEqual(response.status_code, 302)
        self.assertEqual(len(self.enqueued_jobs(name=jobs.process_image)), jobs.IMAGES)
        self.assertEnqueued(jobs.process_image, "holiday", 13)


class ChainTests(JobsTestMixin, TransactionTestCase):
    # The page writes the chain's first progress through a connection of its own (progress is never
    # rolled back with a transaction), which a TestCase's open transaction would keep waiting.

    def test_the_video_page_enqueues_a_chain_that_runs_to_its_end(self) -> None:
        response = self.client.post(reverse("demo:index"), {"title": "Holiday"})
        self.assertEqual(response.status_code, 302)
        self.assertEnqueued(jobs.fetch_footage, "Holiday", jobs.STEP_SECONDS)

        ran = self.run_jobs(max_seconds=120)

        steps = [jobs.fetch_footage, jobs.encode_video, jobs.burn_subtitles, jobs.publish_video]
        self.assertEqual(ran.names(), [step.name for step in steps])
        ran.assert_succeeded()
