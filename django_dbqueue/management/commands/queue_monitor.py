"""``manage.py queue_monitor``: the size of each queue; fails when one is over --max."""

from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand, CommandError

from django_dbqueue import operations, workers
from django_dbqueue.management import options, output


class Command(BaseCommand):
    help = (
        "Show each queue's waiting, delayed, reserved and failed jobs and how long the oldest "
        "waiting job has waited, and which queues are paused; warn about queues with waiting jobs "
        "that no live worker serves. "
        "With --max, exit non-zero when a queue holds more jobs."
    )

    def add_arguments(self, parser: Any) -> None:
        parser.add_argument(
            "--queue",
            type=options.queue_name,
            nargs="+",
            action="extend",
            default=None,
            help="Queues to show, in this order, even if empty (default: every queue that has jobs or failed jobs).",
        )
        parser.add_argument(
            "--max",
            type=options.whole_number(0),
            default=None,
            metavar="N",
            help="Fail when a queue has more than N waiting, delayed and reserved jobs (default: no limit).",
        )

    def handle(self, *args: Any, **opts: Any) -> None:
        stats = operations.queue_overview_of(opts["queue"]) if opts["queue"] else operations.queue_overview()
        if not stats:
            self.stdout.write(self.style.SUCCESS("No jobs."))
            return
        headers = ["queue", "waiting", "delayed", "blocked", "reserved", "failed", "oldest waiting"]
        rows = [
            [
                item.queue,
                str(item.waiting),
                str(item.delayed),
                str(item.blocked),
                str(item.reserved),
                str(item.failed),
                output.age(item.oldest_waiting_seconds),
            ]
            for item in stats
        ]
        for line in output.table(headers, rows, shrink=(0,), right=(1, 2, 3, 4, 5)):
            self.stdout.write(line)
        for item in stats:
            if item.paused:
                self.stdout.write(
                    f"Queue '{item.queue}' is paused: no worker claims its jobs until queue_resume {item.queue}."
                )
        for item in operations.unserved(stats):
            self.stderr.write(
                self.style.WARNING(
                    f"Queue '{item.queue}' has {output.plural(item.waiting, 'waiting job')} and no live worker "
                    f"serving it (none seen in the last {workers.dead_after():g} s): start one with "
                    f"queue_work --queue {item.queue}."
                )
            )
        if opts["max"] is None:
            return
        over = operations.queues_over(stats, opts["max"])
        if over:
            names = ", ".join(f"{item.queue} ({item.size})" for item in over)
            raise CommandError(f"Over {output.plural(opts['max'], 'job')} (waiting, delayed and reserved): {names}")
        self.stdout.write(self.style.SUCCESS(f"Every queue holds at most {output.plural(opts['max'], 'job')}."))
