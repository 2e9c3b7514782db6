"""Periodic jobs: schedules declared in code (``periodic``) or stored at runtime (``StoredSchedule``,
``save_stored``), ticked by the workers.

Every worker runs a ``Ticker``: in one transaction it locks the due schedule's
``ScheduleState`` row (a compare-and-set of ``next_tick`` on SQLite), enqueues the job
and moves ``next_tick`` on, so each tick is enqueued exactly once on any number of hosts.
The ticker (``ticker``) reads the stored schedules again when their version changes.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import logging
from collections.abc import Collection, Mapping, Sequence
from datetime import UTC, datetime, timedelta
from types import MappingProxyType
from typing import Any

from django.core.exceptions import ImproperlyConfigured
from django.db import connections, transaction
from django.db.models import Exists, F, OuterRef
from django.utils import timezone

from . import cron, payload, registry, stored_schedules
from .cron import SHORTHANDS as SHORTHANDS
from .cron import Missed, Plan, Timing
from .db import DbNow, alias, claims_with_skip_locked, update_rows
from .enqueue import enqueue_many
from .models import Job, ScheduleState, StoredSchedule
from .models.tables import draw_revision

logger = logging.getLogger("django_dbqueue")


_schedules: dict[str, Schedule] = {}


class Outcome(enum.StrEnum):
    ENQUEUED = "enqueued"
    SKIPPED = "skipped"
    SCHEDULED = "scheduled"
    NOT_DUE = "not-due"
    TAKEN = "taken"  # another worker holds the row or moved it on first
    CHANGED = "changed"  # the row was written for a schedule other than this process's (an edit not read yet)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Schedule(Timing):
    """A periodic run of a job, as declared in code; see ``periodic``."""

    name: str
    job_name: str
    args: tuple[Any, ...] = ()
    kwargs: Mapping[str, Any] = dataclasses.field(default_factory=lambda: MappingProxyType({}))
    overlap: bool = True
    # Pass the tick (an aware datetime, in the schedule's time zone) under this keyword.
    tick_argument: str | None = None
    # The definition declared (with its ``.using(...)`` options); None: the registered one.
    definition: registry.JobDefinition[..., Any] | None = dataclasses.field(default=None, compare=False, repr=False)

    def arguments(self) -> str:
        return json.dumps(payload.encode_arguments(self.args, dict(self.kwargs)), sort_keys=True)

    def columns(self) -> dict[str, str]:
        """What its ``ScheduleState`` row keeps."""
        return {
            "job_name": self.job_name,
            "expression": self.expression,
            "timezone": self.timezone_name,
            "arguments": self.arguments(),
        }

    def matches(self, state: ScheduleState) -> bool:
        """Whether ``state`` was written for this schedule (not for an edit of it, or the one before)."""
        return all(getattr(state, field) == value for field, value in self.columns().items())

    def call(self, tick: datetime) -> registry.JobCall:
        kwargs = dict(self.kwargs)
        if self.tick_argument:
            kwargs[self.tick_argument] = tick.astimezone(self.zone)
        definition = self.definition if self.definition is not None else registry.get(self.job_name)
        return definition.bind(*self.args, **kwargs)


def periodic(
    job: registry.JobDefinition[..., Any] | str,
    cron: str | None = None,
    *,
    every: int | timedelta | None = None,
    args: Sequence[Any] = (),
    kwargs: Mapping[str, Any] | None = None,
    tz: str | None = None,
    name: str | None = None,
    missed: Missed | str = Missed.ONCE,
    overlap: bool = True,
    tick_argument: str | None = None,
) -> Schedule:
    """Enqueue ``job`` at each tick of ``cron`` (or ``every`` so many seconds); return the schedule.

    ``cron`` has 5 fields (6 with seconds first) or is a shorthand such as ``@daily``, read in
    ``tz`` (default ``settings.TIME_ZONE``). ``name`` (default: the job's) keeps its state across deploys.
    """
    job_name = job if isinstance(job, str) else job.name
    where = f"periodic({job_name!r})"
    if (cron is None) == (every is None):
        raise ImproperlyConfigured(f"{where}: give a cron expression or every=seconds, one of them")
    if cron is not None and (not isinstance(cron, str) or not cron.strip()):
        raise ImproperlyConfigured(f"{where}: the cron expression must be a non-empty string, not {cron!r}")
    seconds = every.total_seconds() if isinstance(every, timedelta) else every
    if seconds is not None and not (
        isinstance(seconds, (int, float)) and not isinstance(seconds, bool) and 1 <= seconds == int(seconds)
    ):
        raise ImproperlyConfigured(f"{where}: every must be a whole number of seconds, at least 1, not {every!r}")
    try:
        missed = Missed(missed)
    except ValueError:
        raise ImproperlyConfigured(f"{where}: missed must be 'once' or 'skip', not {missed!r}") from None
    if not isinstance(overlap, bool):
        raise ImproperlyConfigured(f"{where}: overlap must be True or False, not {overlap!r}")
    if tz is not None and not isinstance(tz, str):
        raise ImproperlyConfigured(f"{where}: tz must be a time zone name such as 'Europe/Berlin', not {tz!r}")
    if tick_argument is not None and not (isinstance(tick_argument, str) and tick_argument.isidentifier()):
        raise ImproperlyConfigured(f"{where}: tick_argument must be a keyword name, not {tick_argument!r}")
    schedule_name = job_name if name is None else name
    if not isinstance(schedule_name, str) or not schedule_name.strip() or len(schedule_name) > 200:
        raise ImproperlyConfigured(f"{where}: name must be a non-empty string of at most 200 characters")
    schedule = Schedule(
        name=schedule_name,
        job_name=job_name,
        cron=cron.strip() if cron is not None else None,
        every=int(seconds) if seconds is not None else None,
        args=tuple(args),
        kwargs=MappingProxyType(dict(kwargs or {})),
        timezone=tz,
        missed=missed,
        overlap=overlap,
        tick_argument=tick_argument,
        definition=None if isinstance(job, str) else job,
    )
    try:
        schedule.arguments()
        if schedule.definition is not None:
            # Arguments the job cannot take are refused here, not at every tick.
            schedule.definition.bind(
                *schedule.args, **schedule.kwargs, **({tick_argument: None} if tick_argument else {})
            )
    except TypeError as exc:
        raise ImproperlyConfigured(f"{where}: {exc}") from None
    existing = _schedules.get(schedule.name)
    if existing is not None and existing != schedule:
        raise ImproperlyConfigured(
            f"Two schedules are named {schedule.name!r} ({existing.expression} and {schedule.expression}); "
            "give each schedule of a job its own name: periodic(job, ..., name='...')"
        )
    _schedules[schedule.name] = schedule
    return schedule


def unschedule(name: str) -> None:
    """Forget the schedule declared under ``name`` in this process (its row stays, as stale)."""
    _schedules.pop(name, None)


def all_schedules() -> dict[str, Schedule]:
    return dict(_schedules)


def usable(schedules: Mapping[str, Schedule]) -> dict[str, Schedule]:
    """The schedules a ticker can tick: the others are logged (and reported by the system checks)."""
    result = {}
    for name, schedule in schedules.items():
        error = schedule.expression_error() or schedule.timezone_error()
        if error is None and registry.find(schedule.job_name) is None:
            error = f"no job is registered under the name {schedule.job_name!r}"
        if error is None:
            try:
                schedule.call(datetime.now(UTC))
            except TypeError as exc:
                error = str(exc)
        if error is not None:
            logger.error("schedule not ticked schedule=%s: %s", name, error)
            continue
        result[name] = schedule
    return result


def from_stored(row: StoredSchedule) -> Schedule:
    """The schedule a stored row declares: its job (on the row's queue, if it names one), arguments,
    expression, time zone, and an offset within its jitter (``cron.offset``)."""
    definition = registry.find(row.job_name)
    if definition is not None and row.queue:
        definition = definition.using(queue=row.queue)
    return Schedule(
        name=row.name,
        job_name=row.job_name,
        cron=row.cron.strip(),
        timezone=row.timezone or None,
        offset=cron.offset(row.name, row.jitter),
        args=tuple(row.args),
        kwargs=MappingProxyType(dict(row.kwargs)),
        tick_argument=row.tick_argument or None,
        definition=definition,
    )


def read_stored(declared: Collection[str]) -> dict[str, Schedule]:
    """The enabled stored schedules a ticker can tick; the others are logged (a name also declared in
    code is the code's)."""
    result = {}
    for row in StoredSchedule.objects.filter(enabled=True):
        problems = stored_schedules.errors(row, declared)
        if problems:
            reasons = "; ".join(message for messages in problems.values() for message in messages)
            logger.error("stored schedule not ticked schedule=%s: %s", row.name, reasons)
            continue
        result[row.name] = from_stored(row)
    return result


def save_stored(row: StoredSchedule) -> StoredSchedule:
    """Check ``row`` (ValidationError with each reason) and save it, with its ``ScheduleState`` row:
    a changed expression moves the next tick at once (a worker that has not read the edit leaves the
    row alone: ``Outcome.CHANGED``); every worker ticks it as saved within ``ticker.STORED_CHECK``
    seconds. Disabling or enabling it moves its state as ``set_enabled`` does."""
    stored_schedules.check(row, _schedules)
    with transaction.atomic(using=alias()):
        row.save()
        set_enabled([row.name], row.enabled)
        if row.enabled:
            sync({row.name: from_stored(row)})
    logger.info("stored schedule saved schedule=%s expression=%s enabled=%s", row.name, row.cron, row.enabled)
    return row


def delete_stored(names: Sequence[str]) -> int:
    """Delete the stored schedules ``names``; return how many. Their ``ScheduleState`` rows stay, with
    their history, disabled at once (no worker ticks them again) and shown as stale."""
    with transaction.atomic(using=alias()):
        deleted, _ = StoredSchedule.objects.filter(name__in=list(names)).delete()
        ScheduleState.objects.filter(name__in=list(names), enabled=True).update(enabled=False, updated_at=DbNow())
    if deleted:
        logger.info("stored schedules deleted schedules=%s", ",".join(names))
    return deleted


def with_stored(states: Any) -> Any:
    """``states`` (a ScheduleState queryset) annotated with whether a stored schedule has each one's name."""
    return states.annotate(stored=Exists(StoredSchedule.objects.filter(name=OuterRef("name"))))


def is_stale(state: ScheduleState) -> bool:
    """Tell whether the row's schedule is neither declared in this code nor stored (it does not tick)."""
    if state.name in _schedules:
        return False
    stored = getattr(state, "stored", None)  # annotated by ``with_stored``
    if stored is None:
        stored = StoredSchedule.objects.filter(name=state.name).exists()
    return not stored


def get(name: str) -> Schedule:
    """The schedule declared in code under ``name``, else the one stored; LookupError if neither."""
    if name in _schedules:
        return _schedules[name]
    row = StoredSchedule.objects.filter(name=name).first()
    if row is not None:
        return from_stored(row)
    raise LookupError(
        f"No schedule is declared under the name {name!r} in this code, nor stored"
        + (f"; declared: {', '.join(sorted(_schedules))}" if _schedules else "")
    )


def sync(schedules: Mapping[str, Schedule]) -> None:
    """Write the schedules of this code to their rows: insert new ones, update changed ones
    (a changed expression or time zone clears ``next_tick``)."""
    stored = {row.name: row for row in ScheduleState.objects.filter(name__in=list(schedules))}
    new = [
        ScheduleState(name=schedule.name, **schedule.columns(), created_at=DbNow(), updated_at=DbNow())
        for schedule in schedules.values()
        if schedule.name not in stored
    ]
    if new:
        ScheduleState.objects.bulk_create(new, ignore_conflicts=True)
    for name, row in stored.items():
        schedule = schedules[name]
        if schedule.matches(row):
            continue
        changes: dict[str, Any] = {**schedule.columns(), "updated_at": DbNow()}
        if row.expression != schedule.expression or row.timezone != schedule.timezone_name:
            changes["next_tick"] = None
        ScheduleState.objects.filter(pk=row.pk, expression=row.expression, timezone=row.timezone).update(**changes)
        logger.info(
            "schedule changed schedule=%s expression=%s timezone=%s", name, schedule.expression, schedule.timezone_name
        )
    # Rows with no next tick yet get their first in one transaction, not one each.
    unplanned = ScheduleState.objects.filter(name__in=list(schedules), next_tick__isnull=True, enabled=True)
    first = [(pk, None) for pk in unplanned.values_list("pk", flat=True)]
    if first:
        tick_many(schedules, first)


def _plan(schedule: Schedule, due: datetime, now: datetime, last_job_id: int | None, *, still_queued: bool) -> Plan:
    """``schedule.plan``, with no run if the schedule may not overlap its last run, ``still_queued``."""
    plan = schedule.plan(due, now)
    if plan.run is not None and not schedule.overlap and still_queued:
        logger.info(
            "tick skipped schedule=%s tick=%s: its last run (job %s) is still waiting or running",
            schedule.name, plan.run.isoformat(), last_job_id,
        )  # fmt: skip
        return Plan(None, plan.next_tick, plan.skipped + 1)
    if plan.skipped:
        logger.warning(
            "ticks missed schedule=%s skipped=%s policy=%s next_tick=%s",
            schedule.name, plan.skipped, schedule.missed.value, plan.next_tick.isoformat(),
        )  # fmt: skip
    return plan


def tick(schedule: Schedule, pk: int, expected: datetime | None) -> Outcome:
    """``tick_many`` for the one row ``pk`` of ``schedule``."""
    return tick_many({schedule.name: schedule}, [(pk, expected)])[0]


def tick_many(schedules: Mapping[str, Schedule], due: Sequence[tuple[int, datetime | None]]) -> list[Outcome]:
    """Tick each row ``(pk, next_tick)`` of ``due`` whose ``next_tick`` is still the one read:
    enqueue its due tick (if any) and move ``next_tick`` on, in one transaction and a few
    statements for all rows. Rows another worker holds or moved on come back ``TAKEN``."""
    using = alias()
    locking = claims_with_skip_locked(using)
    expected = dict(due)
    outcomes: dict[int, Outcome] = dict.fromkeys(expected, Outcome.TAKEN)
    with transaction.atomic(using=using):
        query = ScheduleState.objects.filter(pk__in=list(expected), enabled=True).annotate(db_now=DbNow())
        if locking:
            query = query.select_for_update(skip_locked=True)
        states = []
        for state in query.order_by("pk"):
            if state.next_tick != expected[state.pk] or state.name not in schedules:
                continue
            if schedules[state.name].matches(state):
                states.append(state)
            else:  # another worker wrote an edit this one has not read: it ticks the row
                outcomes[state.pk] = Outcome.CHANGED
        if not locking:
            # SQLite: a compare-and-set of next_tick takes the write lock; a row moved on meanwhile is another's.
            rows = ScheduleState.objects.filter(enabled=True)
            states = [s for s in states if rows.filter(pk=s.pk, next_tick=s.next_tick).update(updated_at=s.db_now)]
        watched = {state.last_job_id for state in states if state.last_job_id and not schedules[state.name].overlap}
        queued = set(Job.objects.filter(pk__in=watched).values_list("pk", flat=True)) if watched else set()
        calls: list[registry.JobCall] = []
        runs: list[tuple[ScheduleState, datetime]] = []
        for state in states:
            schedule, now = schedules[state.name], state.db_now
            state.updated_at = now
            if state.next_tick is None:
                state.next_tick = schedule.next_after(now)
                outcomes[state.pk] = Outcome.SCHEDULED
                continue
            if state.next_tick > now:
                outcomes[state.pk] = Outcome.NOT_DUE
                continue
            plan = _plan(schedule, state.next_tick, now, state.last_job_id, still_queued=state.last_job_id in queued)
            state.next_tick, state.skipped = plan.next_tick, state.skipped + plan.skipped
            outcomes[state.pk] = Outcome.SKIPPED
            if plan.run is not None:
                calls.append(schedule.call(plan.run))
                runs.append((state, plan.run))
        # Plain MySQL's bulk insert returns no ids: each run is enqueued on its own.
        if connections[using].features.can_return_rows_from_bulk_insert:
            handles = enqueue_many(calls) if calls else []
        else:
            handles = [call.enqueue() for call in calls]
        for (state, run), handle in zip(runs, handles, strict=True):
            state.last_tick, state.last_run_at, state.last_job_id = run, state.db_now, handle.id
            state.runs += 1
            outcomes[state.pk] = Outcome.ENQUEUED
            logger.info(
                "schedule ticked schedule=%s tick=%s job=%s id=%s", state.name, run.isoformat(), handle.name, handle.id
            )
        if states:
            update_rows(ScheduleState, states, _TICK_FIELDS, using)
    return [outcomes[pk] for pk, _ in due]


_TICK_FIELDS = ("next_tick", "skipped", "updated_at", "last_tick", "last_run_at", "last_job_id", "runs")


def run_now(name: str) -> Any:
    """Enqueue one extra run of the schedule ``name`` now (its tick: the database's time); return
    its ``JobHandle``. The schedule's ticks are unchanged; ``overlap`` does not apply."""
    schedule = get(name)
    if registry.find(schedule.job_name) is None:
        raise LookupError(f"Schedule {name!r} names the job {schedule.job_name!r}, which is not registered")
    sync({name: schedule})
    with transaction.atomic(using=alias()):
        state = ScheduleState.objects.select_for_update().annotate(db_now=DbNow()).get(name=name)
        now = state.db_now
        handle = schedule.call(now).enqueue()
        ScheduleState.objects.filter(pk=state.pk).update(
            last_run_at=now, last_job_id=handle.id, runs=F("runs") + 1, updated_at=now
        )
    logger.info("schedule run now schedule=%s job=%s id=%s", name, handle.name, handle.id)
    return handle


def set_enabled(names: Sequence[str], enabled: bool) -> int:
    """Enable or disable schedules (and the stored ones of these names); return how many changed.
    Enabling clears ``next_tick``: the ticks that passed while disabled are not caught up."""
    with transaction.atomic(using=alias()):
        stored = StoredSchedule.objects.filter(name__in=list(names)).exclude(enabled=enabled)
        changed = set(stored.values_list("name", flat=True))
        if changed:
            stored.update(enabled=enabled, revision=draw_revision(), updated_at=timezone.now())
        rows = ScheduleState.objects.filter(name__in=list(names)).exclude(enabled=enabled)
        changed.update(rows.values_list("name", flat=True))
        if enabled:
            rows.update(enabled=True, next_tick=None, updated_at=DbNow())
        else:
            rows.update(enabled=False, updated_at=DbNow())
    return len(changed)
