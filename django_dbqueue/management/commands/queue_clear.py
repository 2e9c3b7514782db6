"""``manage.py queue_clear``: delete the waiting and delayed jobs of a queue."""

from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand

from django_dbqueue import conf, operations
from django_dbqueue.management import options, output


class Command(BaseCommand):
    help = (
        "Delete the waiting and delayed jobs of a queue, after a confirmation. "
        "Reserved jobs (running now) are left alone."
    )
    # Tests pass a stand-in for the terminal.
    stealth_options = ("stdin",)

    def add_arguments(self, parser: Any) -> None:
        parser.add_argument(
            "--queue", type=options.queue_name, default=None, help=f"Queue to clear (default: {conf.get('QUEUE')})."
        )
        output.add_confirmation_arguments(parser)

    def handle(self, *args: Any, **opts: Any) -> None:
        queue = opts["queue"] or conf.get("QUEUE")
        counted = operations.clearable(queue)
        if not counted.count:
            self.stdout.write(self.style.SUCCESS(f"Queue '{queue}' has no waiting or delayed jobs."))
            return
        jobs = output.plural(counted.count, "job")
        if not output.confirm(
            self.stdout,
            opts,
            doing=f"Deleting {jobs} from queue '{queue}'",
            question=f"Delete {jobs} from queue '{queue}'?",
        ):
            self.stdout.write("Nothing was deleted.")
            return
        deleted = operations.clear_queue(counted)
        self.stdout.write(self.style.SUCCESS(f"{output.plural(deleted, 'job')} deleted from queue '{queue}'."))
