"""The base of the queue_* commands: the arguments they share (ids, ``--queue``, ``--hours``,
``--limit``, a selection by name, error text and time, confirmation) and their answers (lines, tables, refusals)."""

from __future__ import annotations

import contextlib
import dataclasses
import sys
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from django.core.management.base import BaseCommand, CommandError
from django.db.models import QuerySet

from django_dbqueue import batches, bulk
from django_dbqueue.management import options, output
from django_dbqueue.models import JobBatch
from django_dbqueue.operations import which_ids

IDS = "3, a range 5-9, a list 12,14"
DEFAULT_LIMIT = 50


@dataclasses.dataclass(frozen=True)
class Verb:
    """What a confirmed command does, in the forms its question and refusals use."""

    imperative: str  # Delete
    gerund: str  # Deleting
    past: str  # deleted


DELETE = Verb("Delete", "Deleting", "deleted")
RETRY = Verb("Retry", "Retrying", "retried")
CANCEL = Verb("Cancel", "Cancelling", "cancelled")


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

    def add_confirmation(self, parser: Any, verb: Verb = DELETE) -> None:
        """Add ``--force`` and ``--no-input``, the options ``confirmed`` reads."""
        parser.add_argument("--force", action="store_true", help=f"{verb.imperative} without asking.")
        parser.add_argument(
            "--noinput",
            "--no-input",
            action="store_false",
            dest="interactive",
            help="Never ask: without --force, stop with an error instead.",
        )

    def add_selection(self, parser: Any, what: str, at: str, *, errors: bool = False) -> None:
        """Add ``--name``, ``--since`` and ``--until`` (and ``--error-contains``) for a selection of ``what``;
        ``at``: the time the range bounds (``failed``, ``enqueued``). ``--queue`` is the command's own."""
        parser.add_argument("--name", help=f"Only the {what} with this job name (default: any name).")
        if errors:
            parser.add_argument(
                "--error-contains",
                type=options.text("--error-contains"),
                metavar="TEXT",
                help=f"Only the {what} whose error holds TEXT, whatever its case (default: any error).",
            )
        parser.add_argument(
            "--since",
            type=options.moment,
            metavar="WHEN",
            help=f"Only the {what} {at} at or after WHEN: 2026-12-01 or 2026-12-01T14:30, "
            "in TIME_ZONE unless an offset is given (default: no bound).",
        )
        until = f"Only the {what} {at} before WHEN (default: no bound)."
        parser.add_argument("--until", type=options.moment, metavar="WHEN", help=until)

    def selected_ids(self, opts: dict[str, Any], usage: str) -> list[str] | None:
        """The id specs given, or None for a selection (``all``, or the options of ``add_selection``);
        none, or more than one kind at once, is refused with ``usage``."""
        specs = [spec for spec in opts["ids"] if spec != options.ALL]
        filtered = any(opts.get(option) is not None for option in ("queue", "name", "error_contains", "since", "until"))
        kinds = [bool(specs), options.ALL in opts["ids"], filtered]
        if not any(kinds):
            raise CommandError(usage)
        if sum(kinds) > 1:
            raise CommandError("Pass ids, a selection (--queue, --name, ...), or all: one kind of selection at a time.")
        return specs or None

    def job_filter(self, opts: dict[str, Any]) -> bulk.JobFilter:
        """The filter the selection options give; a bad one is refused with the reason."""
        try:
            return bulk.JobFilter(
                name=opts.get("name"),
                queue=opts.get("queue"),
                error_contains=opts.get("error_contains"),
                since=opts.get("since"),
                until=opts.get("until"),
            )
        except ValueError as exc:
            raise CommandError(f"Nothing was changed: {exc}.") from None

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
        """Ask ``Delete <what>? [y/N]`` unless ``--force``; on yes, ``delete`` deletes and says what it did."""
        if self.confirmed(opts, DELETE, what):
            self.success(delete())

    def confirmed(self, opts: dict[str, Any], verb: Verb, what: str) -> bool:
        """Ask ``<Verb> <what>? [y/N]`` unless ``--force``; whether the answer is yes (on no, say so).

        Refuse, naming ``--force``, when nobody can answer (``--no-input``, or stdin is not a terminal).
        """
        if opts["force"]:
            return True
        stdin: Any = opts.get("stdin", sys.stdin)
        if not opts["interactive"] or not output.is_terminal(stdin):
            why = "--no-input was given" if not opts["interactive"] else "stdin is not a terminal"
            raise CommandError(
                f"{verb.gerund} {what} needs a confirmation, and {why}: "
                f"pass --force to {verb.imperative.lower()} without asking."
            )
        self.stdout.write(f"{verb.imperative} {what}? [y/N] ", ending="")
        self.stdout.flush()
        try:
            answer = stdin.readline()
        except KeyboardInterrupt:
            answer = ""
        if not answer.endswith("\n"):
            self.stdout.write("")
        if str(answer).strip().lower() not in {"y", "yes"}:
            self.stdout.write(f"Nothing was {verb.past}.")
            return False
        return True

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
