"""``manage.py queue_prune_batches --hours N``: delete batches that finished long ago."""

from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand

from django_dbqueue import batches
from django_dbqueue.management.options import hours


class Command(BaseCommand):
    help = (
        "Delete the batches that finished more than N hours ago, e.g. daily from cron. "
        "Their failed members stay in the failed jobs (retried, they run outside any batch)."
    )

    def add_arguments(self, parser: Any) -> None:
        parser.add_argument(
            "--hours",
            type=hours,
            metavar="N",
            required=True,
            help="Delete batches finished more than N hours ago, N > 0 (required, no default).",
        )

    def handle(self, *args: Any, **opts: Any) -> None:
        count = batches.prune(opts["hours"])
        self.stdout.write(self.style.SUCCESS(f"Deleted {count} batch(es) finished more than {opts['hours']:g} h ago."))
