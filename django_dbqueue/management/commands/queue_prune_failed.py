"""``manage.py queue_prune_failed``: delete the failed jobs older than --hours."""

from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand

from django_dbqueue import operations
from django_dbqueue.management import options


class Command(BaseCommand):
    help = "Delete the failed jobs that failed more than --hours ago, e.g. daily from cron."

    def add_arguments(self, parser: Any) -> None:
        parser.add_argument(
            "--hours",
            type=options.hours,
            metavar="N",
            required=True,
            help="Delete failed jobs older than N hours, N > 0 (required, no default).",
        )

    def handle(self, *args: Any, **opts: Any) -> None:
        deleted = operations.prune_failed(opts["hours"])
        self.stdout.write(
            self.style.SUCCESS(f"{deleted} failed job(s) older than {opts['hours']:g} hours were deleted.")
        )
