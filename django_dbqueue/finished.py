"""The history of finished jobs: one ``FinishedJob`` row per job that ended, kept
``DBQUEUE["KEEP_FINISHED"]`` hours (None, the default: no history).

It attaches at one point, a reaction of ``lifecycle.reactions.REACTIONS`` (``record``) to rows
that succeeded, failed or were cancelled, so its row is written in the transaction that ends
the job and can never disagree with the queue: a run whose reservation was reclaimed ended
nothing and leaves no row, the run that finishes leaves one. With the history off, no
reaction is concerned and the drain pays nothing.

On PostgreSQL the table is partitioned by UTC day (migration 0018): ``add_partitions`` creates
the days ahead, retention drops whole days (``prune``), and a day without a partition falls
into the default one, never failing an insert. Elsewhere ``prune`` deletes in chunks.
``search`` is the admin's and the commands' query of the table.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Mapping, Sequence
from datetime import UTC, date, datetime, timedelta
from typing import Any

from django.db import connections, transaction
from django.db.models import Q, QuerySet

from . import conf
from .db import DbNow, alias, bound_cursor, cached_sql
from .exceptions import PayloadError
from .models import CANCELLED_CLASS, FailedJob, FinishedJob, Job
from .payload import raw
from .states import Ended, JobStatus

logger = logging.getLogger("django_dbqueue")

TABLE = "dbqueue_finished_job"
DEFAULT_PARTITION = f"{TABLE}_default"
# Days ahead (UTC, today included) whose partitions exist once a worker starts or prunes.
DAYS_AHEAD = 3
# Rows deleted per statement where rows are deleted (not PostgreSQL's days).
PRUNE_CHUNK = 10_000
_PARTITION = re.compile(rf"^{TABLE}_p(\d{{8}})$")


def keeping() -> bool:
    """Whether finished jobs are kept (``DBQUEUE["KEEP_FINISHED"]`` is not None)."""
    return conf.get("KEEP_FINISHED") is not None


# -- the reaction ------------------------------------------------------------------------------


# The columns ``record`` writes, in order (``finished_at`` is the database's clock).
COLUMNS = (
    "job_id", "queue", "name", "payload", "priority", "outcome", "attempts", "worker", "created_at",
    "started_at", "duration", "exception_class", "error", "batch_id", "node_id",
)  # fmt: skip
# PostgreSQL's array type of each column, for ``_insert_sql``'s unnest (the payload goes as text).
_TYPES = (
    "bigint", "text", "text", "text", "smallint", "text", "integer", "text", "timestamptz", "timestamptz",
    "float8", "text", "text", "bigint", "bigint",
)  # fmt: skip
# The NUL character and lone surrogates, which PostgreSQL's jsonb refuses (a dumped envelope
# writes every other character as it is).
_UNSTORABLE = re.compile(r"\\u(0000|[dD][89a-fA-F])")


def record(using: str, ended: Mapping[str, Sequence[Any]], follow: list[Job]) -> None:
    """Write the finished rows of jobs that ``ended`` (rows by outcome), in the caller's transaction.

    A row read without its payload (an operator's bulk delete of a queue reads only the ids it
    needs) is left out. A failure's error is read from the ``FailedJob`` row the same transaction
    wrote; one cancelled there (``CANCELLED_CLASS``) is kept as cancelled. On PostgreSQL one fixed
    statement inserts them all (the ORM's bulk insert cost the drain more than the rows did).
    """
    failures: dict[int, tuple[str, str]] = {}
    failed = [row.pk for row in ended.get(Ended.FAILED, ())]
    if failed:
        for job_id, exception_class, error in (
            FailedJob.objects.using(using)
            .filter(job_id__in=failed)
            .order_by("id")
            .values_list("job_id", "exception_class", "error")
        ):
            failures[job_id] = (exception_class, error)
    rows = []
    for kind, jobs in ended.items():
        for job in jobs:
            values = vars(job)
            if "payload" not in values or "name" not in values:
                continue
            exception_class, error = failures.get(job.pk, ("", "")) if kind == Ended.FAILED else ("", "")
            if kind == Ended.SUCCEEDED:
                outcome = JobStatus.SUCCEEDED
            elif kind == Ended.CANCELLED or exception_class == CANCELLED_CLASS:
                outcome = JobStatus.CANCELLED
            else:
                outcome = JobStatus.FAILED
            created = values.get("created_at")
            rows.append((
                job.pk, job.queue, job.name, _storable(job.payload), values.get("priority") or 0, outcome.value,
                values.get("attempts") or 0, values.get("reserved_by") or "",
                created if isinstance(created, datetime) else None, values.get("reserved_at"), job.ran_for,
                exception_class, error, values.get("batch_id"), values.get("node_id"),
            ))  # fmt: skip
    if not rows:
        return
    connection = connections[using]
    if connection.vendor == "postgresql":
        with bound_cursor(connection) as cursor:
            cursor.execute(_insert_sql(connection), [list(column) for column in zip(*rows, strict=True)])
        return
    finished = []
    for row in rows:
        values = dict(zip(COLUMNS, row, strict=True))
        values["payload"] = None if row[3] is None else raw(row[3])
        values["created_at"] = row[8] or DbNow()
        finished.append(FinishedJob(**values, finished_at=DbNow()))
    FinishedJob.objects.using(using).bulk_create(finished, batch_size=500)


@cached_sql
def _insert_sql(connection: Any) -> str:
    """PostgreSQL: insert the rows given as one array per column (``COLUMNS``)."""
    qn = connection.ops.quote_name
    selected = {"payload": "v.payload::jsonb", "created_at": "coalesce(v.created_at, STATEMENT_TIMESTAMP())"}
    columns = ", ".join(qn(column) for column in (*COLUMNS, "finished_at"))
    values = ", ".join(selected.get(column, f"v.{column}") for column in COLUMNS)
    arrays = ", ".join(f"%s::{kind}[]" for kind in _TYPES)
    return (
        f"INSERT INTO {qn(TABLE)} ({columns}) SELECT {values}, STATEMENT_TIMESTAMP() "
        f"FROM unnest({arrays}) AS v ({', '.join(COLUMNS)})"
    )


# The columns of a job row that ``kept_sql`` reads from the DELETE's RETURNING.
RETURNED = ("queue", "name", "payload", "priority", "attempts", "reserved_by", "created_at", "reserved_at",
            "batch_id", "node_id")  # fmt: skip


def kept_sql(connection: Any, done: str) -> str:
    """PostgreSQL: an INSERT of the finished rows of jobs that succeeded, read from ``done`` (a
    DELETE's RETURNING of ``RETURNED`` besides ``id``), for a statement that deletes them
    (``claims.finish_and_reserve``); its parameters: ``kept_params``."""
    qn = connection.ops.quote_name
    columns = ", ".join(qn(column) for column in (*COLUMNS, "finished_at"))
    return (
        f"INSERT INTO {qn(TABLE)} ({columns}) SELECT d.id, d.queue, d.name, "
        "CASE WHEN h.storable THEN d.payload::jsonb END, d.priority, 'succeeded', d.attempts, d.reserved_by, "
        "d.created_at, d.reserved_at, h.duration, '', '', d.batch_id, d.node_id, STATEMENT_TIMESTAMP() "
        f"FROM {done} AS d JOIN unnest(%s::bigint[], %s::float8[], %s::boolean[]) AS h (id, duration, storable) "
        "ON h.id = d.id"
    )


def kept_params(jobs: Sequence[Job]) -> list[list[Any]]:
    """The parameters of ``kept_sql`` for ``jobs``."""
    return [
        [job.pk for job in jobs],
        [job.ran_for for job in jobs],
        [_storable(job.payload) is not None for job in jobs],
    ]


def _storable(text: Any) -> str | None:
    """The envelope's text if it is JSON that every database stores as such, else None (the row is
    kept unsearchable, never refused)."""
    stored = str(text)
    if _UNSTORABLE.search(stored):
        return None
    try:
        raw(stored)
    except (ValueError, PayloadError, RecursionError):
        return None
    return stored


# -- partitions and retention ------------------------------------------------------------------


def _partition(day: date) -> str:
    return f"{TABLE}_p{day:%Y%m%d}"


def partitions(using: str | None = None) -> dict[date, str]:
    """PostgreSQL: the day partitions of the table, by day (the default partition left out)."""
    using = using or alias()
    with bound_cursor(connections[using]) as cursor:
        cursor.execute(
            "SELECT c.relname FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid "
            "WHERE i.inhparent = %s::regclass",
            [TABLE],
        )
        names = [row[0] for row in cursor.fetchall()]
    found = {}
    for name in names:
        match = _PARTITION.match(name)
        if match:
            found[datetime.strptime(match.group(1), "%Y%m%d").replace(tzinfo=UTC).date()] = name
    return found


def _today(using: str) -> date:
    with bound_cursor(connections[using]) as cursor:
        cursor.execute("SELECT (STATEMENT_TIMESTAMP() AT TIME ZONE 'UTC')::date")
        today: date = cursor.fetchone()[0]
    return today


def add_partitions(using: str | None = None, *, days: int = DAYS_AHEAD) -> list[str]:
    """PostgreSQL: create the partitions of today and the ``days - 1`` days after (UTC) that are
    missing; return their names. Rows of such a day that fell into the default partition move
    into it, in the same transaction. Elsewhere nothing."""
    using = using or alias()
    if connections[using].vendor != "postgresql":
        return []
    today = _today(using)
    have = partitions(using)
    made = []
    for offset in range(days):
        day = today + timedelta(days=offset)
        if day not in have:
            add_partition(day, using)
            made.append(_partition(day))
    return made


def add_partition(day: date, using: str | None = None) -> None:
    """PostgreSQL: create the partition of ``day`` (UTC) if it is missing, moving into it the day's
    rows that fell into the default partition."""
    using = using or alias()
    # The names and bounds come from a date, never from input.
    name, low, high = _partition(day), f"{day:%Y-%m-%d} 00:00:00+00", f"{day + timedelta(days=1):%Y-%m-%d} 00:00:00+00"
    bounds = f"FOR VALUES FROM ('{low}') TO ('{high}')"
    in_range = "finished_at >= %s AND finished_at < %s"
    with transaction.atomic(using=using), bound_cursor(connections[using]) as cursor:
        # Another worker creating it at the same moment waits here, then finds it.
        cursor.execute("SELECT pg_advisory_xact_lock(hashtext(%s))", [TABLE])
        cursor.execute("SELECT to_regclass(%s)", [name])
        if cursor.fetchone()[0] is not None:
            return
        cursor.execute(f"SELECT EXISTS (SELECT 1 FROM {DEFAULT_PARTITION} WHERE {in_range})", [low, high])
        if not cursor.fetchone()[0]:
            cursor.execute(f"CREATE TABLE {name} PARTITION OF {TABLE} {bounds}")
            return
        # The day's rows went to the default partition: they move into the new one, attached after.
        cursor.execute(f"CREATE TABLE {name} (LIKE {TABLE} INCLUDING DEFAULTS INCLUDING CONSTRAINTS)")
        cursor.execute(
            f"WITH moved AS (DELETE FROM {DEFAULT_PARTITION} WHERE {in_range} RETURNING *) "
            f"INSERT INTO {name} SELECT * FROM moved",
            [low, high],
        )
        cursor.execute(f"ALTER TABLE {TABLE} ATTACH PARTITION {name} {bounds}")
        logger.info("finished jobs of day=%s moved from the default partition rows=%s", day, cursor.rowcount)


def prune(hours: float, using: str | None = None) -> int:
    """Delete the finished rows older than ``hours``; return how many rows were deleted one by one.

    On PostgreSQL a day whose last moment is that old is dropped whole (logged, not counted), and
    the days ahead are created; the default partition, and other databases, delete in chunks.
    """
    using = using or alias()
    deleted = 0
    if connections[using].vendor == "postgresql":
        add_partitions(using)
        with bound_cursor(connections[using]) as cursor:
            cursor.execute("SELECT STATEMENT_TIMESTAMP()")
            cutoff = cursor.fetchone()[0] - timedelta(hours=hours)
            for day, name in sorted(partitions(using).items()):
                if datetime(day.year, day.month, day.day, tzinfo=UTC) + timedelta(days=1) <= cutoff:
                    cursor.execute(f"DROP TABLE {name}")
                    logger.info("dropped the finished jobs of day=%s (older than %s hours)", day, hours)
            while True:
                cursor.execute(
                    f"DELETE FROM {DEFAULT_PARTITION} WHERE ctid IN (SELECT ctid FROM {DEFAULT_PARTITION} "
                    "WHERE finished_at < %s LIMIT %s)",
                    [cutoff, PRUNE_CHUNK],
                )
                count = int(cursor.rowcount)
                deleted += count
                if count < PRUNE_CHUNK:
                    return deleted
    old = FinishedJob.objects.using(using).filter(finished_at__lt=DbNow() - timedelta(hours=hours))
    while True:
        ids = list(old.order_by().values_list("pk", flat=True)[:PRUNE_CHUNK])
        if not ids:
            return deleted
        deleted += FinishedJob.objects.using(using).filter(pk__in=ids).delete()[0]


# -- search ------------------------------------------------------------------------------------


def argument_filter(text: str, vendor: str) -> Q:
    """The rows whose arguments hold what ``text`` says, as JSON: an object, keyword arguments
    (``{"order_id": 42}``); anything else, positional arguments (``[42, "eu"]``, or one value:
    ``42``). ValueError if ``text`` is not JSON. PostgreSQL answers from the GIN index."""
    try:
        value = json.loads(text)
    except ValueError:
        raise ValueError(f'arguments must be JSON, such as {{"order_id": 42}} or [42]: {text!r}') from None
    if isinstance(value, dict):
        if vendor == "sqlite":  # no JSON containment: each key compared
            return Q(**{f"payload__kwargs__{key}": item for key, item in value.items()})
        return Q(payload__contains={"kwargs": value})
    values = value if isinstance(value, list) else [value]
    if vendor == "sqlite":
        condition = Q()
        for item in values:
            condition &= Q(payload__args__icontains=json.dumps(item))
        return condition
    return Q(payload__contains={"args": values})


def search(
    *,
    name: str | None = None,
    queue: str | None = None,
    outcome: str | None = None,
    since: datetime | None = None,
    until: datetime | None = None,
    arguments: str | None = None,
    job_id: int | None = None,
    using: str | None = None,
) -> QuerySet[FinishedJob]:
    """The finished rows that match every filter given, newest first (ValueError for bad ``arguments``)."""
    using = using or alias()
    rows = FinishedJob.objects.using(using).all()
    if name:
        rows = rows.filter(name=name)
    if queue:
        rows = rows.filter(queue=queue)
    if outcome:
        rows = rows.filter(outcome=outcome)
    if since is not None:
        rows = rows.filter(finished_at__gte=since)
    if until is not None:
        rows = rows.filter(finished_at__lt=until)
    if arguments:
        rows = rows.filter(argument_filter(arguments, connections[using].vendor))
    if job_id is not None:
        rows = rows.filter(job_id=job_id)
    ordered: QuerySet[FinishedJob] = rows.order_by("-finished_at", "-id")
    return ordered
