"""``manage.py queue_prune_progress --hours N``: delete old progress rows."""

from __future__ import annotations

import argparse
from typing import Any

from django.core.management.base import BaseCommand

from django_dbqueue.progress import prune


def _hours(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of hours") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{text!r} must be more than 0")
    return value


class Command(BaseCommand):
    help = "Delete progress rows (of jobs and chains) not updated for N hours."

    def add_arguments(self, parser: Any) -> None:
        parser.add_argument("--hours", type=_hours, required=True,
                            help="Delete rows older than this many hours (required).")

    def handle(self, *args: Any, **options: Any) -> None:
        count = prune(options["hours"])
        self.stdout.write(self.style.SUCCESS(f"Deleted {count} progress row(s) older than {options['hours']:g} h."))
