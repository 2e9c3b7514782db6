"""``manage.py queue_clear``: delete the waiting and delayed jobs of a queue."""

from __future__ import annotations

import sys
from typing import Any

from django.core.management.base import BaseCommand, CommandError

from django_dbqueue import conf, operations
from django_dbqueue.management import options, output


class Command(BaseCommand):
    help = (
        "Delete the waiting and delayed jobs of a queue, after a confirmation. "
        "Reserved jobs (running now) are left alone."
    )
    # Tests pass a stand-in for the terminal.
    stealth_options = ("stdin",)

    def add_arguments(self, parser: Any) -> None:
        parser.add_argument(
            "--queue", type=options.queue_name, default=None, help=f"Queue to clear (default: {conf.get('QUEUE')})."
        )
        parser.add_argument("--force", action="store_true", help="Delete without asking.")
        parser.add_argument(
            "--noinput",
            "--no-input",
            action="store_false",
            dest="interactive",
            help="Never ask: without --force, stop with an error instead.",
        )

    def handle(self, *args: Any, **opts: Any) -> None:
        queue = opts["queue"] or conf.get("QUEUE")
        counted = operations.clearable(queue)
        if not counted.count:
            self.stdout.write(self.style.SUCCESS(f"Queue '{queue}' has no waiting or delayed jobs."))
            return
        jobs = output.plural(counted.count, "job")
        if not opts["force"]:
            stdin = opts.get("stdin", sys.stdin)
            if not opts["interactive"] or not _is_terminal(stdin):
                why = "--no-input was given" if not opts["interactive"] else "stdin is not a terminal"
                raise CommandError(
                    f"Deleting {jobs} from queue '{queue}' needs a confirmation, and {why}: "
                    f"pass --force to delete without asking."
                )
            if not self._confirm(f"Delete {jobs} from queue '{queue}'? [y/N] ", stdin):
                self.stdout.write("Nothing was deleted.")
                return
        deleted = operations.clear_queue(counted)
        self.stdout.write(self.style.SUCCESS(f"{output.plural(deleted, 'job')} deleted from queue '{queue}'."))

    def _confirm(self, question: str, stdin: Any) -> bool:
        self.stdout.write(question, ending="")
        self.stdout.flush()
        try:
            answer = stdin.readline()
        except KeyboardInterrupt:
            answer = ""
        if not answer.endswith("\n"):
            self.stdout.write("")
        return str(answer).strip().lower() in {"y", "yes"}


def _is_terminal(stdin: Any) -> bool:
    isatty = getattr(stdin, "isatty", None)
    return bool(isatty and isatty())
