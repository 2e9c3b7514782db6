from typing import Any

from django_dbqueue import conf, operations
from django_dbqueue.management.base import QueueCommand
from django_dbqueue.management.output import plural


class Command(QueueCommand):
    help = (
        "Delete the waiting and delayed jobs of a queue, after a confirmation. "
        "Reserved jobs (running now) are left alone."
    )

    def add_arguments(self, parser: Any) -> None:
        self.add_queue(parser, f"Queue to clear (default: {conf.get('QUEUE')}).")
        self.add_confirmation(parser)

    def handle(self, *args: Any, **opts: Any) -> None:
        queue = opts["queue"] or conf.get("QUEUE")
        counted = operations.clearable(queue)
        if not counted.count:
            self.success(f"Queue '{queue}' has no waiting or delayed jobs.")
            return
        self.delete_confirmed(
            opts,
            f"{plural(counted.count, 'job')} from queue '{queue}'",
            lambda: f"{plural(operations.clear_queue(counted), 'job')} deleted from queue '{queue}'.",
        )
