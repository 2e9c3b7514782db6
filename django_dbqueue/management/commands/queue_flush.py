from typing import Any

from django_dbqueue import operations
from django_dbqueue.management.base import QueueCommand
from django_dbqueue.management.output import plural


class Command(QueueCommand):
    help = (
        "Delete every failed job, or with --hours only those that failed more than N hours ago, "
        "after a confirmation (--force for scripts)."
    )

    def add_arguments(self, parser: Any) -> None:
        self.add_hours(parser, "Only delete failed jobs older than N hours (default: delete all).", required=False)
        self.add_confirmation(parser)

    def handle(self, *args: Any, **opts: Any) -> None:
        counted = operations.prunable(opts["hours"])
        older = f" older than {opts['hours']:g} hours" if opts["hours"] is not None else ""
        if not counted.count:
            self.success(f"No failed jobs{older}: nothing to delete.")
            return
        self.delete_confirmed(
            opts,
            f"{plural(counted.count, 'failed job')}{older}",
            lambda: f"{operations.prune_failed(counted=counted)} failed job(s){older} were deleted.",
        )
