"""``manage.py queue_prune_results --hours N``: delete old django.tasks results."""

from __future__ import annotations

from typing import Any

import django
from django.core.management.base import BaseCommand, CommandError

from django_dbqueue.management.options import hours


class Command(BaseCommand):
    help = "Delete the results of django.tasks tasks that finished more than N hours ago."

    def add_arguments(self, parser: Any) -> None:
        parser.add_argument(
            "--hours",
            type=hours,
            required=True,
            help="Delete results finished longer ago than this many hours (required).",
        )

    def handle(self, *args: Any, **options: Any) -> None:
        if django.VERSION < (6, 0):
            raise CommandError("Task results exist only with django.tasks, which needs Django 6.0 or newer.")
        from django_dbqueue.tasks import prune_results

        count = prune_results(options["hours"])
        self.stdout.write(
            self.style.SUCCESS(f"Deleted {count} task result(s) finished more than {options['hours']:g} h ago.")
        )
