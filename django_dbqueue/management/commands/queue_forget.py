from typing import Any

from django_dbqueue import operations
from django_dbqueue.exceptions import FailedJobsNotFound
from django_dbqueue.management.base import IDS, QueueCommand


class Command(QueueCommand):
    help = "Delete failed jobs by id (3 5-9 12,14); if any id does not exist, nothing is deleted."

    def add_arguments(self, parser: Any) -> None:
        self.add_ids(parser, f"Failed job ids: {IDS}.")

    def handle(self, *args: Any, **opts: Any) -> None:
        with self.refusing(FailedJobsNotFound, "deleted"):
            deleted = operations.delete_failed_ids(operations.parse_ids(opts["ids"]))
        self.success(f"{deleted} failed job(s) were deleted.")
