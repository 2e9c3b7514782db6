import time
from typing import Any

from django.core.management.base import CommandError

from django_dbqueue import bulk, operations
from django_dbqueue.exceptions import FailedJobsNotFound
from django_dbqueue.management import options, output
from django_dbqueue.management.base import IDS, RETRY, QueueCommand

USAGE = (
    "Say which failed jobs to retry: ids (queue_retry 3 5-9 12,14), a selection (--queue QUEUE, --name NAME, "
    "--error-contains TEXT, --since WHEN, --until WHEN), or all."
)


class Command(QueueCommand):
    help = (
        "Put failed jobs back on the queue as fresh jobs: by id (3 5-9 12,14, all or none, in one "
        "transaction), or those a selection matches (--queue, --name, --error-contains, --since, --until), "
        "or all of them: the count first and a [y/N] question (--force for scripts), then a transaction per "
        f"{operations.RETRY_CHUNK:,} jobs, with a progress line on a terminal."
    )

    def add_arguments(self, parser: Any) -> None:
        self.add_ids(parser, f"Failed job ids: {IDS}; or the word 'all'.", nargs="*", type=options.ids_or_all)
        self.add_queue(parser, "Only the failed jobs of this queue (default: any queue).")
        self.add_selection(parser, "failed jobs", "that failed", errors=True)
        self.add_confirmation(parser, RETRY)

    def handle(self, *args: Any, **opts: Any) -> None:
        specs = self.selected_ids(opts, USAGE)
        if specs:
            with self.refusing(FailedJobsNotFound, "retried"):
                count = operations.retry_failed_ids(operations.parse_ids(specs))
        else:
            job_filter = self.job_filter(opts)
            counted = bulk.failed_to_retry(job_filter.failed())
            if counted.count:
                matching = f" matching {job_filter.describe()}" if not job_filter.empty else ""
                if not self.confirmed(opts, RETRY, f"{counted.count:,} failed job(s){matching}"):
                    return
            count = self._retry_selection(counted)
        if not count:
            self.warning("No failed job matched: 0 job(s) were put back on the queue.")
        else:
            self.success(f"{count:,} job(s) were put back on the queue.")

    def _retry_selection(self, counted: bulk.Counted) -> int:
        """Retry ``counted`` chunk by chunk, drawing a progress line on a terminal."""
        total = counted.count
        if not total:
            return 0
        line = output.ProgressLine(self.stdout, total, "Retrying")
        started = time.monotonic()
        try:
            count = bulk.retry_all(counted, chunk_size=operations.RETRY_CHUNK, progress=line.update)
        except KeyboardInterrupt:
            line.finish()
            # Counted again: a chunk may have committed after the last progress report.
            left = counted.rows().count()
            raise CommandError(
                f"Interrupted: {total - left:,} of {total:,} job(s) were put back on the queue; the other "
                f"{left:,} are still failed jobs (run the command again to retry them)."
            ) from None
        line.finish()
        if line.shown:
            self.stdout.write(f"Retried {count:,} of {total:,} in {time.monotonic() - started:.1f} s.")
        return count
