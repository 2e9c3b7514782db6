"""``manage.py queue_prune_progress --hours N``: delete old progress rows."""

from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand

from django_dbqueue.management.options import hours
from django_dbqueue.progress import prune


class Command(BaseCommand):
    help = "Delete progress rows (of jobs and chains) not updated for N hours."

    def add_arguments(self, parser: Any) -> None:
        parser.add_argument(
            "--hours", type=hours, required=True, help="Delete rows older than this many hours (required)."
        )

    def handle(self, *args: Any, **options: Any) -> None:
        count = prune(options["hours"])
        self.stdout.write(self.style.SUCCESS(f"Deleted {count} progress row(s) older than {options['hours']:g} h."))
