from typing import Any

from django.core.management.base import CommandError

from django_dbqueue import bulk, operations
from django_dbqueue.management import options, output
from django_dbqueue.management.base import CANCEL, IDS, QueueCommand

USAGE = (
    "Say which jobs to cancel: ids (queue_cancel 3 5-9 12,14), a selection of waiting jobs (--queue QUEUE, "
    "--name NAME, --since WHEN, --until WHEN), or all."
)


class Command(QueueCommand):
    help = (
        "Cancel jobs by id (3 5-9 12,14): a waiting or delayed job moves to the failed jobs as cancelled; "
        "a running one is asked to stop (--hard: stopped as at a timeout); exits 1 if an id is no waiting "
        "or running job. Or cancel the jobs nobody holds that a selection matches (--queue, --name, --since, "
        "--until), or all of them: the count first and a [y/N] question (--force for scripts), then a "
        f"transaction per {bulk.CHUNK:,} jobs; running jobs are left to run."
    )

    def add_arguments(self, parser: Any) -> None:
        self.add_ids(parser, f"Job ids: {IDS}; or the word 'all'.", nargs="*", type=options.ids_or_all)
        self.add_queue(parser, "Only the waiting jobs of this queue (default: any queue).")
        self.add_selection(parser, "waiting jobs", "enqueued")
        parser.add_argument(
            "--hard",
            action="store_true",
            help="Stop running jobs at once, as at their timeout (default: they stop when they next check); "
            "with ids only.",
        )
        parser.add_argument("--reason", default="", help="Why, stored with each cancelled job (default: none).")
        self.add_confirmation(parser, CANCEL)

    def handle(self, *args: Any, **opts: Any) -> None:
        specs = self.selected_ids(opts, USAGE)
        if specs:
            self._cancel_ids(operations.parse_ids(specs), opts)
            return
        if opts["hard"]:
            raise CommandError(
                "Nothing was cancelled: --hard stops running jobs, and a selection cancels only the jobs nobody "
                "holds (cancel running ones by id)."
            )
        job_filter = self.job_filter(opts)
        self._cancel_selection(job_filter, not job_filter.empty, opts)

    def _cancel_ids(self, ids: list[int], opts: dict[str, Any]) -> None:
        outcomes = operations.cancel_jobs(ids, hard=opts["hard"], reason=opts["reason"])
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

    def _cancel_selection(self, job_filter: bulk.JobFilter, filtered: bool, opts: dict[str, Any]) -> None:
        """Count the waiting jobs the filter selects, ask, then cancel them chunk by chunk."""
        selection = job_filter.jobs()
        counted = bulk.waiting_to_cancel(selection)
        running = bulk.running(selection)
        left = f"; {output.plural(running, 'running job')} matched and {'was' if running == 1 else 'were'} left to run"
        if not counted.count:
            self.warning(f"No waiting job matched: 0 job(s) were cancelled{left if running else ''}.")
            return
        matching = f" matching {job_filter.describe()}" if filtered else ""
        if not self.confirmed(opts, CANCEL, f"{counted.count:,} waiting job(s){matching}"):
            return
        line = output.ProgressLine(self.stdout, counted.count, "Cancelling")
        try:
            count = bulk.cancel_all(counted, reason=opts["reason"], chunk_size=bulk.CHUNK, progress=line.update)
        except KeyboardInterrupt:
            line.finish()
            waiting = counted.rows().count()
            raise CommandError(
                f"Interrupted: {counted.count - waiting:,} of {counted.count:,} job(s) were cancelled; the other "
                f"{waiting:,} are still waiting (run the command again to cancel them)."
            ) from None
        line.finish()
        self.success(f"{count:,} job(s) were cancelled{left if running else ''}.")
