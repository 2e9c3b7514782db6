"""``manage.py queue_resume``: let workers claim the jobs of paused queues again."""

from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand, CommandError

from django_dbqueue import pauses
from django_dbqueue.management import options


class Command(BaseCommand):
    help = "Resume paused queues (or --all of them): workers claim their jobs again."

    def add_arguments(self, parser: Any) -> None:
        parser.add_argument("queues", nargs="*", type=options.queue_name, metavar="QUEUE", help="Queues to resume.")
        parser.add_argument("--all", action="store_true", help="Resume every paused queue.")

    def handle(self, *args: Any, **opts: Any) -> None:
        if opts["all"] == bool(opts["queues"]):
            raise CommandError("Name the queues to resume, or pass --all (not both).")
        if opts["all"]:
            resumed = pauses.resume_all()
            for queue in resumed:
                self.stdout.write(self.style.SUCCESS(f"Resumed queue '{queue}'."))
            if not resumed:
                self.stdout.write("No queue was paused.")
            return
        for queue, was_paused in pauses.resume_many(opts["queues"]).items():
            if was_paused:
                self.stdout.write(self.style.SUCCESS(f"Resumed queue '{queue}'."))
            else:
                self.stdout.write(f"Queue '{queue}' was not paused.")
