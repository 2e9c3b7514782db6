"""``manage.py queue_failed``: list the failed jobs, newest first."""

from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand
from django.utils import timezone

from django_dbqueue import operations
from django_dbqueue.management import options, output

DEFAULT_LIMIT = 50


class Command(BaseCommand):
    help = "List the failed jobs, newest first: id, queue, name, when it failed and the exception class."

    def add_arguments(self, parser: Any) -> None:
        parser.add_argument(
            "--queue",
            type=options.queue_name,
            default=None,
            help="Only the failed jobs of this queue (default: every queue).",
        )
        parser.add_argument(
            "--name", default=None, help="Only the failed jobs with this job name (default: every name)."
        )
        parser.add_argument(
            "--limit",
            type=options.whole_number(1),
            default=DEFAULT_LIMIT,
            metavar="N",
            help=f"Show at most N failed jobs (default: {DEFAULT_LIMIT}).",
        )

    def handle(self, *args: Any, **opts: Any) -> None:
        failed = operations.failed_jobs(queue=opts["queue"], name=opts["name"])
        shown = list(failed[: opts["limit"]])
        if not shown:
            self.stdout.write(self.style.SUCCESS("No failed jobs."))
            return
        rows = [
            [
                str(row.pk),
                row.queue,
                row.name,
                timezone.localtime(row.failed_at).strftime("%Y-%m-%d %H:%M"),
                # Built-in exceptions are known by their bare name.
                row.exception_class.removeprefix("builtins."),
            ]
            for row in shown
        ]
        headers = ["id", "queue", "name", "failed at", "exception class"]
        for line in output.table(headers, rows, shrink=(1, 2, 4), right=(0,)):
            self.stdout.write(line)
        total = failed.count() if len(shown) == opts["limit"] else len(shown)
        if total > len(shown):
            self.stdout.write(f"{len(shown)} of {total} failed jobs shown; --limit shows more.")
