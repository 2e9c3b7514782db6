"""``manage.py queue_cancel``: cancel waiting, delayed or running jobs by id."""

from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand, CommandError

from django_dbqueue import operations
from django_dbqueue.management import options


class Command(BaseCommand):
    help = (
        "Cancel jobs by id (3 5-9 12,14). A waiting or delayed job moves to the failed jobs as cancelled; "
        "a running one is asked to stop (--hard: stopped as at a timeout). Exits 1 if an id is no waiting "
        "or running job."
    )

    def add_arguments(self, parser: Any) -> None:
        parser.add_argument(
            "ids", nargs="+", type=options.ids, metavar="ID", help="Job ids: 3, a range 5-9, a list 12,14."
        )
        parser.add_argument(
            "--hard",
            action="store_true",
            help="Stop running jobs at once, as at their timeout (default: they stop when they next check).",
        )
        parser.add_argument("--reason", default="", help="Why, stored with each cancelled job (default: none).")

    def handle(self, *args: Any, **opts: Any) -> None:
        outcomes = operations.cancel_jobs(operations.parse_ids(opts["ids"]), hard=opts["hard"], reason=opts["reason"])
        by_outcome: dict[str, list[int]] = {}
        for pk, outcome in outcomes.items():
            by_outcome.setdefault(outcome, []).append(pk)
        if by_outcome.get("cancelled"):
            ids = operations.format_ids(by_outcome["cancelled"])
            self.stdout.write(self.style.SUCCESS(f"Cancelled {len(by_outcome['cancelled'])} job(s): {ids}."))
        if by_outcome.get("requested"):
            ids = operations.format_ids(by_outcome["requested"])
            how = "stopped at once" if opts["hard"] else "asked to stop"
            self.stdout.write(self.style.SUCCESS(f"{len(by_outcome['requested'])} running job(s) {how}: {ids}."))
        if by_outcome.get("missing"):
            ids = operations.format_ids(by_outcome["missing"])
            raise CommandError(
                f"No waiting or running job has the id {ids}: unknown, or already finished "
                "(see queue_failed for failed and cancelled ones)."
            )
