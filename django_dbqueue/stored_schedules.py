"""What a stored schedule (``StoredSchedule``, made at runtime) may hold, checked before it is saved:
a registered job that takes its arguments, a cron expression cronsim reads, a time zone zoneinfo
knows, a queue name; and the version the tickers watch to see a schedule created, changed or deleted.

``schedules`` turns a row into a ``Schedule``, saves rows (``save_stored``) and ticks them.
"""

from __future__ import annotations

import difflib
from collections.abc import Collection

from django.core.exceptions import NON_FIELD_ERRORS, ValidationError
from django.db.models import Count, Sum

from . import conf, registry, validation
from .cron import Timing
from .models import StoredSchedule


def errors(row: StoredSchedule, declared: Collection[str] = ()) -> dict[str, list[str]]:
    """Why ``row`` cannot be ticked, by field (the arguments against the job: ``NON_FIELD_ERRORS``),
    without the fields' own checks (``full_clean``); empty if it can. ``declared``: the names of the
    schedules declared in code, which a stored one may not take."""
    found: dict[str, list[str]] = {}

    def refuse(field: str, message: str) -> None:
        found.setdefault(field, []).append(message)

    if row.name in declared:
        refuse("name", f"a schedule named {row.name!r} is declared in code (periodic()): give this one another name")
    cron = (row.cron or "").strip()
    timing = Timing(cron=cron, timezone=row.timezone or None)
    if not cron:
        refuse("cron", "a cron expression is needed: 5 fields (minute hour day month weekday) or @daily, @hourly ...")
    else:
        error = timing.expression_error()
        if error is not None:
            refuse("cron", f"bad cron expression: {error}")
    error = timing.timezone_error()
    if error is not None:
        refuse("timezone", error)
    if row.queue:
        error = validation.queue_name_error(row.queue)
        allowed = conf.get("QUEUES")
        if error is None and allowed is not None and row.queue not in allowed:
            error = f"the queue {row.queue!r} is not one of DBQUEUE['QUEUES'] ({', '.join(allowed)})"
        if error is not None:
            refuse("queue", error)
    arguments_read = True
    if not isinstance(row.args, list):
        arguments_read = False
        refuse("args", f'positional arguments must be a JSON list, such as ["eu", 3], not a {_json_type(row.args)}')
    if not isinstance(row.kwargs, dict):
        arguments_read = False
        refuse(
            "kwargs",
            f'keyword arguments must be a JSON object, such as {{"full": true}}, not a {_json_type(row.kwargs)}',
        )
    definition = registry.find(row.job_name)
    if definition is None:
        close = difflib.get_close_matches(row.job_name or "", sorted(registry.all_definitions()), n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        refuse("job_name", f"no job is registered under the name {row.job_name!r}{hint}")
    tick_argument = row.tick_argument or ""
    if tick_argument and not tick_argument.isidentifier():
        refuse("tick_argument", f"the tick is passed as a keyword: a Python name, not {tick_argument!r}")
    elif definition is not None and arguments_read:
        kwargs = {**row.kwargs, **({tick_argument: None} if tick_argument else {})}
        error = validation.call_error(definition.func, tuple(row.args), kwargs, takes_context=definition.takes_context)
        if error is not None:
            refuse(NON_FIELD_ERRORS, f"the job {row.job_name} cannot take these arguments: {error}")
    return found


def check(row: StoredSchedule, declared: Collection[str] = ()) -> None:
    """Raise ValidationError with every reason ``row`` cannot be saved (``errors`` and ``full_clean``'s)."""
    found = errors(row, declared)
    try:
        row.full_clean()
    except ValidationError as exc:
        for field, messages in exc.message_dict.items():
            found.setdefault(field, []).extend(message for message in messages if message not in found.get(field, []))
    if found:
        raise ValidationError(found)


def version() -> tuple[int, int]:
    """The stored schedules' count and the sum of their revisions: a row created, changed (each save
    draws a new revision) or deleted changes it. One cheap query, which each ticker sends every
    ``ticker.STORED_CHECK`` seconds."""
    totals = StoredSchedule.objects.aggregate(count=Count("pk"), revisions=Sum("revision"))
    return int(totals["count"]), int(totals["revisions"] or 0)


def _json_type(value: object) -> str:
    names = {dict: "object", list: "list", str: "string", bool: "boolean", int: "number", float: "number"}
    return "null" if value is None else names.get(type(value), type(value).__name__)
