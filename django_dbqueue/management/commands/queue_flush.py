"""``manage.py queue_flush``: delete every failed job, or those older than --hours."""

from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand

from django_dbqueue import operations
from django_dbqueue.management import options


class Command(BaseCommand):
    help = "Delete every failed job, or with --hours only those that failed more than N hours ago."

    def add_arguments(self, parser: Any) -> None:
        parser.add_argument(
            "--hours",
            type=options.hours,
            metavar="N",
            default=None,
            help="Only delete failed jobs older than N hours (default: delete all).",
        )

    def handle(self, *args: Any, **opts: Any) -> None:
        deleted = operations.prune_failed(opts["hours"])
        older = f" older than {opts['hours']:g} hours" if opts["hours"] is not None else ""
        self.stdout.write(self.style.SUCCESS(f"{deleted} failed job(s){older} were deleted."))
