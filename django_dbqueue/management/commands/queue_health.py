from typing import Any

from django.core.management.base import CommandError

from django_dbqueue import health
from django_dbqueue.management import options
from django_dbqueue.management.base import QueueCommand


class Command(QueueCommand):
    help = (
        "Check that the queue's database answers, that this host runs live workers, and (with "
        "--max-depth or --max-age) that no queue is falling behind, or (--max-transaction-age) held back by "
        "a transaction left open. Print one line and exit 0 when "
        "healthy, 1 when unhealthy, 2 when it cannot be told (the database cannot be read, or bad options)."
    )
    # A probe runs every few seconds: no system checks, only the database's answer.
    requires_system_checks: list[str] = []

    def add_arguments(self, parser: Any) -> None:
        parser.add_argument(
            "--workers",
            type=options.whole_number(0),
            default=1,
            metavar="N",
            help="Live workers needed on the host: queue_work processes, or children of --concurrency; "
            "0 skips the check (default: 1).",
        )
        hosts = parser.add_mutually_exclusive_group()
        hosts.add_argument(
            "--host",
            default=health.this_host(),
            help="Count the workers of this host name (default: this machine's, %(default)s).",
        )
        hosts.add_argument("--any-host", action="store_true", help="Count the workers of every host.")
        parser.add_argument(
            "--max-depth",
            type=options.whole_number(0),
            metavar="N",
            help="Unhealthy when a queue has more than N waiting jobs (default: no limit).",
        )
        parser.add_argument(
            "--max-age",
            type=options.seconds(0),
            metavar="SECONDS",
            help="Unhealthy when a queue's oldest waiting job has waited longer (default: no limit).",
        )
        parser.add_argument(
            "--max-transaction-age",
            type=options.seconds(0),
            metavar="SECONDS",
            help="Unhealthy when a transaction has been open longer on the queue's database server: "
            "meanwhile vacuum cannot remove finished jobs' rows and claims slow down (default: no limit).",
        )
        self.add_queue(
            parser, "Queues that --max-depth and --max-age judge (default: every queue with jobs).", many=True
        )

    def handle(self, *args: Any, **opts: Any) -> None:
        host = None if opts["any_host"] else opts["host"]
        limits = {
            "max_depth": opts["max_depth"],
            "max_age": opts["max_age"],
            "queues": opts["queue"],
            "max_transaction_age": opts["max_transaction_age"],
        }
        report = health.probe(health.Thresholds(workers=opts["workers"], host=host, **limits))
        if report.status != health.Status.HEALTHY:
            raise CommandError(report.reason, returncode=int(report.status))
        self.success(report.reason)
