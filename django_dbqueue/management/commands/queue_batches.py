"""``manage.py queue_batches``: list the batches, newest first."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from django.core.management.base import BaseCommand
from django.db.models import Q

from django_dbqueue.db import DbNow
from django_dbqueue.management import options, output
from django_dbqueue.models import JobBatch

DEFAULT_LIMIT = 50

# ``JobBatch.state`` as filters; tests check that each selects exactly the rows of its state.
STATES: dict[str, Q] = {
    "running": Q(cancelled_at__isnull=True, finished_at__isnull=True),
    "finished": Q(cancelled_at__isnull=True, finished_at__isnull=False, failed=0),
    "failed": Q(cancelled_at__isnull=True, finished_at__isnull=False, failed__gt=0),
    "cancelling": Q(cancelled_at__isnull=False, finished_at__isnull=True),
    "cancelled": Q(cancelled_at__isnull=False, finished_at__isnull=False),
}


def _ago(moment: datetime | None, clock: datetime) -> str:
    return f"{output.age((clock - moment).total_seconds())} ago" if moment is not None else "-"


def _percent(row: JobBatch) -> int:
    """Rounded down, so 100 only once every member ended (``JobBatch.percent`` rounds to 2 places)."""
    return 100 * row.done // row.total if row.total else 100


class Command(BaseCommand):
    help = (
        "List the batches, newest first: id, name, state, members ended of all, percent, failed and "
        "cancelled members, and how long ago each batch was created and finished."
    )

    def add_arguments(self, parser: Any) -> None:
        parser.add_argument(
            "--state",
            choices=list(STATES),
            nargs="+",
            action="extend",
            default=None,
            help="Only the batches in these states (default: every state).",
        )
        parser.add_argument("--name", default=None, help="Only the batches with this name (default: every name).")
        parser.add_argument(
            "--limit",
            type=options.whole_number(1),
            default=DEFAULT_LIMIT,
            metavar="N",
            help=f"Show at most N batches (default: {DEFAULT_LIMIT}).",
        )

    def handle(self, *args: Any, **opts: Any) -> None:
        selected = JobBatch.objects.order_by("-created_at", "-id")
        if opts["state"]:
            condition = Q()
            for state in dict.fromkeys(opts["state"]):
                condition |= STATES[state]
            selected = selected.filter(condition)
        if opts["name"] is not None:
            selected = selected.filter(name=opts["name"])
        # Ages are read against the database's clock, the one that wrote the times.
        shown = list(selected.annotate(clock=DbNow())[: opts["limit"]])
        if not shown:
            self.stdout.write(self.style.SUCCESS("No batches."))
            return
        rows = [
            [
                str(row.pk),
                row.name or "-",
                row.state,
                f"{row.done}/{row.total}",
                f"{_percent(row)}%",
                str(row.failed),
                str(row.cancelled),
                _ago(row.created_at, row.clock),
                _ago(row.finished_at, row.clock),
            ]
            for row in shown
        ]
        headers = ["id", "name", "state", "done", "%", "failed", "cancelled", "created", "finished"]
        for line in output.table(headers, rows, shrink=(1,), right=(0, 3, 4, 5, 6)):
            self.stdout.write(line)
        total = selected.count() if len(shown) == opts["limit"] else len(shown)
        if total > len(shown):
            self.stdout.write(f"{len(shown)} of {total} batches shown; --limit shows more.")
