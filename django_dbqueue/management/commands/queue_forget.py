"""``manage.py queue_forget``: delete failed jobs by id."""

from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand, CommandError

from django_dbqueue import operations
from django_dbqueue.exceptions import FailedJobsNotFound
from django_dbqueue.management import options


class Command(BaseCommand):
    help = "Delete failed jobs by id (3 5-9 12,14); if any id does not exist, nothing is deleted."

    def add_arguments(self, parser: Any) -> None:
        parser.add_argument(
            "ids", nargs="+", type=options.ids, metavar="ID", help="Failed job ids: 3, a range 5-9, a list 12,14."
        )

    def handle(self, *args: Any, **opts: Any) -> None:
        try:
            deleted = operations.delete_failed_ids(operations.parse_ids(opts["ids"]))
        except FailedJobsNotFound as exc:
            raise CommandError(f"Nothing was deleted: {exc}.") from None
        self.stdout.write(self.style.SUCCESS(f"{deleted} failed job(s) were deleted."))
