from typing import Any

from django.core.management.base import CommandError

from django_dbqueue import operations
from django_dbqueue.management.base import IDS, QueueCommand


class Command(QueueCommand):
    help = (
        "Cancel jobs by id (3 5-9 12,14). A waiting or delayed job moves to the failed jobs as cancelled; "
        "a running one is asked to stop (--hard: stopped as at a timeout). Exits 1 if an id is no waiting "
        "or running job."
    )

    def add_arguments(self, parser: Any) -> None:
        self.add_ids(parser, f"Job ids: {IDS}.")
        parser.add_argument(
            "--hard",
            action="store_true",
            help="Stop running jobs at once, as at their timeout (default: they stop when they next check).",
        )
        parser.add_argument("--reason", default="", help="Why, stored with each cancelled job (default: none).")

    def handle(self, *args: Any, **opts: Any) -> None:
        outcomes = operations.cancel_jobs(operations.parse_ids(opts["ids"]), hard=opts["hard"], reason=opts["reason"])
        by_outcome: dict[str, list[int]] = {"cancelled": [], "requested": [], "missing": []}
        for pk, outcome in outcomes.items():
            by_outcome[outcome].append(pk)
        cancelled, requested, missing = by_outcome.values()
        if cancelled:
            self.success(f"Cancelled {len(cancelled)} job(s): {operations.format_ids(cancelled)}.")
        if requested:
            how = "stopped at once" if opts["hard"] else "asked to stop"
            self.success(f"{len(requested)} running job(s) {how}: {operations.format_ids(requested)}.")
        if missing:
            raise CommandError(
                f"No waiting or running job has the id {operations.format_ids(missing)}: unknown, or already "
                "finished (see queue_failed for failed and cancelled ones)."
            )
