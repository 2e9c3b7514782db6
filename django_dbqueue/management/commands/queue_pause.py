from typing import Any

from django_dbqueue import pauses
from django_dbqueue.management import options
from django_dbqueue.management.base import QueueCommand


class Command(QueueCommand):
    help = (
        "Pause queues: no worker, on any host, claims their jobs until queue_resume. Jobs can still be "
        "enqueued, and running jobs finish. Exits 1, pausing none, if a queue is unknown (nothing uses it)."
    )

    def add_arguments(self, parser: Any) -> None:
        parser.add_argument("queues", nargs="+", type=options.queue_name, metavar="QUEUE", help="Queues to pause.")
        parser.add_argument(
            "--force",
            action="store_true",
            help="Pause queues that nothing uses yet, such as before a deploy that adds them "
            "(default: an unknown queue is an error).",
        )

    def handle(self, *args: Any, **opts: Any) -> None:
        with self.refusing(ValueError, "paused"):
            changed = pauses.pause_many(opts["queues"], force=opts["force"])
        for queue, paused in changed.items():
            if paused:
                self.success(f"Paused queue '{queue}'.")
            else:
                self.stdout.write(f"Queue '{queue}' was already paused.")
