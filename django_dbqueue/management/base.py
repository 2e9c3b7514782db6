"""The base of the queue_* commands: the arguments they share (ids, ``--queue``, ``--hours``,
``--limit``, confirmation) and their answers (lines, tables, refusals)."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from django.core.management.base import BaseCommand, CommandError
from django.db.models import QuerySet

from django_dbqueue import batches
from django_dbqueue.management import options, output
from django_dbqueue.models import JobBatch
from django_dbqueue.operations import which_ids

IDS = "3, a range 5-9, a list 12,14"
DEFAULT_LIMIT = 50


class QueueCommand(BaseCommand):
    # Tests pass a stand-in for the terminal (read by ``delete_confirmed``).
    stealth_options = ("stdin",)

    def add_ids(self, parser: Any, help: str, *, nargs: str = "+", type: Any = options.ids) -> None:
        parser.add_argument("ids", nargs=nargs, type=type, metavar="ID", help=help)

    def add_batch_ids(self, parser: Any) -> None:
        self.add_ids(parser, "Batch ids (see queue_batches).", type=options.whole_number(1, options.MAX_ID))

    def add_queue(self, parser: Any, help: str, *, many: bool = False) -> None:
        many_options = {"nargs": "+", "action": "extend"} if many else {}
        parser.add_argument("--queue", type=options.queue_name, help=help, **many_options)

    def add_hours(self, parser: Any, help: str, *, required: bool = True) -> None:
        parser.add_argument("--hours", type=options.hours, metavar="N", required=required, help=help)

    def add_limit(self, parser: Any, what: str) -> None:
        parser.add_argument(
            "--limit",
            type=options.whole_number(1),
            default=DEFAULT_LIMIT,
            metavar="N",
            help=f"Show at most N {what} (default: {DEFAULT_LIMIT}).",
        )

    def add_confirmation(self, parser: Any) -> None:
        """Add ``--force`` and ``--no-input``, the options ``delete_confirmed`` reads."""
        parser.add_argument("--force", action="store_true", help="Delete without asking.")
        parser.add_argument(
            "--noinput",
            "--no-input",
            action="store_false",
            dest="interactive",
            help="Never ask: without --force, stop with an error instead.",
        )

    def success(self, text: str) -> None:
        self.stdout.write(self.style.SUCCESS(text))

    def warning(self, text: str) -> None:
        self.stdout.write(self.style.WARNING(text))

    def table(self, headers: Sequence[str], rows: Sequence[Sequence[str]], **layout: Any) -> None:
        for line in output.table(headers, rows, **layout):
            self.stdout.write(line)

    def listing(
        self,
        selected: QuerySet[Any],
        limit: int,
        what: str,
        headers: Sequence[str],
        row: Callable[[Any], list[str]],
        **layout: Any,
    ) -> None:
        """A table of the first ``limit`` of ``selected``, and how many more ``--limit`` would show."""
        shown = list(selected[:limit])
        if not shown:
            self.success(f"No {what}.")
            return
        self.table(headers, [row(item) for item in shown], **layout)
        total = selected.count() if len(shown) == limit else len(shown)
        if total > len(shown):
            self.stdout.write(f"{len(shown)} of {total} {what} shown; --limit shows more.")

    def delete_confirmed(self, opts: dict[str, Any], what: str, delete: Callable[[], str]) -> None:
        """Ask ``Delete <what>? [y/N]`` unless ``--force``; on yes, ``delete`` deletes and says what it did.

        Refuse, naming ``--force``, when nobody can answer (``--no-input``, or stdin is not a terminal).
        """
        if not opts["force"]:
            stdin: Any = opts.get("stdin", sys.stdin)
            if not opts["interactive"] or not output.is_terminal(stdin):
                why = "--no-input was given" if not opts["interactive"] else "stdin is not a terminal"
                raise CommandError(
                    f"Deleting {what} needs a confirmation, and {why}: pass --force to delete without asking."
                )
            self.stdout.write(f"Delete {what}? [y/N] ", ending="")
            self.stdout.flush()
            try:
                answer = stdin.readline()
            except KeyboardInterrupt:
                answer = ""
            if not answer.endswith("\n"):
                self.stdout.write("")
            if str(answer).strip().lower() not in {"y", "yes"}:
                self.stdout.write("Nothing was deleted.")
                return
        self.success(delete())

    @contextlib.contextmanager
    def refusing(self, errors: type[Exception] | tuple[type[Exception], ...], nothing: str = "") -> Iterator[None]:
        """Turn ``errors`` into a CommandError (exit 1): ``Nothing was <nothing>: <error>.``, or the error alone."""
        try:
            yield
        except errors as exc:
            raise CommandError(f"Nothing was {nothing}: {exc}." if nothing else str(exc)) from None

    def find_batches(self, ids: Sequence[int], nothing: str) -> dict[int, batches.BatchHandle]:
        """The batches of ``ids``, in order, once each; if one is missing, refuse (``Nothing was <nothing>``)."""
        found: dict[int, batches.BatchHandle] = {}
        missing: list[int] = []
        for pk in dict.fromkeys(ids):
            try:
                found[pk] = batches.get_batch(pk)
            except JobBatch.DoesNotExist:
                missing.append(pk)
        if missing:
            raise CommandError(f"Nothing was {nothing}: no batch has the {which_ids(missing)} (unknown, or pruned).")
        return found


class PruneCommand(QueueCommand):
    """A ``queue_prune_*`` command: ``--hours N`` (required), then ``prune(hours)`` and one line."""

    hours_help: str
    # Formatted with ``count`` and ``hours``.
    done: str
    # Deletes what is older than ``hours`` and says how many: a staticmethod of the library.
    prune: Callable[[float], int]

    def add_arguments(self, parser: Any) -> None:
        self.add_hours(parser, self.hours_help)

    def handle(self, *args: Any, **opts: Any) -> None:
        self.success(self.done.format(count=self.prune(opts["hours"]), hours=opts["hours"]))
