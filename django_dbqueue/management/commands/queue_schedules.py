"""``manage.py queue_schedules``: list the periodic schedules, or run one now."""

from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand, CommandError
from django.utils import timezone

from django_dbqueue import schedules
from django_dbqueue.management import output
from django_dbqueue.models import ScheduleState


def _when(moment: Any) -> str:
    return timezone.localtime(moment).strftime("%Y-%m-%d %H:%M:%S") if moment is not None else "-"


class Command(BaseCommand):
    help = (
        "List the periodic schedules (declared in code, and stale ones whose rows outlived their "
        "declaration), or with --run NAME enqueue one extra run of a schedule now."
    )

    def add_arguments(self, parser: Any) -> None:
        parser.add_argument(
            "--run",
            metavar="NAME",
            default=None,
            help="Enqueue one run of this schedule now; its ticks are unchanged (default: only list).",
        )

    def handle(self, *args: Any, **options: Any) -> None:
        if options["run"] is not None:
            try:
                handle = schedules.run_now(options["run"])
            except LookupError as exc:
                raise CommandError(str(exc)) from None
            self.stdout.write(self.style.SUCCESS(f"Enqueued {handle.name} as job {handle.id}."))
            return
        declared = schedules.all_schedules()
        rows = {row.name: row for row in ScheduleState.objects.all()}
        if not declared and not rows:
            self.stdout.write(self.style.SUCCESS("No schedules: declare them with periodic() next to your jobs."))
            return
        table = []
        for name in sorted({*declared, *rows}):
            row = rows.get(name)
            schedule = declared.get(name)
            if row is None:
                state = "new"  # no worker has started with this code yet
            elif schedule is None:
                state = "stale"
            else:
                state = "enabled" if row.enabled else "disabled"
            expression = schedule.expression if schedule is not None else row.expression  # type: ignore[union-attr]
            table.append(
                [
                    name,
                    expression,
                    state,
                    _when(row.next_tick if row is not None and state == "enabled" else None),
                    _when(row.last_run_at if row is not None else None),
                ]
            )
        headers = ["name", "expression", "state", "next run", "last run"]
        for line in output.table(headers, table, shrink=(0, 1)):
            self.stdout.write(line)
        stale = sum(1 for line in table if line[2] == "stale")
        if stale:
            self.stdout.write(
                f"Stale: {output.plural(stale, 'schedule')} no longer declared in this code, not ticked; "
                "the rows keep their history (delete them in the admin)."
            )
