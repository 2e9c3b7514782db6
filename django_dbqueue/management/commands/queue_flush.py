"""``manage.py queue_flush``: delete every failed job, or those older than --hours, after a confirmation."""

from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand

from django_dbqueue import operations
from django_dbqueue.management import options, output


class Command(BaseCommand):
    help = (
        "Delete every failed job, or with --hours only those that failed more than N hours ago, "
        "after a confirmation (--force for scripts)."
    )
    # Tests pass a stand-in for the terminal.
    stealth_options = ("stdin",)

    def add_arguments(self, parser: Any) -> None:
        parser.add_argument(
            "--hours",
            type=options.hours,
            metavar="N",
            default=None,
            help="Only delete failed jobs older than N hours (default: delete all).",
        )
        output.add_confirmation_arguments(parser)

    def handle(self, *args: Any, **opts: Any) -> None:
        counted = operations.prunable(opts["hours"])
        older = f" older than {opts['hours']:g} hours" if opts["hours"] is not None else ""
        if not counted.count:
            self.stdout.write(self.style.SUCCESS(f"No failed jobs{older}: nothing to delete."))
            return
        failed = output.plural(counted.count, "failed job")
        if not output.confirm(
            self.stdout, opts, doing=f"Deleting {failed}{older}", question=f"Delete {failed}{older}?"
        ):
            self.stdout.write("Nothing was deleted.")
            return
        deleted = operations.prune_failed(counted=counted)
        self.stdout.write(self.style.SUCCESS(f"{deleted} failed job(s){older} were deleted."))
