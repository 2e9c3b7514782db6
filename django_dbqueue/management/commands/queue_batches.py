from datetime import datetime
from typing import Any

from django.db.models import Q

from django_dbqueue.db import DbNow
from django_dbqueue.management.base import QueueCommand
from django_dbqueue.management.output import age
from django_dbqueue.models import JobBatch

# ``JobBatch.state`` as filters; tests check that each selects exactly the rows of its state.
STATES: dict[str, Q] = {
    "running": Q(cancelled_at__isnull=True, finished_at__isnull=True),
    "finished": Q(cancelled_at__isnull=True, finished_at__isnull=False, failed=0),
    "failed": Q(cancelled_at__isnull=True, finished_at__isnull=False, failed__gt=0),
    "cancelling": Q(cancelled_at__isnull=False, finished_at__isnull=True),
    "cancelled": Q(cancelled_at__isnull=False, finished_at__isnull=False),
}


def _ago(moment: datetime | None, clock: datetime) -> str:
    return f"{age((clock - moment).total_seconds())} ago" if moment is not None else "-"


def _row(batch: Any) -> list[str]:
    # Rounded down, so 100 only once every member ended (``JobBatch.percent`` rounds to 2 places).
    percent = 100 * batch.done // batch.total if batch.total else 100
    ids = [str(batch.pk), batch.name or "-", batch.state]
    counts = [f"{batch.done}/{batch.total}", f"{percent}%", str(batch.failed), str(batch.cancelled)]
    return [*ids, *counts, _ago(batch.created_at, batch.clock), _ago(batch.finished_at, batch.clock)]


class Command(QueueCommand):
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
            help="Only the batches in these states (default: every state).",
        )
        parser.add_argument("--name", help="Only the batches with this name (default: every name).")
        self.add_limit(parser, "batches")

    def handle(self, *args: Any, **opts: Any) -> None:
        selected = JobBatch.objects.order_by("-created_at", "-id")
        if opts["state"]:
            condition = Q()
            for state in dict.fromkeys(opts["state"]):
                condition |= STATES[state]
            selected = selected.filter(condition)
        if opts["name"] is not None:
            selected = selected.filter(name=opts["name"])
        headers = ["id", "name", "state", "done", "%", "failed", "cancelled", "created", "finished"]
        # Ages are read against the database's clock, the one that wrote the times.
        self.listing(
            selected.annotate(clock=DbNow()),
            opts["limit"],
            "batches",
            headers,
            _row,
            shrink=(1,),
            right=(0, 3, 4, 5, 6),
        )
