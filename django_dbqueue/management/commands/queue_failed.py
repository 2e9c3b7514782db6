from typing import Any

from django.utils import timezone

from django_dbqueue import operations
from django_dbqueue.management.base import QueueCommand
from django_dbqueue.models import FailedJob


def _row(job: FailedJob) -> list[str]:
    failed_at = timezone.localtime(job.failed_at).strftime("%Y-%m-%d %H:%M")
    # Built-in exceptions are known by their bare name.
    return [str(job.pk), job.queue, job.name, failed_at, job.exception_class.removeprefix("builtins.")]


class Command(QueueCommand):
    help = "List the failed jobs, newest first: id, queue, name, when it failed and the exception class."

    def add_arguments(self, parser: Any) -> None:
        self.add_queue(parser, "Only the failed jobs of this queue (default: every queue).")
        parser.add_argument("--name", help="Only the failed jobs with this job name (default: every name).")
        self.add_limit(parser, "failed jobs")

    def handle(self, *args: Any, **opts: Any) -> None:
        self.listing(
            operations.failed_jobs(queue=opts["queue"], name=opts["name"]),
            opts["limit"],
            "failed jobs",
            ["id", "queue", "name", "failed at", "exception class"],
            _row,
            shrink=(1, 2, 4),
            right=(0,),
        )
