"""Insert many new jobs at once: one statement per batch.

A new job is a ``NewJob``: the values of its row, with a delay instead of
times, so the database's clock decides when it was created and when it becomes
available. On PostgreSQL a batch is one ``INSERT ... SELECT ... FROM unnest()``
of one array per column, with the same SQL text for every batch and no
expression compiled per row; the times come back with the ids. Other
databases insert ``Job`` instances with ``Job.objects.bulk_enqueue``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from datetime import datetime, timedelta
from functools import cache
from typing import Any, NamedTuple

from django.db import connections, models, transaction
from django.db.backends.base.base import BaseDatabaseWrapper

from .db import DbNow, alias
from .models import ANALYZE_AFTER, Job


class Flow(NamedTuple):
    """The flow-control columns of a job row (unique.py, concurrency.py, rates.py)."""

    unique_key: str | None = None
    unique_until_start: bool = False
    concurrency_key: str | None = None
    concurrency_limit: int | None = None
    rate_key: str | None = None
    rate_limit: str | None = None


class NewJob(NamedTuple):
    """The values of a job row about to be inserted."""

    queue: str
    name: str
    payload: str
    priority: int
    max_tries: int | None
    retry_after: int
    timeout: int | None
    # Seconds after the insert at which the job becomes available.
    delay: float
    # None: the job uses no flow control (its flow columns are NULL).
    flow: Flow | None = None

    def to_job(self) -> Job:
        """Return an unsaved ``Job`` whose times are the database's clock when it is saved."""
        now = DbNow()
        job = Job(
            queue=self.queue,
            name=self.name,
            payload=self.payload,
            priority=self.priority,
            max_tries=self.max_tries,
            retry_after=self.retry_after,
            timeout=self.timeout,
            available_at=now + timedelta(seconds=self.delay) if self.delay > 0 else now,
            created_at=now,
            **(self.flow._asdict() if self.flow else {}),
        )
        job._state.db = alias()
        return job


# The job table's columns, in the order of ``Job._meta.concrete_fields`` (the
# order ``Job.from_db`` takes values in). The unnest INSERT writes these and is
# used only while the table has exactly these.
_COLUMNS = (
    "id",
    "queue",
    "name",
    "payload",
    "priority",
    "attempts",
    "given_back",
    "cancel",
    "exceptions",
    "max_tries",
    "retry_after",
    "timeout",
    "available_at",
    "reserved_at",
    "reserved_by",
    "created_at",
    "unique_key",
    "unique_until_start",
    "concurrency_key",
    "concurrency_limit",
    "blocked",
    "rate_key",
    "rate_limit",
)
# The NewJob fields stored as they are (``delay`` becomes available_at, ``flow`` its columns).
_PER_ROW = NewJob._fields[:-2]


# Each column travels as one PostgreSQL array literal, built here: joining
# strings is several times faster than psycopg adapting a list value by value,
# which was a third of the time of a bulk enqueue.
def _text_array(values: Sequence[str]) -> str:
    """``{"a","b"}``: each element double-quoted, with its backslashes and double quotes escaped."""
    return "{" + ",".join(['"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"' for v in values]) + "}"


def _int_array(values: Sequence[int | None]) -> str:
    """``{1,NULL,2}``."""
    return "{" + ",".join(["NULL" if v is None else str(int(v)) for v in values]) + "}"


def _float_array(values: Sequence[float]) -> str:
    return "{" + ",".join([repr(float(v)) for v in values]) + "}"


def _nullable_text_array(values: Sequence[str | None]) -> str:
    return "{" + ",".join(["NULL" if v is None else _text_array([v])[1:-1] for v in values]) + "}"


def _bool_array(values: Sequence[bool]) -> str:
    return "{" + ",".join(["t" if v else "f" for v in values]) + "}"


# One per Flow field, in order.
_FLOW_ENCODERS: tuple[Callable[[Sequence[Any]], str], ...] = (
    _nullable_text_array,
    _bool_array,
    _nullable_text_array,
    _int_array,
    _nullable_text_array,
    _nullable_text_array,
)


# One per NewJob field, in order.
_ENCODERS: tuple[Callable[[Sequence[Any]], str], ...] = (
    _text_array,
    _text_array,
    _text_array,
    _int_array,
    _int_array,
    _int_array,
    _int_array,
    _float_array,
)


def insert(new_jobs: Sequence[NewJob], *, batch_size: int = 1000) -> list[Job]:
    """Insert ``new_jobs`` in one transaction, one statement per ``batch_size`` rows.

    Return the saved rows in the same order, with their ids and the times the
    database gave them (where the backend returns ids: not on MySQL).
    """
    if batch_size < 1:
        raise ValueError("batch_size must be at least 1")
    if not new_jobs:
        return []
    using = alias()
    connection = connections[using]
    if connection.vendor != "postgresql" or not _fits_table():
        return _insert_instances(new_jobs, batch_size)
    jobs: list[Job] = []
    with transaction.atomic(using=using, savepoint=False), _pipeline(connection):
        # Send every batch, then read what each returned: in pipeline mode the
        # server inserts one batch while this process encodes the next.
        sent = []
        for start in range(0, len(new_jobs), batch_size):
            batch = new_jobs[start : start + batch_size]
            cursor = connection.cursor()
            cursor.execute(*_statement(connection, batch))
            sent.append((batch, cursor))
        for batch, cursor in sent:
            with cursor:
                returned = cursor.fetchall()
            # RETURNING gives the rows in the order the SELECT read them, the
            # arrays' order (which Django's own unnest bulk_create relies on too).
            jobs += [_saved(using, new, *row) for new, row in zip(batch, returned, strict=True)]
    analyze_if_large(using, len(jobs))
    return jobs


def insert_one(new: NewJob) -> Job:
    """Insert one new job and return it saved, with its id and times.

    On PostgreSQL the batch statement with one row: one round trip, and no
    transaction of its own (one statement is atomic), so ``enqueue`` inside
    the caller's transaction still becomes visible only on its commit.
    Elsewhere ``Model.save``, which gives the id on every backend.
    """
    using = alias()
    connection = connections[using]
    if connection.vendor != "postgresql" or not _fits_table():
        from .registry import _load_database_times

        job = new.to_job()
        job.save(force_insert=True, using=using)
        _load_database_times([job])
        return job
    with connection.cursor() as cursor:
        cursor.execute(*_statement(connection, [new]))
        row = cursor.fetchone()
    return _saved(using, new, *row)


def _statement(connection: BaseDatabaseWrapper, batch: Sequence[NewJob]) -> tuple[str, list[str]]:
    """The unnest INSERT of ``batch`` and its parameters: one array per column.

    A batch in which no job uses flow control leaves the flow columns to their
    defaults (NULL), so it sends no array for them.
    """
    columns = list(zip(*batch, strict=True))  # NewJob rows to columns
    params = [encode(column) for encode, column in zip(_ENCODERS, columns, strict=False)]
    if not any(new.flow for new in batch):
        return _unnest_insert(connection), params
    flows = [new.flow or _NO_FLOW for new in batch]
    params += [encode(column) for encode, column in zip(_FLOW_ENCODERS, zip(*flows, strict=True), strict=True)]
    return _unnest_insert(connection, flow=True), params


_NO_FLOW = Flow()


def _saved(using: str, new: NewJob, pk: int, available_at: datetime, created_at: datetime) -> Job:
    values = (
        pk,
        new.queue,
        new.name,
        new.payload,
        new.priority,
        0,
        0,
        0,
        0,
        new.max_tries,
        new.retry_after,
        new.timeout,
    )
    flow = new.flow or _NO_FLOW
    unique_key, until_start, concurrency_key, concurrency_limit, rate_key, rate_limit = flow
    return Job.from_db(
        using,
        _COLUMNS,
        (
            *values,
            *(available_at, None, "", created_at),
            *(unique_key, until_start, concurrency_key, concurrency_limit, False, rate_key, rate_limit),
        ),
    )


def analyze_if_large(using: str, count: int) -> None:
    """On PostgreSQL, refresh the job table's statistics after inserting ``count`` rows, if many.

    Planned with the statistics of a nearly empty table, the claim would sort
    the whole queue instead of reading its index in order.
    """
    connection = connections[using]
    if count >= ANALYZE_AFTER and connection.vendor == "postgresql":
        with connection.cursor() as cursor:
            cursor.execute(f"ANALYZE {connection.ops.quote_name(Job._meta.db_table)}")


def _insert_instances(new_jobs: Sequence[NewJob], batch_size: int) -> list[Job]:
    from .registry import _load_database_times

    jobs = Job.objects.bulk_enqueue([new.to_job() for new in new_jobs], batch_size=batch_size)
    _load_database_times(jobs)
    return jobs


@cache
def _fits_table() -> bool:
    """Tell whether the job table has exactly the columns the unnest INSERT writes."""
    return tuple(field.attname for field in Job._meta.concrete_fields) == _COLUMNS


def _unnest_insert(connection: BaseDatabaseWrapper, *, flow: bool = False) -> str:
    """The INSERT of one batch: one array parameter per ``NewJob`` field (and per
    ``Flow`` field with ``flow``), the times from the server's clock.

    Identifiers come from the model's ``_meta``, quoted by the backend. Built
    once per backend (PostgreSQL only, today).
    """
    key = (connection.vendor, flow)
    sql = _UNNEST_INSERT.get(key)
    if sql is None:
        sql = _UNNEST_INSERT[key] = _build_unnest_insert(connection, flow)
    return sql


# The INSERT's text per database vendor, with and without the flow columns.
_UNNEST_INSERT: dict[tuple[str, bool], str] = {}


def _build_unnest_insert(connection: BaseDatabaseWrapper, flow: bool) -> str:
    quote = connection.ops.quote_name

    def column(name: str) -> str:
        db_column = _field(name).column
        assert db_column is not None
        return quote(db_column)

    def arrays(names: Sequence[str]) -> str:
        return ", ".join(f"%s::{_array_type(_field(name), connection)}[]" for name in names)

    flow_names = Flow._fields if flow else ()
    names = [
        *_PER_ROW,
        *("attempts", "given_back", "cancel", "exceptions"),
        *("reserved_at", "reserved_by", "available_at", "created_at"),
        *flow_names,
    ]
    values = [
        *(f"r.{name}" for name in _PER_ROW),
        *("0", "0", "0", "0"),
        "NULL",
        "''",
        "statement_timestamp() + make_interval(secs => r.delay)",
        "statement_timestamp()",
        *(f"r.{name}" for name in flow_names),
    ]
    flow_arrays = f", {arrays(flow_names)}" if flow else ""
    return (
        f"INSERT INTO {quote(Job._meta.db_table)} ({', '.join(column(name) for name in names)}) "
        f"SELECT {', '.join(values)} "
        f"FROM unnest({arrays(_PER_ROW)}, %s::float8[]{flow_arrays}) "
        f"AS r({', '.join([*_PER_ROW, 'delay', *flow_names])}) "
        f"RETURNING {column('id')}, {column('available_at')}, {column('created_at')}"
    )


def _field(name: str) -> models.Field[Any, Any]:
    field = Job._meta.get_field(name)
    assert isinstance(field, models.Field)
    return field


def _array_type(field: models.Field[Any, Any], connection: BaseDatabaseWrapper) -> str:
    # Text, not varchar(n): a cast to varchar(n) silently cuts a longer value,
    # where the INSERT into the column refuses it.
    if field.get_internal_type() in ("CharField", "TextField"):
        return "text"
    return str(field.cast_db_type(connection))


@contextmanager
def _pipeline(connection: BaseDatabaseWrapper) -> Iterator[None]:
    """psycopg 3's pipeline mode where libpq has it (14 or later); elsewhere nothing.

    Statements are sent without waiting for the results of the ones before.
    When the connection breaks meanwhile, the caller gets the connection's
    error: psycopg's own complaint about ending a pipeline that still waits
    for results ("cannot exit pipeline mode while busy") is not the cause, and
    is neither raised nor logged in its place.
    """
    raw = connection.connection
    if not hasattr(raw, "pipeline"):  # psycopg2
        yield
        return
    import psycopg

    if not psycopg.Pipeline.is_supported():
        yield
        return
    with connection.wrap_database_errors:
        pipeline = raw.pipeline()
        pipeline.__enter__()
        try:
            yield
        except BaseException as exc:
            with _quiet(logging.getLogger("psycopg")):
                pipeline.__exit__(type(exc), exc, exc.__traceback__)
            raise
        try:
            pipeline.__exit__(None, None, None)
        except psycopg.Error as exc:
            if raw.broken or raw.closed:
                raise psycopg.OperationalError(f"the connection to the database was lost: {exc}") from exc
            raise


@contextmanager
def _quiet(logger: logging.Logger) -> Iterator[None]:
    """Drop ``logger``'s warnings while an error that says more is on its way to the caller."""

    def drop(record: logging.LogRecord) -> bool:
        return record.levelno > logging.WARNING

    logger.addFilter(drop)
    try:
        yield
    finally:
        logger.removeFilter(drop)
