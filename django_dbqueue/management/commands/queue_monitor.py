from typing import Any

from django.core.management.base import CommandError

from django_dbqueue import operations, workers
from django_dbqueue.management import options
from django_dbqueue.management.base import QueueCommand
from django_dbqueue.management.output import age, plural


class Command(QueueCommand):
    help = (
        "Show each queue's waiting, delayed, reserved and failed jobs and how long the oldest "
        "waiting job has waited, and which queues are paused; warn about queues with waiting jobs "
        "that no live worker serves. "
        "With --max, exit non-zero when a queue holds more jobs."
    )

    def add_arguments(self, parser: Any) -> None:
        self.add_queue(
            parser,
            "Queues to show, in this order, even if empty (default: every queue that has jobs or failed jobs).",
            many=True,
        )
        parser.add_argument(
            "--max",
            type=options.whole_number(0),
            metavar="N",
            help="Fail when a queue has more than N waiting, delayed and reserved jobs (default: no limit).",
        )

    def handle(self, *args: Any, **opts: Any) -> None:
        stats = operations.queue_overview_of(opts["queue"]) if opts["queue"] else operations.queue_overview()
        if not stats:
            self.success("No jobs.")
            return
        counts = ("waiting", "delayed", "blocked", "reserved", "failed")
        rows = [
            [item.queue, *(str(getattr(item, count)) for count in counts), age(item.oldest_waiting_seconds)]
            for item in stats
        ]
        self.table(["queue", *counts, "oldest waiting"], rows, shrink=(0,), right=(1, 2, 3, 4, 5))
        for item in stats:
            if item.paused:
                self.stdout.write(
                    f"Queue '{item.queue}' is paused: no worker claims its jobs until queue_resume {item.queue}."
                )
        for item in operations.unserved(stats):
            self.stderr.write(
                self.style.WARNING(
                    f"Queue '{item.queue}' has {plural(item.waiting, 'waiting job')} and no live worker "
                    f"serving it (none seen in the last {workers.dead_after():g} s): start one with "
                    f"queue_work --queue {item.queue}."
                )
            )
        if opts["max"] is None:
            return
        over = operations.queues_over(stats, opts["max"])
        if over:
            names = ", ".join(f"{item.queue} ({item.size})" for item in over)
            raise CommandError(f"Over {plural(opts['max'], 'job')} (waiting, delayed and reserved): {names}")
        self.success(f"Every queue holds at most {plural(opts['max'], 'job')}.")
