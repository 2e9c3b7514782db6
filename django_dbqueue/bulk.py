"""Insert many new jobs at once: one statement per batch.

A new job is a ``NewJob``: the values of its row, with a delay instead of
times, so the database's clock decides when it was created and when it becomes
available. On PostgreSQL a batch is one ``INSERT ... SELECT ... FROM unnest()``
of one array per column, with the same SQL text for every batch and no
expression compiled per row; the times come back with the ids. Other
databases insert ``Job`` instances with ``Job.objects.bulk_enqueue``.

A new job whose unique key (``Flow.unique_key``) another row holds is not
inserted: it comes back as ``Held``, naming that row, and the caller's
transaction goes on. The unique index decides (docs/unique.md): on PostgreSQL
the batch's INSERT has ``ON CONFLICT ... DO NOTHING``; elsewhere the INSERT
runs in a savepoint, and a conflict on that index (and only that one) is rolled
back, its holders read, and the rest inserted again. Batches without unique
keys are sent exactly as before.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from datetime import UTC, datetime, timedelta
from functools import cache
from typing import Any, NamedTuple

from django.db import DatabaseError, IntegrityError, connections, models, transaction
from django.db.backends.base.base import BaseDatabaseWrapper
from django.db.models.base import ModelState

from .db import DbNow, alias, kept_cursor
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
    # The batch the job is a member of (batches.py), or None.
    batch_id: int | None = None

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
            batch_id=self.batch_id,
            **(self.flow._asdict() if self.flow else {}),
        )
        job._state.db = alias()
        return job

    @property
    def unique_key(self) -> str | None:
        return self.flow.unique_key if self.flow else None


class Held(NamedTuple):
    """A new job that was not inserted: job ``job_id`` holds its unique key (or its
    ``unique_for`` window). ``job_id`` is None only for a window opened by a bulk
    insert on plain MySQL, which returns no ids."""

    key: str
    job_id: int | None


# The name of the unique index on ``Job.unique_key`` (migration 0008).
UNIQUE_INDEX = "dbqueue_job_unique"


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
    "batch_id",
)
# The NewJob fields stored as they are (``delay`` becomes available_at, ``flow`` its columns).
_PER_ROW = NewJob._fields[: NewJob._fields.index("delay")]

# How the unnest INSERT meets a row that holds one of its unique keys: no
# ON CONFLICT (no row of the batch has a key); DO NOTHING (the new row is left
# out of RETURNING); or, once a holder vanished between the conflict and the
# read of it, DO UPDATE ... WHERE false, which updates nothing but locks the
# holder until the transaction ends, so the read that follows finds it.
_PLAIN, _SKIP, _LOCK = "", "skip", "lock"


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


def insert(new_jobs: Sequence[NewJob], *, batch_size: int = 1000, analyze: bool = True) -> list[Job | Held]:
    """Insert ``new_jobs`` in one transaction, one statement per ``batch_size`` rows.

    Return the saved rows in the same order, with their ids and the times the
    database gave them (where the backend returns ids: not on MySQL); a job
    whose unique key is held, by an existing row or by an earlier job of
    ``new_jobs``, comes back as ``Held``. ``analyze=False`` leaves the ANALYZE of
    a large insert (``analyze_if_large``) to the caller.
    """
    if batch_size < 1:
        raise ValueError("batch_size must be at least 1")
    if not new_jobs:
        return []
    using = alias()
    connection = connections[using]
    if any(new.unique_key for new in new_jobs):
        return _insert_unique(connection, using, new_jobs, batch_size, analyze)
    if connection.vendor != "postgresql" or not _fits_table():
        return list(_insert_instances(new_jobs, batch_size))
    jobs: list[Job | Held] = []
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
    if analyze:
        analyze_if_large(using, len(jobs))
    return jobs


class Stream:
    """Batches of a stream inserted one statement ahead (PostgreSQL, inside a transaction).

    ``send`` sends a batch's unnest INSERT and returns the rows (``Row``) of the
    batch sent before it; in psycopg's pipeline mode the server inserts a batch while the
    caller prepares the next. ``flush`` returns the last batch's rows (before
    anything else runs on the connection). Elsewhere ``usable`` is False.
    """

    def __init__(self, connection: BaseDatabaseWrapper, using: str) -> None:
        self.connection = connection
        self.using = using
        self.usable = connection.vendor == "postgresql" and _fits_table()
        self._sent: tuple[Sequence[NewJob], Any] | None = None
        self._pipeline: Any = None

    def __enter__(self) -> Stream:
        return self

    def __exit__(self, kind: Any, exc: BaseException | None, traceback: Any) -> None:
        if self._pipeline is not None:
            pipeline, self._pipeline = self._pipeline, None
            pipeline.__exit__(kind, exc, traceback)

    def send(self, batch: Sequence[NewJob]) -> list[Row]:
        if self._pipeline is None:
            self._pipeline = _pipeline(self.connection)
            self._pipeline.__enter__()
        cursor = self.connection.cursor()
        cursor.execute(*_statement(self.connection, batch))
        done = self._read()
        self._sent = (batch, cursor)
        return done

    def flush(self) -> list[Row]:
        done = self._read()
        if self._pipeline is not None:
            pipeline, self._pipeline = self._pipeline, None
            pipeline.__exit__(None, None, None)
        return done

    def _read(self) -> list[Row]:
        if self._sent is None:
            return []
        batch, cursor = self._sent
        self._sent = None
        with cursor:
            returned = cursor.fetchall()
        using = self.using
        return [Row(using, new, *row) for new, row in zip(batch, returned, strict=True)]


class Row(NamedTuple):
    """A row a ``Stream`` inserted; its model instance is built only when asked for."""

    using: str
    new: NewJob
    pk: int
    available_at: datetime
    created_at: datetime

    def job(self) -> Job:
        return _saved(self.using, self.new, self.pk, self.available_at, self.created_at)


def insert_one(new: NewJob) -> Job | Held:
    """Insert one new job and return it saved, with its id and times (or ``Held``).

    On PostgreSQL ``insert_row``; elsewhere ``Model.save``, which gives the id
    on every backend.
    """
    using = alias()
    if new.unique_key:
        return _insert_unique(connections[using], using, [new], 1)[0]
    row = insert_row(new, using)
    return _save_one(new, using) if row is None else row.job()


def insert_row(new: NewJob, using: str) -> Row | None:
    """On PostgreSQL, insert one new job without a unique key and return its row,
    whose model instance is built only if asked for; elsewhere insert nothing
    and return None.

    One call of ``dbqueue_enqueue`` (migration 0011), whose INSERT the server
    keeps planned per session, which a statement sent from here cannot be with
    Django's prepared statements off: one round trip, and no transaction of its
    own (one statement is atomic), so ``enqueue`` inside the caller's
    transaction still becomes visible only on its commit. docs/performance.md
    has the figures.
    """
    connection = connections[using]
    if connection.vendor != "postgresql" or not _fits_table():
        return None
    cursor = kept_cursor(connection)
    if new.flow is None and new.batch_id is None:
        cursor.execute(_ENQUEUE_PLAIN, new[:_WITH_DELAY])
    else:
        cursor.execute(_ENQUEUE_FLOW, (*new[:_WITH_DELAY], *(new.flow or _NO_FLOW), new.batch_id))
    return Row(using, new, *cursor.fetchone())


# The function's parameters: those of ``NewJob`` up to the delay; then, if the
# job uses flow control or is in a batch, the ``Flow`` columns and the batch.
_WITH_DELAY = NewJob._fields.index("delay") + 1
_ENQUEUE_PLAIN = f"SELECT * FROM dbqueue_enqueue({', '.join(['%s'] * _WITH_DELAY)})"
_ENQUEUE_FLOW = f"SELECT * FROM dbqueue_enqueue({', '.join(['%s'] * (_WITH_DELAY + len(Flow._fields) + 1))})"


# -- rows that need not come back (``enqueue_many(..., handles=False)``) -------

# The columns of such an insert: every column but the id (the table's identity,
# or auto-increment, gives it); then those every new job starts with.
_ROW_COLUMNS = (*_PER_ROW, "available_at", "created_at", *Flow._fields, "batch_id")
_START_COLUMNS = ("attempts", "given_back", "cancel", "exceptions", "reserved_by", "blocked")


def rows_usable(connection: BaseDatabaseWrapper) -> bool:
    """Tell whether ``insert_rows`` can write to this connection's job table."""
    return _fits_table() and connection.vendor in ("postgresql", "mysql", "sqlite")


def insert_rows(connection: BaseDatabaseWrapper, new_jobs: Sequence[NewJob]) -> int:
    """Insert ``new_jobs`` (none with a unique key) and return how many; nothing comes back.

    PostgreSQL with psycopg 3: one ``COPY ... FROM STDIN`` (``copy_insert``).
    MariaDB/MySQL and SQLite: one INSERT sent with ``executemany``, which
    mysqlclient turns into one multi-row INSERT and SQLite runs as one prepared
    statement; the values are made here, with the database's clock read once
    for the batch, instead of by ``bulk_create`` (model instances, an SQL
    expression per time, a read-back of the times), four to five times as fast
    (docs/enqueue.md).
    """
    if connection.vendor == "postgresql":
        if _psycopg3(connection):
            return copy_insert(connection, new_jobs)
        return len(insert(new_jobs, batch_size=len(new_jobs), analyze=False))
    ops = connection.ops
    with connection.cursor() as cursor:
        now, created = _clock(cursor, connection)
        rows = []
        for new in new_jobs:
            available = created if new.delay <= 0 else ops.adapt_datetimefield_value(now + timedelta(seconds=new.delay))
            flow = new.flow or _NO_FLOW
            rows.append((*new[: len(_PER_ROW)], available, created, *flow, new.batch_id, 0, 0, 0, 0, "", False))
        cursor.executemany(_values_insert(connection), rows)
    return len(new_jobs)


def _psycopg3(connection: BaseDatabaseWrapper) -> bool:
    from django.db.backends.postgresql.psycopg_any import is_psycopg3

    return bool(is_psycopg3)


def _clock(cursor: Any, connection: BaseDatabaseWrapper) -> tuple[datetime, Any]:
    """The database's clock now (``db.DbNow``'s reading): as an aware UTC datetime, and as
    the value to store for it.

    SQLite compares times as text and its clock has milliseconds ("…:05.123"): stored
    as Django writes a datetime ("…:05.123000"), a job would sort after that clock
    reading and not be available before the next millisecond. So the reading's own
    text is stored.
    """
    if connection.vendor == "mysql":
        cursor.execute("SELECT UTC_TIMESTAMP(6)")
        (value,) = cursor.fetchone()
        clock: datetime = value.replace(tzinfo=UTC)
        return clock, connection.ops.adapt_datetimefield_value(clock)
    cursor.execute("SELECT STRFTIME('%Y-%m-%d %H:%M:%f', 'NOW')")
    (text,) = cursor.fetchone()
    return datetime.fromisoformat(text).replace(tzinfo=UTC), text


def _values_insert(connection: BaseDatabaseWrapper) -> str:
    sql = _VALUES_INSERT.get(connection.vendor)
    if sql is None:
        quote = connection.ops.quote_name
        names = [*_ROW_COLUMNS, *_START_COLUMNS]
        columns = ", ".join(quote(_field(name).column or name) for name in names)
        marks = ", ".join(["%s"] * len(names))
        table = quote(Job._meta.db_table)
        sql = _VALUES_INSERT[connection.vendor] = f"INSERT INTO {table} ({columns}) VALUES ({marks})"
    return sql


_VALUES_INSERT: dict[str, str] = {}


def copy_insert(connection: BaseDatabaseWrapper, new_jobs: Sequence[NewJob]) -> int:
    """Insert ``new_jobs`` with one ``COPY ... FROM STDIN`` and return how many; nothing comes back.

    COPY takes rows about a fifth faster than the unnest INSERT (docs/enqueue.md)
    and returns no ids. The times are the
    database's clock, read once (``statement_timestamp()``) for the whole batch;
    the ids come from the table's identity. The enqueue trigger's NOTIFY fires
    once for the statement, as for an INSERT. Rows with unique keys are not sent
    here (a COPY cannot skip a held key): ``enqueue_many`` inserts them.
    """
    with connection.cursor() as cursor:
        cursor.execute("SELECT statement_timestamp()")
        (now,) = cursor.fetchone()
        lines = _copy_lines(new_jobs, now)
        with connection.wrap_database_errors, cursor.cursor.copy(_copy_statement(connection)) as copy:
            copy.write(lines)
    return len(new_jobs)


def _copy_lines(new_jobs: Sequence[NewJob], now: datetime) -> str:
    """COPY's text format: one line per row, tab-separated, ``\\N`` for NULL, backslashes escaped."""
    created = now.isoformat()
    flows: dict[Flow | None, str] = {}
    lines = []
    for new in new_jobs:
        flow = flows.get(new.flow)
        if flow is None:
            flow = flows[new.flow] = "\t".join(_copy_value(value) for value in (new.flow or _NO_FLOW))
        available = created if new.delay <= 0 else (now + timedelta(seconds=new.delay)).isoformat()
        payload = new.payload
        if "\\" in payload or "\n" in payload or "\r" in payload or "\t" in payload:
            payload = _copy_text(payload)
        lines.append(
            f"{_copy_text(new.queue)}\t{_copy_text(new.name)}\t{payload}\t{int(new.priority)}\t"
            f"{_copy_value(new.max_tries)}\t{int(new.retry_after)}\t{_copy_value(new.timeout)}\t"
            f"{available}\t{created}\t{flow}\t{_copy_value(new.batch_id)}{_COPY_FIXED}"
        )
    return "".join(lines)


def _copy_text(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace("\r", "\\r").replace("\t", "\\t")


def _copy_value(value: Any) -> str:
    if value is None:
        return "\\N"
    if isinstance(value, bool):
        return "t" if value else "f"
    if isinstance(value, int):
        return str(value)
    return _copy_text(str(value))


def _copy_statement(connection: BaseDatabaseWrapper) -> str:
    """The COPY of ``_copy_lines``: the row's own columns, then those every new job starts with
    (``_START_COLUMNS``, whose values ``_COPY_FIXED`` gives: these columns have no database default)."""
    quote = connection.ops.quote_name
    names = [*_ROW_COLUMNS, *_START_COLUMNS]
    columns = ", ".join(quote(_field(name).column or name) for name in names)
    return f"COPY {quote(Job._meta.db_table)} ({columns}) FROM STDIN"


# The values of attempts, given_back, cancel, exceptions, reserved_by and blocked in a new row.
_COPY_FIXED = "\t0\t0\t0\t0\t\tf\n"


def _save_one(new: NewJob, using: str) -> Job:
    from .registry import _load_database_times

    job = new.to_job()
    job.save(force_insert=True, using=using)
    _load_database_times([job])
    return job


# -- unique keys -------------------------------------------------------------


def _insert_unique(
    connection: BaseDatabaseWrapper, using: str, new_jobs: Sequence[NewJob], batch_size: int, analyze: bool = True
) -> list[Job | Held]:
    """``insert`` for jobs some of which have unique keys: the first job of each key
    is inserted unless a row holds the key; the others come back ``Held``."""
    keys = [new.unique_key for new in new_jobs]
    results: list[Job | Held | None] = [None] * len(new_jobs)
    pending = _first_of_each_key(keys)
    if connection.vendor == "postgresql" and _fits_table():
        if len(new_jobs) == 1:
            # One statement, atomic by itself: no transaction of its own, as ``insert_one``.
            _insert_unique_postgresql(connection, using, new_jobs, pending, batch_size, results)
        else:
            with transaction.atomic(using=using, savepoint=False):
                _insert_unique_postgresql(connection, using, new_jobs, pending, batch_size, results)
    else:
        _insert_unique_savepoints(connection, using, new_jobs, keys, pending, batch_size, results)
    outcomes = _with_later_calls(keys, results)
    if analyze:
        analyze_if_large(using, sum(isinstance(outcome, Job) for outcome in outcomes))
    return outcomes


def _first_of_each_key(keys: Sequence[str | None]) -> list[int]:
    """The indexes of the jobs to insert: those without a key, and the first of each key."""
    seen: set[str] = set()
    pending = []
    for index, key in enumerate(keys):
        if key is None or key not in seen:
            pending.append(index)
            if key is not None:
                seen.add(key)
    return pending


def _with_later_calls(keys: Sequence[str | None], results: list[Job | Held | None]) -> list[Job | Held]:
    """The outcomes, a later job of a key sharing the fate of the first (``Held`` by its row or its holder)."""
    first: dict[str, Job | Held] = {}
    outcomes: list[Job | Held] = []
    for key, outcome in zip(keys, results, strict=True):
        if outcome is None:
            assert key is not None
            earlier = first[key]
            outcome = Held(key, earlier.pk if isinstance(earlier, Job) else earlier.job_id)
        elif key is not None:
            first.setdefault(key, outcome)
        outcomes.append(outcome)
    return outcomes


def _insert_unique_postgresql(
    connection: BaseDatabaseWrapper,
    using: str,
    new_jobs: Sequence[NewJob],
    pending: list[int],
    batch_size: int,
    results: list[Job | Held | None],
) -> None:
    keys = [new.unique_key for new in new_jobs]
    pending = _insert_round(connection, using, new_jobs, pending, batch_size, _SKIP, results)
    pending = _mark_held(using, keys, pending, results)
    if not pending:
        return
    # A holder finished between the conflict and the read of it: its key may be
    # free now. Insert again, locking whatever holds the key this time.
    with transaction.atomic(using=using, savepoint=False):
        pending = _insert_round(connection, using, new_jobs, pending, batch_size, _LOCK, results)
        pending = _mark_held(using, keys, pending, results)
    if pending:
        raise RuntimeError(
            f"unique key {keys[pending[0]]!r} was held by a row that could not be read; "
            "is the transaction's isolation level READ COMMITTED?"
        )


def _insert_round(
    connection: BaseDatabaseWrapper,
    using: str,
    new_jobs: Sequence[NewJob],
    pending: list[int],
    batch_size: int,
    conflict: str,
    results: list[Job | Held | None],
) -> list[int]:
    """Insert the jobs at ``pending`` (distinct keys) with ``conflict``; fill in the
    rows inserted and return the indexes of the jobs left out."""
    batches = [pending[start : start + batch_size] for start in range(0, len(pending), batch_size)]
    with _pipeline(connection) if len(batches) > 1 else _nothing():
        sent = []
        for batch in batches:
            cursor = connection.cursor()
            cursor.execute(*_statement(connection, [new_jobs[index] for index in batch], conflict))
            sent.append((batch, cursor))
        for batch, cursor in sent:
            with cursor:
                returned = cursor.fetchall()
            # Rows with a key are found by it (a left-out row returns nothing);
            # the others come back in the arrays' order.
            keyed = {row[3]: row for row in returned if row[3] is not None}
            plain = iter([row for row in returned if row[3] is None])
            for index in batch:
                new = new_jobs[index]
                row = keyed.get(new.unique_key) if new.unique_key else next(plain)
                if row is not None:
                    results[index] = _saved(using, new, *row[:3])
    return [index for index in pending if results[index] is None]


def _insert_unique_savepoints(
    connection: BaseDatabaseWrapper,
    using: str,
    new_jobs: Sequence[NewJob],
    keys: Sequence[str | None],
    pending: list[int],
    batch_size: int,
    results: list[Job | Held | None],
) -> None:
    """Insert the jobs at ``pending`` in a savepoint (one statement per batch); after
    a conflict on the unique index, read the holders of the keys and insert the rest again.

    The holder of a conflicting key cannot vanish before it is read: InnoDB keeps
    a shared lock on the index entry that conflicted, SQLite the write lock, until
    the transaction ends. So each round that fails finds at least one holder.

    InnoDB's lock covers the gap before that entry too, and every job row, keyed
    or not, has an entry in the index (NULLs included) that may fall in such a
    gap: two enqueues holding such locks that insert more rows deadlock. So on
    MariaDB/MySQL the keys held by committed rows are read first and left out,
    and in a transaction of its own a conflict ends the transaction (nothing was
    written yet), with its locks, before the next round.
    """
    from .registry import _load_database_times

    mysql = connection.vendor == "mysql"
    restart = mysql and not connection.in_atomic_block
    error: IntegrityError | None = None
    rounds = len(pending) + 2
    while rounds:
        with transaction.atomic(using=using):
            if mysql:
                pending = _mark_held(using, keys, pending, results)
            while pending and rounds:
                rounds -= 1
                # Rows built anew each round: a batch inserted before a later one failed has ids and times.
                batch = [new_jobs[index].to_job() for index in pending]
                try:
                    with transaction.atomic(using=using):
                        if len(batch) == 1:
                            # Model.save gives the id on every backend (plain MySQL's bulk insert does not).
                            batch[0].save(force_insert=True, using=using)
                            saved = batch
                        else:
                            # bulk_create, not bulk_enqueue: that one leaves out held rows without saying which.
                            saved = Job.objects.db_manager(using).bulk_create(batch, batch_size=batch_size)
                except IntegrityError as exc:
                    if not holds_unique_key(exc, connection):
                        raise
                    error = exc
                    if restart:
                        transaction.set_rollback(True, using=using)
                        break
                    left = _mark_held(using, keys, pending, results)
                    if left == pending:
                        # Read with a lock: a consistent read under REPEATABLE READ may not see the holder yet.
                        left = _mark_held(using, keys, pending, results, lock=True)
                    pending = left
                    continue
                _load_database_times(saved)
                for index, job in zip(pending, saved, strict=True):
                    results[index] = job
                return
            if not pending:
                return
    assert error is not None
    raise error


def _mark_held(
    using: str,
    keys: Sequence[str | None],
    pending: list[int],
    results: list[Job | Held | None],
    *,
    lock: bool = False,
) -> list[int]:
    """Mark the jobs at ``pending`` whose keys a row holds now as ``Held``; return the others."""
    holders = unique_key_holders(
        using, [key for key in (keys[index] for index in pending) if key is not None], lock=lock
    )
    left = []
    for index in pending:
        key = keys[index]
        if key is not None and key in holders:
            results[index] = Held(key, holders[key])
        else:
            left.append(index)
    return left


def unique_key_holders(using: str, keys: Sequence[str], *, lock: bool = False) -> dict[str, int]:
    """The ids of the rows that hold ``keys`` now, by key (``lock``: locked until the transaction ends)."""
    found: dict[str, int] = {}
    for start in range(0, len(keys), 500):
        queryset = Job.objects.db_manager(using).filter(unique_key__in=keys[start : start + 500]).order_by()
        if lock:
            queryset = queryset.select_for_update()
        found.update((key, pk) for key, pk in queryset.values_list("unique_key", "pk") if key is not None)
    return found


def is_deadlock(exc: DatabaseError, connection: BaseDatabaseWrapper) -> bool:
    """Tell whether the database ended the transaction to break a deadlock (it may be run again)."""
    cause = exc.__cause__
    if connection.vendor == "postgresql":
        return (getattr(cause, "sqlstate", None) or getattr(cause, "pgcode", None)) == "40P01"
    if connection.vendor == "mysql":
        return bool(cause is not None and cause.args and cause.args[0] == 1213)
    return False


def holds_unique_key(exc: IntegrityError, connection: BaseDatabaseWrapper) -> bool:
    """Tell whether ``exc`` is a conflict on the unique index of ``Job.unique_key``, and no other."""
    cause = exc.__cause__
    if connection.vendor == "postgresql":
        return getattr(getattr(cause, "diag", None), "constraint_name", None) == UNIQUE_INDEX
    if connection.vendor == "mysql":
        # (1062, "Duplicate entry '...' for key 'dbqueue_job_unique'"); MySQL 8: 'dbqueue_job.dbqueue_job_unique'.
        args = cause.args if cause is not None else ()
        if len(args) < 2 or args[0] != 1062:
            return False
        text = str(args[1]).rstrip()
        return text.endswith((f"'{UNIQUE_INDEX}'", f".{UNIQUE_INDEX}'"))
    if connection.vendor == "sqlite":
        column = _field("unique_key").column
        return str(exc) == f"UNIQUE constraint failed: {Job._meta.db_table}.{column}"
    return False


@contextmanager
def _nothing() -> Iterator[None]:
    yield


def _statement(
    connection: BaseDatabaseWrapper, batch: Sequence[NewJob], conflict: str = _PLAIN
) -> tuple[str, list[str]]:
    """The unnest INSERT of ``batch`` and its parameters: one array per column.

    A batch in which no job uses flow control leaves the flow columns to their
    defaults (NULL), so it sends no array for them. With ``conflict`` (``_SKIP``,
    ``_LOCK``) a row whose unique key is held is left out, and RETURNING gives
    each row's key too.
    """
    columns = list(zip(*batch, strict=True))  # NewJob rows to columns
    params = [encode(column) for encode, column in zip(_ENCODERS, columns, strict=False)]
    members = any(new.batch_id for new in batch)
    if members:
        params.append(_int_array([new.batch_id for new in batch]))
    if not conflict and not any(new.flow for new in batch):
        return _unnest_insert(connection, batch=members), params
    flows = [new.flow or _NO_FLOW for new in batch]
    params += [encode(column) for encode, column in zip(_FLOW_ENCODERS, zip(*flows, strict=True), strict=True)]
    return _unnest_insert(connection, flow=True, conflict=conflict, batch=members), params


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
    return _loaded(
        using,
        (
            *values,
            *(available_at, None, "", created_at),
            *(unique_key, until_start, concurrency_key, concurrency_limit, False, rate_key, rate_limit),
            new.batch_id,
        ),
    )


def _loaded(using: str, values: tuple[Any, ...]) -> Job:
    """``Job.from_db(using, _COLUMNS, values)``, in a fifth of its time.

    ``Model.__init__`` matches each value to its field through the field's
    descriptors, most of the cost of returning the rows of a bulk enqueue; the
    values here are already the attributes, in the order of ``_COLUMNS``. With a
    ``pre_init`` or ``post_init`` receiver on ``Job``, ``from_db`` runs as usual.
    """
    if models.signals.pre_init.has_listeners(Job) or models.signals.post_init.has_listeners(Job):
        return Job.from_db(using, _COLUMNS, values)
    job = Job.__new__(Job)
    job.__dict__.update(zip(_COLUMNS, values, strict=True))
    state = job._state = ModelState()
    state.adding = False
    state.db = using
    return job


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

    using = alias()
    connection = connections[using]
    if (
        connection.vendor in ("mysql", "sqlite")
        and _fits_table()
        and connection.features.can_return_rows_from_bulk_insert
    ):
        return _insert_returning(connection, using, new_jobs, batch_size)

    jobs = Job.objects.bulk_enqueue([new.to_job() for new in new_jobs], batch_size=batch_size)
    _load_database_times(jobs)
    return jobs


def _insert_returning(
    connection: BaseDatabaseWrapper, using: str, new_jobs: Sequence[NewJob], batch_size: int
) -> list[Job]:
    """SQLite and MariaDB: one multi-row ``INSERT ... RETURNING id`` per batch, in one transaction.

    The values are made here, as in ``insert_rows``, with the database's clock
    read once; ``bulk_create`` built a model instance and an SQL expression per
    row and read the times back after (docs/enqueue.md has both rates).
    """
    ops = connection.ops
    names = [*_ROW_COLUMNS, *_START_COLUMNS]
    limit = _max_params(connection)
    per_statement = max(1, min(batch_size, limit // len(names))) if limit else batch_size
    quote = ops.quote_name
    head = (
        f"INSERT INTO {quote(Job._meta.db_table)} "
        f"({', '.join(quote(_field(name).column or name) for name in names)}) VALUES "
    )
    row_marks = "(" + ", ".join(["%s"] * len(names)) + ")"
    returning = f" RETURNING {quote(_field('id').column or 'id')}"
    jobs: list[Job] = []
    with transaction.atomic(using=using, savepoint=False), connection.cursor() as cursor:
        now, created = _clock(cursor, connection)
        for start in range(0, len(new_jobs), per_statement):
            batch = new_jobs[start : start + per_statement]
            params: list[Any] = []
            times = []
            for new in batch:
                available = now if new.delay <= 0 else now + timedelta(seconds=new.delay)
                times.append(available)
                stored = created if available is now else ops.adapt_datetimefield_value(available)
                params += (*new[: len(_PER_ROW)], stored, created, *(new.flow or _NO_FLOW), new.batch_id)
                params += (0, 0, 0, 0, "", False)
            cursor.execute(head + ", ".join([row_marks] * len(batch)) + returning, params)
            ids = [row[0] for row in cursor.fetchall()]
            jobs += [
                _saved(using, new, pk, available, now) for new, pk, available in zip(batch, ids, times, strict=True)
            ]
    return jobs


def _max_params(connection: BaseDatabaseWrapper) -> int | None:
    """How many parameters one statement may have (None: no limit but the packet size).

    SQLite's is the connection's own (32,766 since 3.32); Django 5.2 assumes the
    oldest default, 999, which would split a batch of 1,000 jobs into 44 statements.
    """
    if connection.vendor == "sqlite":
        import sqlite3

        connection.ensure_connection()
        return int(connection.connection.getlimit(sqlite3.SQLITE_LIMIT_VARIABLE_NUMBER))
    limit = connection.features.max_query_params
    return None if limit is None else int(limit)


@cache
def _fits_table() -> bool:
    """Tell whether the job table has exactly the columns the unnest INSERT writes."""
    return tuple(field.attname for field in Job._meta.concrete_fields) == _COLUMNS


def _unnest_insert(
    connection: BaseDatabaseWrapper, *, flow: bool = False, conflict: str = _PLAIN, batch: bool = False
) -> str:
    """The INSERT of one batch: one array parameter per ``NewJob`` field (and per
    ``Flow`` field with ``flow``), the times from the server's clock.

    Identifiers come from the model's ``_meta``, quoted by the backend. Built
    once per backend (PostgreSQL only, today).
    """
    key = (connection.vendor, flow, conflict, batch)
    sql = _UNNEST_INSERT.get(key)
    if sql is None:
        sql = _UNNEST_INSERT[key] = _build_unnest_insert(connection, flow, conflict, batch)
    return sql


# The INSERT's text per database vendor, with and without the flow columns, per
# conflict handling, with and without the batch column.
_UNNEST_INSERT: dict[tuple[str, bool, str, bool], str] = {}


def _build_unnest_insert(
    connection: BaseDatabaseWrapper, flow: bool, conflict: str = _PLAIN, batch: bool = False
) -> str:
    quote = connection.ops.quote_name

    def column(name: str) -> str:
        db_column = _field(name).column
        assert db_column is not None
        return quote(db_column)

    def arrays(names: Sequence[str]) -> str:
        return ", ".join(f"%s::{_array_type(_field(name), connection)}[]" for name in names)

    # The batch column's array comes right after the delays (see ``_statement``), then the flow columns'.
    flow_names: tuple[str, ...] = (*(("batch_id",) if batch else ()), *(Flow._fields if flow else ()))
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
    flow_arrays = f", {arrays(flow_names)}" if flow_names else ""
    returning = f"RETURNING {column('id')}, {column('available_at')}, {column('created_at')}"
    on_conflict = ""
    if conflict:
        key = column("unique_key")
        # The target names the partial unique index (migration 0008) by its column and predicate.
        on_conflict = f"ON CONFLICT ({key}) WHERE {key} IS NOT NULL " + (
            "DO NOTHING " if conflict == _SKIP else f"DO UPDATE SET {key} = EXCLUDED.{key} WHERE false "
        )
        returning += f", {key}"
    return (
        f"INSERT INTO {quote(Job._meta.db_table)} ({', '.join(column(name) for name in names)}) "
        f"SELECT {', '.join(values)} "
        f"FROM unnest({arrays(_PER_ROW)}, %s::float8[]{flow_arrays}) "
        f"AS r({', '.join([*_PER_ROW, 'delay', *flow_names])}) "
        f"{on_conflict}{returning}"
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
