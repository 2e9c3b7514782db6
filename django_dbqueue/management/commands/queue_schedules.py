from datetime import datetime
from typing import Any

from django.utils import timezone

from django_dbqueue import schedules
from django_dbqueue.management.base import QueueCommand
from django_dbqueue.management.output import plural
from django_dbqueue.models import ScheduleState


def _when(moment: datetime | None) -> str:
    return timezone.localtime(moment).strftime("%Y-%m-%d %H:%M:%S") if moment is not None else "-"


def _row(name: str, schedule: schedules.Schedule | None, row: ScheduleState | None) -> list[str]:
    if row is None:  # no worker has started with this code yet
        return [name, schedule.expression, "new", "-", "-"]  # type: ignore[union-attr]
    if schedule is None:
        return [name, row.expression, "stale", "-", _when(row.last_run_at)]
    state = "enabled" if row.enabled else "disabled"
    return [name, schedule.expression, state, _when(row.next_tick if row.enabled else None), _when(row.last_run_at)]


class Command(QueueCommand):
    help = (
        "List the periodic schedules (declared in code, and stale ones whose rows outlived their "
        "declaration), or with --run NAME enqueue one extra run of a schedule now."
    )

    def add_arguments(self, parser: Any) -> None:
        parser.add_argument(
            "--run",
            metavar="NAME",
            help="Enqueue one run of this schedule now; its ticks are unchanged (default: only list).",
        )

    def handle(self, *args: Any, **opts: Any) -> None:
        if opts["run"] is not None:
            with self.refusing(LookupError):
                handle = schedules.run_now(opts["run"])
            self.success(f"Enqueued {handle.name} as job {handle.id}.")
            return
        declared = schedules.all_schedules()
        rows = {row.name: row for row in ScheduleState.objects.all()}
        if not declared and not rows:
            self.success("No schedules: declare them with periodic() next to your jobs.")
            return
        table = [_row(name, declared.get(name), rows.get(name)) for name in sorted({*declared, *rows})]
        self.table(["name", "expression", "state", "next run", "last run"], table, shrink=(0, 1))
        stale = sum(1 for line in table if line[2] == "stale")
        if stale:
            self.stdout.write(
                f"Stale: {plural(stale, 'schedule')} no longer declared in this code, not ticked; "
                "the rows keep their history (delete them in the admin)."
            )
