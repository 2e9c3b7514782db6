"""``manage.py queue_retry_batch``: put the failed members of batches back on the queue."""

from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand, CommandError

from django_dbqueue import batches, operations
from django_dbqueue.management import options, output
from django_dbqueue.models import FailedJob, JobBatch


class Command(BaseCommand):
    help = (
        "Put the failed members of batches back on the queue as fresh jobs; each batch counts them "
        "pending again and reopens. If any id is no batch, or a cancelled one, nothing is retried."
    )

    def add_arguments(self, parser: Any) -> None:
        options.add_batch_ids(parser)

    def handle(self, *args: Any, **opts: Any) -> None:
        ids = list(dict.fromkeys(opts["ids"]))
        missing: list[int] = []
        cancelled: list[int] = []
        for pk in ids:
            try:
                handle = batches.get_batch(pk)
            except JobBatch.DoesNotExist:
                missing.append(pk)
                continue
            if handle.is_cancelled:
                cancelled.append(pk)
        if missing:
            raise CommandError(
                f"Nothing was retried: no batch has the {options.id_words(missing)} (unknown, or pruned)."
            )
        if cancelled:
            # A member of a cancelled batch does not start: retried, it would only be counted cancelled.
            which = (
                f"batch {cancelled[0]} was"
                if len(cancelled) == 1
                else f"batches {operations.format_ids(cancelled)} were"
            )
            raise CommandError(f"Nothing was retried: {which} cancelled, and members of a cancelled batch do not run.")
        for pk in ids:
            count = len(batches.retry_failed(pk))
            # A member whose unique key another job holds now stays failed (the retry logs it).
            left = FailedJob.objects.filter(batch_id=pk).count()
            if not count and not left:
                self.stdout.write(self.style.WARNING(f"Batch {pk} has no failed members: nothing to retry."))
                continue
            text = f"Batch {pk}: {output.plural(count, 'failed member')} put back on the queue"
            if left:
                text += f"; {left} still failed (another job holds its unique key, or it failed again)"
                self.stdout.write(self.style.WARNING(f"{text}."))
            else:
                self.stdout.write(self.style.SUCCESS(f"{text}."))
