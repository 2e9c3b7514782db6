from typing import Any

from django.core.management.base import CommandError

from django_dbqueue import pauses
from django_dbqueue.management import options
from django_dbqueue.management.base import QueueCommand


class Command(QueueCommand):
    help = "Resume paused queues (or --all of them): workers claim their jobs again."

    def add_arguments(self, parser: Any) -> None:
        parser.add_argument("queues", nargs="*", type=options.queue_name, metavar="QUEUE", help="Queues to resume.")
        parser.add_argument("--all", action="store_true", help="Resume every paused queue.")

    def handle(self, *args: Any, **opts: Any) -> None:
        if opts["all"] == bool(opts["queues"]):
            raise CommandError("Name the queues to resume, or pass --all (not both).")
        if opts["all"]:
            resumed = dict.fromkeys(pauses.resume_all(), True)
            if not resumed:
                self.stdout.write("No queue was paused.")
        else:
            resumed = pauses.resume_many(opts["queues"])
        for queue, was_paused in resumed.items():
            if was_paused:
                self.success(f"Resumed queue '{queue}'.")
            else:
                self.stdout.write(f"Queue '{queue}' was not paused.")
