"""``manage.py queue_cancel_batch``: cancel batches: delete their waiting members."""

from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand, CommandError

from django_dbqueue import batches
from django_dbqueue.management import options, output
from django_dbqueue.models import JobBatch


class Command(BaseCommand):
    help = (
        "Cancel batches: their waiting and delayed members are deleted and none can be added; running "
        "members finish (then the batch finishes, and its on_finish callbacks run, never its then). "
        "If any id is no batch, nothing is cancelled."
    )

    def add_arguments(self, parser: Any) -> None:
        options.add_batch_ids(parser)

    def handle(self, *args: Any, **opts: Any) -> None:
        ids = list(dict.fromkeys(opts["ids"]))
        found: dict[int, batches.BatchHandle] = {}
        missing: list[int] = []
        for pk in ids:
            try:
                found[pk] = batches.get_batch(pk)
            except JobBatch.DoesNotExist:
                missing.append(pk)
        if missing:
            raise CommandError(
                f"Nothing was cancelled: no batch has the {options.id_words(missing)} (unknown, or pruned)."
            )
        for pk, handle in found.items():
            if handle.is_cancelled or handle.finished:
                was = "was cancelled" if handle.is_cancelled else "has finished"
                self.stdout.write(self.style.WARNING(f"Batch {pk} {was} already: nothing to cancel."))
                continue
            deleted = handle.cancel()  # reads the batch again: pending is now the members still running
            running = f"; {output.plural(handle.pending, 'running member')} will finish" if handle.pending else ""
            self.stdout.write(
                self.style.SUCCESS(
                    f"Batch {pk} cancelled: {output.plural(deleted, 'waiting member')} deleted{running}."
                )
            )
