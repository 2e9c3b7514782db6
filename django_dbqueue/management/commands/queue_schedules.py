import argparse
import json
from datetime import datetime
from typing import Any

from django.core.exceptions import ValidationError
from django.core.management.base import CommandError
from django.utils import timezone

from django_dbqueue import schedules
from django_dbqueue.management import options
from django_dbqueue.management.base import QueueCommand
from django_dbqueue.management.output import plural
from django_dbqueue.models import MAX_JITTER, ScheduleState, StoredSchedule

# The options of ``create`` and ``edit``, as the StoredSchedule fields they set.
FIELDS = {
    "job": "job_name",
    "cron": "cron",
    "tz": "timezone",
    "queue": "queue",
    "jitter": "jitter",
    "tick_argument": "tick_argument",
}


def _when(moment: datetime | None) -> str:
    return timezone.localtime(moment).strftime("%Y-%m-%d %H:%M:%S") if moment is not None else "-"


def _row(name: str, schedule: schedules.Schedule | None, row: ScheduleState | None, source: str) -> list[str]:
    if row is None:  # no worker has ticked it yet
        return [name, schedule.expression, "new", "-", "-", source]  # type: ignore[union-attr]
    if schedule is None:
        return [name, row.expression, "stale", "-", _when(row.last_run_at), "-"]
    state = "enabled" if row.enabled else "disabled"
    next_run = _when(row.next_tick if row.enabled else None)
    return [name, schedule.expression, state, next_run, _when(row.last_run_at), source]


def _json(kind: type, example: str) -> Any:
    """An argparse type: JSON text that reads as ``kind`` (list or dict)."""

    def parse(text: str) -> Any:
        try:
            value = json.loads(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(f"{text!r} is not JSON ({exc}); such as {example}") from None
        if not isinstance(value, kind):
            raise argparse.ArgumentTypeError(f"{text!r} is not a JSON {kind.__name__}; such as {example}")
        return value

    return parse


class Command(QueueCommand):
    help = (
        "List the periodic schedules (declared in code, stored, and stale ones whose rows outlived their "
        "declaration), or with --run NAME enqueue one extra run of a schedule now; create, edit or delete "
        "a stored schedule (ticked by the running workers within seconds)."
    )

    def add_arguments(self, parser: Any) -> None:
        parser.add_argument(
            "--run",
            metavar="NAME",
            help="Enqueue one run of this schedule now; its ticks are unchanged (default: only list).",
        )
        actions = parser.add_subparsers(
            dest="action", metavar="{list,create,edit,delete}", help="What to do (default: list; each has its --help)."
        )
        actions.add_parser("list", help="The schedules: expression, state, next and last run, code or stored.")
        create = actions.add_parser("create", help="Store a new schedule.")
        edit = actions.add_parser("edit", help="Change a stored schedule: only the options given change.")
        for action, required in ((create, True), (edit, False)):
            action.add_argument("name", metavar="NAME", help="The stored schedule's name.")
            action.add_argument("--job", required=required, help="A registered job's name.")
            action.add_argument("--cron", required=required, help="5 fields, 6 with seconds first, or @daily ...")
            action.add_argument("--tz", help="A time zone such as Europe/Berlin (default: settings.TIME_ZONE).")
            action.add_argument(
                "--args",
                dest="positional",
                type=_json(list, "'[\"eu\", 3]'"),
                help="Positional arguments, a JSON list.",
            )
            action.add_argument(
                "--kwargs", type=_json(dict, "'{\"full\": true}'"), help="Keyword arguments, a JSON object."
            )
            action.add_argument("--tick-argument", help="Pass the tick (an aware datetime) as this keyword.")
            action.add_argument("--queue", type=options.queue_name, help="Its queue (default: the job's own).")
            action.add_argument(
                "--jitter",
                type=options.whole_number(0, MAX_JITTER),
                help=f"Tick up to so many seconds late, a fixed offset per schedule (0 to {MAX_JITTER}; default 0).",
            )
            state = action.add_mutually_exclusive_group()
            state.add_argument("--enable", dest="enabled", action="store_true", default=None, help="Tick it.")
            state.add_argument("--disable", dest="enabled", action="store_false", help="Keep it, but do not tick it.")
        delete = actions.add_parser("delete", help="Delete a stored schedule (its runs' history stays, as stale).")
        delete.add_argument("name", metavar="NAME", help="The stored schedule's name.")

    def handle(self, *args: Any, **opts: Any) -> None:
        if opts["run"] is not None:
            with self.refusing(LookupError):
                handle = schedules.run_now(opts["run"])
            self.success(f"Enqueued {handle.name} as job {handle.id}.")
            return
        action = opts.get("action") or "list"
        if action == "list":
            self._list()
        elif action == "delete":
            if not schedules.delete_stored([opts["name"]]):
                raise CommandError(f"Nothing was deleted: no schedule is stored under the name {opts['name']!r}.")
            self.success(f"Deleted the stored schedule {opts['name']}.")
        else:
            self._save(action, opts)

    def _save(self, action: str, opts: dict[str, Any]) -> None:
        name = opts["name"]
        if action == "create":
            if StoredSchedule.objects.filter(name=name).exists():
                raise CommandError(f"Nothing was created: a schedule is stored under the name {name!r}; edit it.")
            row = StoredSchedule(name=name)
        else:
            found = StoredSchedule.objects.filter(name=name).first()
            if found is None:
                raise CommandError(f"Nothing was changed: no schedule is stored under the name {name!r}.")
            row = found
        for option, field in FIELDS.items():
            if opts[option] is not None:
                setattr(row, field, opts[option])
        for option, field in (("positional", "args"), ("kwargs", "kwargs"), ("enabled", "enabled")):
            if opts[option] is not None:
                setattr(row, field, opts[option])
        try:
            schedules.save_stored(row)
        except ValidationError as exc:
            reasons = "; ".join(
                f"{field}: {message}" if field != "__all__" else message
                for field, messages in exc.message_dict.items()
                for message in messages
            )
            raise CommandError(f"Nothing was {'created' if action == 'create' else 'changed'}: {reasons}.") from None
        state = "enabled" if row.enabled else "disabled"
        self.success(f"{'Stored' if action == 'create' else 'Changed'} the schedule {name}: {row.cron} ({state}).")

    def _list(self) -> None:
        declared = schedules.all_schedules()
        stored = {row.name: schedules.from_stored(row) for row in StoredSchedule.objects.all()}
        rows = {row.name: row for row in ScheduleState.objects.all()}
        if not declared and not stored and not rows:
            self.success(
                "No schedules: declare them with periodic() next to your jobs, or store one (queue_schedules create)."
            )
            return
        known = {**stored, **declared}
        table = [
            _row(name, known.get(name), rows.get(name), "code" if name in declared else "stored")
            for name in sorted({*known, *rows})
        ]
        self.table(["name", "expression", "state", "next run", "last run", "from"], table, shrink=(0, 1))
        stale = sum(1 for line in table if line[2] == "stale")
        if stale:
            self.stdout.write(
                f"Stale: {plural(stale, 'schedule')} no longer declared in this code, nor stored, not ticked; "
                "the rows keep their history (delete them in the admin)."
            )
