from typing import Any

from django_dbqueue.management.base import QueueCommand
from django_dbqueue.management.output import plural


class Command(QueueCommand):
    help = (
        "Cancel batches: their waiting and delayed members are deleted and none can be added; running "
        "members finish (then the batch finishes, and its on_finish callbacks run, never its then). "
        "If any id is no batch, nothing is cancelled."
    )

    def add_arguments(self, parser: Any) -> None:
        self.add_batch_ids(parser)

    def handle(self, *args: Any, **opts: Any) -> None:
        for pk, handle in self.find_batches(opts["ids"], "cancelled").items():
            if handle.is_cancelled or handle.finished:
                was = "was cancelled" if handle.is_cancelled else "has finished"
                self.warning(f"Batch {pk} {was} already: nothing to cancel.")
                continue
            deleted = handle.cancel()  # reads the batch again: pending is now the members still running
            running = f"; {plural(handle.pending, 'running member')} will finish" if handle.pending else ""
            self.success(f"Batch {pk} cancelled: {plural(deleted, 'waiting member')} deleted{running}.")
