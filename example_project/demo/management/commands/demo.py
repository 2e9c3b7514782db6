"""``manage.py demo``: enqueue the demo jobs, run a worker until the queue is empty, report."""

import dataclasses
import os
import secrets
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from decimal import Decimal
from typing import Any

from django.core.management import call_command
from django.core.management.base import BaseCommand, CommandError
from django.db import transaction

from demo import jobs
from demo.models import Order
from django_dbqueue import signals
from django_dbqueue.handles import JobHandle
from django_dbqueue.models import FailedJob, Job

EXPECTED_TO_FAIL = {jobs.notify_warehouse.name}


@dataclasses.dataclass
class Result:
    name: str
    status: str = "queued"
    attempts: int = 0
    errors: list[str] = dataclasses.field(default_factory=list)


class Command(BaseCommand):
    help = "Enqueue the demo jobs, run a worker until the queue is empty, and tell what happened."

    def add_arguments(self, parser: Any) -> None:
        parser.add_argument(
            "--report-seconds",
            type=float,
            default=3,
            help="How long the slow job (build_sales_report) takes (default: 3).",
        )

    def handle(self, *args: Any, **options: Any) -> None:
        order, enqueued = self.enqueue(options["report_seconds"])
        results = {row.pk: Result(row.name) for row in enqueued}
        self.stdout.write(
            self.style.MIGRATE_HEADING(f"Enqueued {len(enqueued)} jobs in one transaction with order {order.number}:")
        )
        for row in enqueued:
            self.stdout.write(f"  job {row.pk:<4} {row.name}")

        self.stdout.write(
            self.style.MIGRATE_HEADING(
                "Running a worker until the queue is empty (queue_work --stop-when-empty --sleep 0.1):"
            )
        )
        with self.watch(results):
            call_command("queue_work", "--stop-when-empty", "--sleep", "0.1")

        self.report(results, order)

    def enqueue(self, report_seconds: float) -> tuple[Order, list[JobHandle]]:
        """Create an order and enqueue one job per feature, all in one transaction."""
        with transaction.atomic():
            order = Order.objects.create(
                number=f"A-{secrets.token_hex(3).upper()}", email="ada@example.com", total=Decimal("42.50")
            )
            enqueued = [
                jobs.send_welcome_email.enqueue(order.email),
                jobs.sync_customer_to_crm.enqueue(order.email),
                jobs.notify_warehouse.enqueue(order.number),
                jobs.build_sales_report.enqueue(report_seconds),
                jobs.confirm_order.enqueue(order),
            ]
        return order, enqueued

    @staticmethod
    @contextmanager
    def watch(results: dict[int, Result]) -> Iterator[None]:
        """Record what happens to the jobs in ``results`` while the worker runs."""

        def seen(job: Job, status: str) -> Result | None:
            result = results.get(job.pk)
            if result is not None:
                result.status = status
                result.attempts = job.attempts
            return result

        def on_succeeded(sender: Any, job: Job, **kwargs: Any) -> None:
            seen(job, "succeeded")

        def on_released(sender: Any, job: Job, exception: BaseException | None = None, **kwargs: Any) -> None:
            result = seen(job, "released")
            if result is not None and exception is not None:
                result.errors.append(f"{type(exception).__name__}: {exception}")

        def on_failed(sender: Any, job: Job, exception: BaseException | None = None, **kwargs: Any) -> None:
            seen(job, "failed")

        receivers = [
            (signals.job_succeeded, on_succeeded),
            (signals.job_released, on_released),
            (signals.job_failed, on_failed),
        ]
        for signal, receiver in receivers:
            signal.connect(receiver, weak=False)
        try:
            yield
        finally:
            for signal, receiver in receivers:
                signal.disconnect(receiver)

    def report(self, results: dict[int, Result], order: Order) -> None:
        style = self.style
        self.stdout.write(style.MIGRATE_HEADING("What happened:"))
        width = max(len(result.name) for result in results.values())
        for result in results.values():
            line = f"  {result.name:<{width}}  {result.status:<9}  after {result.attempts} attempt(s)"
            if result.errors and result.status == "succeeded":
                line += f"; retried after {'; '.join(result.errors)}"
            paint = style.SUCCESS if result.status == "succeeded" else style.ERROR
            self.stdout.write(paint(line))

        succeeded = [r for r in results.values() if r.status == "succeeded"]
        retried = [r for r in succeeded if r.attempts > 1]
        self.stdout.write(f"{len(succeeded)} of {len(results)} jobs succeeded, {len(retried)} of them after a retry.")

        failed = list(FailedJob.objects.filter(job_id__in=results).order_by("id"))
        for failed_job in failed:
            self.stdout.write(
                style.WARNING(
                    f"In FailedJob: {failed_job.name} (FailedJob #{failed_job.pk}, job {failed_job.job_id}, "
                    f"{failed_job.attempts} attempts)"
                )
            )
            self.stdout.write(f"  last line of its error: {failed_job.error_summary}")
        total_failed = FailedJob.objects.count()
        if total_failed > len(failed):
            self.stdout.write(f"  (FailedJob holds {total_failed} rows in all, earlier runs included.)")

        order.refresh_from_db()
        self.stdout.write(f"Order {order.number} is now {order.get_status_display().lower()}.")

        manage = f"{_shown(sys.executable)} {_shown(sys.argv[0])}"
        self.stdout.write(style.MIGRATE_HEADING("Look around in the admin:"))
        self.stdout.write(
            f"  {manage} createsuperuser\n"
            f"  {manage} runserver\n"
            "  then open http://127.0.0.1:8000/admin/ (Failed jobs, Jobs, Orders)."
        )
        self.stdout.write(style.MIGRATE_HEADING("Watch a chain's or a batch's progress live (two terminals):"))
        self.stdout.write(
            f"  {manage} runserver\n"
            f"  {manage} queue_work\n"
            f'  then open http://127.0.0.1:8000/ and press "Start a long chain" or "Process {jobs.IMAGES} images".'
        )

        # A smoke test too: exit non-zero when the queue did not behave as the jobs promise.
        unexpected = [
            f"{r.name} {r.status}"
            for r in results.values()
            if r.status != ("failed" if r.name in EXPECTED_TO_FAIL else "succeeded")
        ]
        if unexpected or len(failed) != len(EXPECTED_TO_FAIL):
            raise CommandError(f"The demo did not go as expected: {', '.join(unexpected) or 'FailedJob rows missing'}")


def _shown(path: str) -> str:
    """Return ``path`` relative to the current directory when it is below it."""
    relative = os.path.relpath(path)
    return path if relative.startswith("..") else relative
