from typing import Any

from django.core.management.base import CommandError

from django_dbqueue import batches, operations
from django_dbqueue.management.base import QueueCommand
from django_dbqueue.management.output import plural
from django_dbqueue.models import FailedJob


class Command(QueueCommand):
    help = (
        "Put the failed members of batches back on the queue as fresh jobs; each batch counts them "
        "pending again and reopens. If any id is no batch, or a cancelled one, nothing is retried."
    )

    def add_arguments(self, parser: Any) -> None:
        self.add_batch_ids(parser)

    def handle(self, *args: Any, **opts: Any) -> None:
        found = self.find_batches(opts["ids"], "retried")
        cancelled = [pk for pk, handle in found.items() if handle.is_cancelled]
        if cancelled:
            # A member of a cancelled batch does not start: retried, it would only be counted cancelled.
            which = (
                f"batch {cancelled[0]} was"
                if len(cancelled) == 1
                else f"batches {operations.format_ids(cancelled)} were"
            )
            raise CommandError(f"Nothing was retried: {which} cancelled, and members of a cancelled batch do not run.")
        for pk in found:
            count = len(batches.retry_failed(pk))
            # A member whose unique key another job holds now stays failed (the retry logs it).
            left = FailedJob.objects.filter(batch_id=pk).count()
            if not count and not left:
                self.warning(f"Batch {pk} has no failed members: nothing to retry.")
                continue
            text = f"Batch {pk}: {plural(count, 'failed member')} put back on the queue"
            if left:
                self.warning(f"{text}; {left} still failed (another job holds its unique key, or it failed again).")
            else:
                self.success(f"{text}.")
