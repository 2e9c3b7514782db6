from datetime import datetime
from typing import Any

from django_dbqueue.db import DbNow
from django_dbqueue.management.base import QueueCommand
from django_dbqueue.management.output import age
from django_dbqueue.models import BatchState, JobBatch


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
            choices=list(BatchState.values),
            nargs="+",
            action="extend",
            help="Only the batches in these states (default: every state).",
        )
        parser.add_argument("--name", help="Only the batches with this name (default: every name).")
        self.add_limit(parser, "batches")

    def handle(self, *args: Any, **opts: Any) -> None:
        selected = JobBatch.objects.order_by("-created_at", "-id")
        if opts["state"]:
            selected = selected.in_state(*opts["state"])
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
