"""``manage.py queue_prune_results --hours N``: delete old kept results of jobs and tasks."""

from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand

from django_dbqueue.management.options import hours


class Command(BaseCommand):
    help = "Delete the kept results of jobs and django.tasks tasks that finished more than N hours ago."

    def add_arguments(self, parser: Any) -> None:
        parser.add_argument(
            "--hours",
            type=hours,
            required=True,
            help="Delete results finished longer ago than this many hours (required).",
        )

    def handle(self, *args: Any, **options: Any) -> None:
        from django_dbqueue.handles import prune_results

        count = prune_results(options["hours"])
        self.stdout.write(
            self.style.SUCCESS(f"Deleted {count} result(s) finished more than {options['hours']:g} h ago.")
        )
