"""Periodic jobs: schedules declared in code, ticked by the workers.

A schedule is declared next to its job with ``periodic(job, "*/5 * * * *")``
(when it ticks is ``cron.Timing``); its state (next tick, last run, enabled) is a
``ScheduleState`` row. Every worker runs a ``Ticker``, a thread that sleeps until
the next tick is due and then enqueues it: in one transaction it locks the
schedule's row (``SELECT ... FOR UPDATE SKIP LOCKED``; a compare-and-set of
``next_tick`` on SQLite), inserts the job and moves ``next_tick`` on. So any
number of workers on any number of hosts enqueue each tick exactly once, and a
worker killed mid-tick leaves the row as it was, for the next worker. Times come
from the database's clock.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from datetime import datetime, timedelta
from types import MappingProxyType, TracebackType
from typing import Any

from django.core.exceptions import ImproperlyConfigured
from django.db import DatabaseError, connections, transaction
from django.db.models import F

from . import payload, registry
from .cron import SHORTHANDS as SHORTHANDS
from .cron import Missed, Plan, Timing
from .db import DbNow, alias, claims_with_skip_locked, drop_connection, error_text
from .enqueue import enqueue_many
from .models import Job, ScheduleState

logger = logging.getLogger("django_dbqueue")

# The longest a ticker sleeps, so a schedule enabled, disabled or changed by
# another process (the admin, a deploy) is seen within this many seconds.
MAX_SLEEP = 30.0
# Seconds before a ticker looks again at a row another worker holds (it is ticking it).
BUSY_RETRY = 0.1
# Seconds before a ticker retries after a database error (doubled, up to the last).
ERROR_RETRY = (1.0, 2.0, 5.0)
# Seconds ``Ticker.stop`` waits for a tick in flight.
STOP_WAIT = 5.0
# Rows read per look: the due ones and the next to come.
LOOK_AHEAD = 100

_schedules: dict[str, Schedule] = {}


class Outcome(enum.StrEnum):
    ENQUEUED = "enqueued"
    SKIPPED = "skipped"
    SCHEDULED = "scheduled"
    NOT_DUE = "not-due"
    # Another worker holds the row or moved it on first.
    TAKEN = "taken"


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
        """The arguments of each run, as stored JSON."""
        return json.dumps(payload.encode_arguments(self.args, dict(self.kwargs)), sort_keys=True)

    def columns(self) -> dict[str, str]:
        """What its ``ScheduleState`` row keeps of the declaration."""
        return {
            "job_name": self.job_name,
            "expression": self.expression,
            "timezone": self.timezone_name,
            "arguments": self.arguments(),
        }

    def call(self, tick: datetime) -> registry.JobCall:
        """The call to enqueue for ``tick``."""
        kwargs = dict(self.kwargs)
        if self.tick_argument:
            kwargs[self.tick_argument] = tick.astimezone(self.zone)
        definition = self.definition if self.definition is not None else registry.get(self.job_name)
        return definition.bind(*self.args, **kwargs)


# -- declaring ---------------------------------------------------------------


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

    ``cron`` has 5 fields (6 with seconds first) or is a shorthand such as
    ``@daily``, read in ``tz`` (default ``settings.TIME_ZONE``). A bad
    expression or time zone is reported by the system checks, so ``queue_work``
    refuses to start. ``name`` (default: the job's name) keeps the schedule's
    state across deploys: give each schedule of one job its own.
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
        if error is not None:
            logger.error("schedule not ticked schedule=%s: %s", name, error)
            continue
        result[name] = schedule
    return result


def is_stale(state: ScheduleState) -> bool:
    """Tell whether the row's schedule is no longer declared in this code (it does not tick)."""
    return state.name not in _schedules


def get(name: str) -> Schedule:
    try:
        return _schedules[name]
    except KeyError:
        raise LookupError(
            f"No schedule is declared under the name {name!r} in this code"
            + (f"; declared: {', '.join(sorted(_schedules))}" if _schedules else "")
        ) from None


# -- the database ------------------------------------------------------------


def sync(schedules: Mapping[str, Schedule]) -> None:
    """Write the schedules of this code to their rows: insert new ones, update changed ones.

    A changed expression or time zone clears ``next_tick``, so the next tick is
    computed afresh; other rows, and rows of schedules not in this code, keep
    their state.
    """
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
        declared = schedule.columns()
        if all(getattr(row, field) == value for field, value in declared.items()):
            continue
        changes: dict[str, Any] = {**declared, "updated_at": DbNow()}
        if row.expression != schedule.expression or row.timezone != schedule.timezone_name:
            changes["next_tick"] = None
        ScheduleState.objects.filter(pk=row.pk, expression=row.expression, timezone=row.timezone).update(**changes)
        logger.info(
            "schedule changed schedule=%s expression=%s timezone=%s", name, schedule.expression, schedule.timezone_name
        )
    # Rows with no next tick yet (new, or changed) get their first in one transaction, not one
    # each: a worker that starts with 1,000 new schedules must not delay its first jobs.
    unplanned = ScheduleState.objects.filter(name__in=list(schedules), next_tick__isnull=True, enabled=True)
    first = [(pk, None) for pk in unplanned.values_list("pk", flat=True)]
    if first:
        tick_many(schedules, first)


def _plan(schedule: Schedule, due: datetime, now: datetime, last_job_id: int | None, *, still_queued: bool) -> Plan:
    """``schedule.plan``, then no run if the schedule may not overlap and its last run is
    ``still_queued``; logs what is skipped."""
    plan = schedule.plan(due, now)
    if plan.run is not None and not schedule.overlap and still_queued:
        logger.info(
            "tick skipped schedule=%s tick=%s: its last run (job %s) is still waiting or running",
            schedule.name,
            plan.run.isoformat(),
            last_job_id,
        )
        return Plan(None, plan.next_tick, plan.skipped + 1)
    if plan.skipped:
        logger.warning(
            "ticks missed schedule=%s skipped=%s policy=%s next_tick=%s",
            schedule.name,
            plan.skipped,
            schedule.missed.value,
            plan.next_tick.isoformat(),
        )
    return plan


def tick(schedule: Schedule, pk: int, expected: datetime | None) -> Outcome:
    """``tick_many`` for the one row ``pk`` of ``schedule``."""
    return tick_many({schedule.name: schedule}, [(pk, expected)])[0]


def tick_many(schedules: Mapping[str, Schedule], due: Sequence[tuple[int, datetime | None]]) -> list[Outcome]:
    """Tick each row ``(pk, next_tick)`` of ``due`` whose ``next_tick`` is still the one read:
    enqueue its due tick (or none: missed, or overlapping) and move ``next_tick`` on; a row
    with no ``next_tick`` only gets one. One transaction for all rows: one locking read (on
    SQLite a read, then a compare-and-set of each row), one query for the last runs of
    schedules that must not overlap, one bulk enqueue and one UPDATE sent for every row, so a
    catch-up of 1,000 schedules after a deploy is a few statements, not thousands. Rows another
    worker holds, or moved on meanwhile, come back ``TAKEN``.
    """
    using = alias()
    locking = claims_with_skip_locked(using)
    expected = dict(due)
    outcomes: dict[int, Outcome] = dict.fromkeys(expected, Outcome.TAKEN)
    with transaction.atomic(using=using):
        query = ScheduleState.objects.filter(pk__in=list(expected), enabled=True).annotate(db_now=DbNow())
        if locking:
            query = query.select_for_update(skip_locked=True)
        states = [s for s in query.order_by("pk") if s.next_tick == expected[s.pk] and s.name in schedules]
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
            _save_rows(states, using, _TICK_FIELDS)
    return [outcomes[pk] for pk, _ in due]


_TICK_FIELDS = ("next_tick", "skipped", "updated_at", "last_tick", "last_run_at", "last_job_id", "runs")


def _save_rows(states: Sequence[ScheduleState], using: str, names: Sequence[str]) -> None:
    """Write ``names`` of many rows with one parameterised UPDATE sent for all of them
    (``executemany``; psycopg pipelines it). ``bulk_update`` builds a CASE per field and row, whose CPU grows with
    the rows: a catch-up of many schedules would hold a worker's GIL for seconds."""
    connection = connections[using]
    meta = ScheduleState._meta
    by_name = {field.name: field for field in meta.concrete_fields}
    fields = [by_name[name] for name in names]
    quote = connection.ops.quote_name
    assignments = ", ".join(f"{quote(str(field.column))} = %s" for field in fields)
    pk = quote(str(by_name["id"].column))
    sql = f"UPDATE {quote(meta.db_table)} SET {assignments} WHERE {pk} = %s"
    params = [
        [field.get_db_prep_save(getattr(state, field.attname), connection) for field in fields] + [state.pk]
        for state in states
    ]
    with connection.cursor() as cursor:
        cursor.executemany(sql, params)


def run_now(name: str) -> Any:
    """Enqueue one extra run of the schedule ``name`` now; return its ``JobHandle``.

    The tick passed (with ``tick_argument``) is the database's time; the
    schedule's ticks are unchanged, and ``overlap`` does not apply.
    """
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
    """Enable or disable schedules; return how many changed.

    Enabling clears ``next_tick``: the ticks that passed while a schedule was
    disabled are not caught up, the next one is computed from now.
    """
    rows = ScheduleState.objects.filter(name__in=list(names)).exclude(enabled=enabled)
    if enabled:
        return rows.update(enabled=True, next_tick=None, updated_at=DbNow())
    return rows.update(enabled=False, updated_at=DbNow())


# -- the ticker ----------------------------------------------------------------


class Ticker:
    """Tick this process's schedules from a thread, until ``stop``; a context manager.

    The thread has its own database connection (closed when it stops). It
    writes the schedules to their rows once, then loops: one query reads the due
    rows and the next to come; the due ticks are one short transaction; then it
    sleeps until the next tick, ``MAX_SLEEP`` seconds at most. A process without
    schedules starts no thread.
    """

    def __init__(
        self, worker_id: str, enabled: bool = True, *, schedules: Mapping[str, Schedule] | None = None
    ) -> None:
        self.worker_id = worker_id
        self.enabled = enabled
        self.schedules = dict(schedules) if schedules is not None else None
        # Statements this ticker's thread sent to the database (see ``queries_per_minute``).
        self.statements = 0
        self.ticked = 0

        self._started = 0.0
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> Ticker:
        if not self.enabled or self._thread is not None:
            return self
        schedules = usable(self.schedules if self.schedules is not None else all_schedules())
        if not schedules:
            return self
        self._started = time.monotonic()
        self._stopping.clear()
        self._thread = threading.Thread(
            target=self._run, args=(schedules,), name=f"dbqueue-ticker-{self.worker_id}", daemon=True
        )
        self._thread.start()
        logger.info("ticker started worker_id=%s schedules=%s", self.worker_id, len(schedules))
        return self

    def stop(self) -> None:
        self._stopping.set()
        thread, self._thread = self._thread, None
        if thread is None:
            return
        if thread.is_alive():
            thread.join(STOP_WAIT)
        logger.info(
            "ticker stopped worker_id=%s ticked=%s statements=%s per_minute=%.1f",
            self.worker_id,
            self.ticked,
            self.statements,
            self.queries_per_minute(),
        )

    def queries_per_minute(self) -> float:
        minutes = (time.monotonic() - self._started) / 60 if self._started else 0
        return self.statements / minutes if minutes > 0 else 0.0

    def __enter__(self) -> Ticker:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, traceback: TracebackType | None
    ) -> None:
        self.stop()

    def _count(self, execute: Callable[..., Any], sql: str, params: Any, many: bool, context: Any) -> Any:
        self.statements += 1
        return execute(sql, params, many, context)

    def _run(self, schedules: dict[str, Schedule]) -> None:
        connection = connections[alias()]
        errors = 0
        synced = False
        try:
            with connection.execute_wrapper(self._count):
                while not self._stopping.is_set():
                    try:
                        if not synced:
                            sync(schedules)
                            synced = True
                        delay = self.look(schedules)
                        errors = 0
                    except DatabaseError as exc:
                        delay = ERROR_RETRY[min(errors, len(ERROR_RETRY) - 1)]
                        errors += 1
                        logger.warning(
                            "ticker failed worker_id=%s retry_in=%ss: %s", self.worker_id, delay, error_text(exc)
                        )
                        drop_connection()
                    except Exception:
                        # A bug or a job that cannot be enqueued must not end the ticking of the others.
                        delay = ERROR_RETRY[-1]
                        logger.exception("ticker failed worker_id=%s retry_in=%ss", self.worker_id, delay)
                    if delay > 0:
                        self._stopping.wait(delay)
        finally:
            drop_connection()

    def look(self, schedules: Mapping[str, Schedule]) -> float:
        """Tick what is due; return the seconds until the next look."""
        rows = list(
            ScheduleState.objects.filter(name__in=list(schedules), enabled=True)
            .annotate(db_now=DbNow())
            .order_by(F("next_tick").asc(nulls_first=True), "pk")
            .values_list("pk", "name", "next_tick", "db_now")[:LOOK_AHEAD]
        )
        read = time.monotonic()
        due = [(pk, next_tick) for pk, _, next_tick, now in rows if next_tick is None or next_tick <= now]
        if due:
            outcomes = tick_many(schedules, due)
            self.ticked += outcomes.count(Outcome.ENQUEUED)
            # Another worker is ticking a due row: look again once it is done. Else read the
            # rows again: the ones just ticked have new next ticks.
            return BUSY_RETRY if Outcome.TAKEN in outcomes else 0
        if not rows:
            return MAX_SLEEP
        _, _, next_tick, now = rows[0]
        delay: float = (next_tick - now).total_seconds() - (time.monotonic() - read)
        return max(0.0, min(delay, MAX_SLEEP))
