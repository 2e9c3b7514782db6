import time
from typing import Any

from django.core.management.base import CommandError

from django_dbqueue import operations
from django_dbqueue.exceptions import FailedJobsNotFound
from django_dbqueue.management import options, output
from django_dbqueue.management.base import IDS, QueueCommand

USAGE = "Say which failed jobs to retry: ids (queue_retry 3 5-9 12,14), --queue QUEUE, --name NAME, or all."


class Command(QueueCommand):
    help = (
        "Put failed jobs back on the queue as fresh jobs: by id (3 5-9 12,14, all or none, in one "
        "transaction), or by --queue and/or --name, or all of them (a transaction per "
        f"{operations.RETRY_CHUNK:,} jobs, with a progress line on a terminal)."
    )

    def add_arguments(self, parser: Any) -> None:
        self.add_ids(parser, f"Failed job ids: {IDS}; or the word 'all'.", nargs="*", type=options.ids_or_all)
        self.add_queue(parser, "Retry the failed jobs of this queue (default: any queue, if --name is given).")
        parser.add_argument(
            "--name", help="Retry the failed jobs with this job name (default: any name, if --queue is given)."
        )

    def handle(self, *args: Any, **opts: Any) -> None:
        specs = [spec for spec in opts["ids"] if spec != options.ALL]
        filtered = opts["queue"] is not None or opts["name"] is not None
        selectors = [bool(specs), options.ALL in opts["ids"], filtered]
        if not any(selectors):
            raise CommandError(USAGE)
        if sum(selectors) > 1:
            raise CommandError("Pass ids, --queue/--name, or all: one kind of selection at a time.")
        if specs:
            with self.refusing(FailedJobsNotFound, "retried"):
                count = operations.retry_failed_ids(operations.parse_ids(specs))
        else:
            count = self._retry_selection(operations.failed_jobs(queue=opts["queue"], name=opts["name"]))
        if not count:
            self.warning("No failed job matched: 0 job(s) were put back on the queue.")
        else:
            self.success(f"{count:,} job(s) were put back on the queue.")

    def _retry_selection(self, selection: Any) -> int:
        """Retry ``selection`` chunk by chunk, drawing a progress line on a terminal."""
        total = selection.count()
        if not total:
            return 0
        line = output.ProgressLine(self.stdout, total, "Retrying")
        started = time.monotonic()
        try:
            count = operations.retry_failed(selection, chunk_size=operations.RETRY_CHUNK, progress=line.update)
        except KeyboardInterrupt:
            line.finish()
            # Counted again: a chunk may have committed after the last progress report.
            left = selection.count()
            raise CommandError(
                f"Interrupted: {total - left:,} of {total:,} job(s) were put back on the queue; the other "
                f"{left:,} are still failed jobs (run the command again to retry them)."
            ) from None
        line.finish()
        if line.shown:
            self.stdout.write(f"Retried {count:,} of {total:,} in {time.monotonic() - started:.1f} s.")
        return count
