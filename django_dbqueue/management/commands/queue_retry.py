"""``manage.py queue_retry``: put failed jobs back on the queue as fresh jobs."""

from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand, CommandError

from django_dbqueue import operations
from django_dbqueue.exceptions import FailedJobsNotFound
from django_dbqueue.management import options

USAGE = "Say which failed jobs to retry: ids (queue_retry 3 5-9 12,14), --queue QUEUE, --name NAME, or all."


class Command(BaseCommand):
    help = (
        "Put failed jobs back on the queue as fresh jobs, in one transaction: by id "
        "(3 5-9 12,14), by --queue and/or --name, or all of them."
    )

    def add_arguments(self, parser: Any) -> None:
        parser.add_argument(
            "ids",
            nargs="*",
            type=options.ids_or_all,
            metavar="ID",
            help="Failed job ids: 3, a range 5-9, a list 12,14; or the word 'all'.",
        )
        parser.add_argument(
            "--queue",
            type=options.queue_name,
            default=None,
            help="Retry the failed jobs of this queue (default: any queue, if --name is given).",
        )
        parser.add_argument(
            "--name",
            default=None,
            help="Retry the failed jobs with this job name (default: any name, if --queue is given).",
        )

    def handle(self, *args: Any, **opts: Any) -> None:
        specs = [spec for spec in opts["ids"] if spec != options.ALL]
        every = options.ALL in opts["ids"]
        filtered = opts["queue"] is not None or opts["name"] is not None
        selectors = [bool(specs), every, filtered]
        if not any(selectors):
            raise CommandError(USAGE)
        if sum(selectors) > 1:
            raise CommandError("Pass ids, --queue/--name, or all: one kind of selection at a time.")
        if specs:
            try:
                count = len(operations.retry_failed_ids(operations.parse_ids(specs)))
            except FailedJobsNotFound as exc:
                raise CommandError(f"Nothing was retried: {exc}.") from None
        else:
            count = operations.retry_failed(operations.failed_jobs(queue=opts["queue"], name=opts["name"]))
        if not count:
            self.stdout.write(self.style.WARNING("No failed job matched: 0 job(s) were put back on the queue."))
            return
        self.stdout.write(self.style.SUCCESS(f"{count} job(s) were put back on the queue."))
