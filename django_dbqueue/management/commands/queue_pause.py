"""``manage.py queue_pause``: stop workers from claiming the jobs of queues, until queue_resume."""

from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand, CommandError

from django_dbqueue import pauses
from django_dbqueue.management import options


class Command(BaseCommand):
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
        try:
            changed = pauses.pause_many(opts["queues"], force=opts["force"])
        except ValueError as exc:
            raise CommandError(f"Nothing was paused: {exc}.") from None
        for queue, paused in changed.items():
            if paused:
                self.stdout.write(self.style.SUCCESS(f"Paused queue '{queue}'."))
            else:
                self.stdout.write(f"Queue '{queue}' was already paused.")
