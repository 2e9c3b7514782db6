"""Every INSERT of job rows (``rows.NewJob``; times from the database's clock, columns from ``Job._meta``).

PostgreSQL: ``INSERT ... SELECT ... FROM unnest()`` of one array per column (``unnest``): one
statement in autocommit for one batch, pipeline mode for a stream of batches; one job through
``dbqueue_enqueue`` (migration 0011). Elsewhere one multi-row ``INSERT ... VALUES``,
``executemany`` for rows not read back (docs/performance.md). A job whose
unique key a row holds comes back ``Held``: the unique index decides (``ON CONFLICT DO NOTHING``
on PostgreSQL, elsewhere a savepoint). The objects among a job's arguments are recorded with it
(``refer``, one more INSERT in its transaction, only for jobs that hold a model instance: about.py).
"""

from __future__ import annotations

import logging
import sqlite3
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, nullcontext
from datetime import UTC, datetime, timedelta
from typing import Any, NamedTuple

from django.db import DatabaseError, IntegrityError, connections, transaction
from django.db.backends.base.base import BaseDatabaseWrapper

from .db import alias, cached_sql, kept_cursor
from .models import ANALYZE_AFTER, UNIQUE_INDEX, Job, JobReference, check_rows
from .payload import MODEL_TEXT, references
from .rows import COLUMNS, FIELDS, NO_FLOW, PK, Flow, NewJob, row_values, saved_job
from .unnest import LOCK, SKIP, column, unnest_insert

logger = logging.getLogger("django_dbqueue")


class Held(NamedTuple):
    """A new job not inserted: job ``job_id`` holds its key or window (None: plain MySQL's bulk insert)."""

    key: str
    job_id: int | None


class Row(NamedTuple):
    """A row inserted on PostgreSQL; its model instance is built only when asked for."""

    using: str
    new: NewJob
    pk: int
    available_at: datetime
    created_at: datetime

    def job(self) -> Job:
        return saved_job(self.using, self.new, self.pk, self.available_at, self.created_at)

    @property
    def payload(self) -> str:
        return self.new.payload


def analyze_if_large(using: str, count: int) -> None:
    """On PostgreSQL, ANALYZE the job table after inserting many rows into a table its statistics
    call smaller than them (else the claim may sort the queue); a table the statistics already
    call as large keeps them (ANALYZE samples 30,000 rows: tens of ms a call, docs/performance.md)."""
    connection = connections[using]
    if count >= ANALYZE_AFTER and connection.vendor == "postgresql":
        table = connection.ops.quote_name(Job._meta.db_table)
        with connection.cursor() as cursor:
            cursor.execute("SELECT reltuples FROM pg_class WHERE oid = %s::regclass", [table])
            (counted,) = cursor.fetchone()
            if counted < count:  # -1: never analyzed
                cursor.execute(f"ANALYZE {table}")


def insert_many(new_jobs: Sequence[NewJob], *, batch_size: int = 1000, analyze: bool = True) -> list[Job | Held]:
    """Insert ``new_jobs`` in one transaction, ``batch_size`` rows per statement; return the saved rows
    (ids not on plain MySQL), or ``Held`` for a job whose key a row or an earlier job holds."""
    if batch_size < 1:
        raise ValueError("batch_size must be at least 1")
    if not new_jobs:
        return []
    using = alias()
    connection = connections[using]
    if any(new.unique_key for new in new_jobs):
        return _insert_unique(connection, using, new_jobs, batch_size, analyze)
    jobs: list[Job | Held] = []
    if connection.vendor == "postgresql" and len(new_jobs) <= batch_size:
        jobs += [row.job() for row in insert_batch(connection, using, new_jobs)]
    else:
        with transaction.atomic(using=using, savepoint=False):
            if connection.vendor == "postgresql":
                with Stream(connection, using) as stream:
                    for start in range(0, len(new_jobs), batch_size):
                        jobs += [row.job() for row in stream.send(new_jobs[start : start + batch_size])]
                    jobs += [row.job() for row in stream.flush()]
            else:
                jobs += _insert_values(connection, using, new_jobs, batch_size)
    if analyze:
        analyze_if_large(using, len(jobs))
    return jobs


def insert_batch(connection: BaseDatabaseWrapper, using: str, batch: Sequence[NewJob]) -> list[Row]:
    """One INSERT of ``batch`` (PostgreSQL, no unique keys), its rows returned: a transaction of its
    own, no BEGIN, COMMIT or pipeline sync to wait for, unless its references add a statement."""
    with transaction.atomic(using=using, savepoint=False) if _refers(batch) else nullcontext():
        with connection.cursor() as cursor:
            cursor.execute(*unnest_insert(connection, batch))
            rows = _rows(using, batch, cursor.fetchall())
        refer(using, rows)
    return rows


def _refers(new_jobs: Sequence[NewJob]) -> bool:
    """Whether a job among ``new_jobs`` holds a model instance, whose references ``refer`` inserts."""
    return any(MODEL_TEXT in new.payload for new in new_jobs)


def _rows(using: str, batch: Sequence[NewJob], returned: Sequence[tuple[Any, ...]]) -> list[Row]:
    # RETURNING follows the arrays' order (as Django's own unnest bulk_create relies on).
    return [Row(using, new, *row) for new, row in zip(batch, returned, strict=True)]


def insert_one(new: NewJob) -> Job | Held:
    """Insert one new job and return it saved, with its id and times (or ``Held``)."""
    row = None if new.unique_key else insert_row(new, alias())
    return row.job() if row else insert_many([new])[0]


def insert_row(new: NewJob, using: str) -> Row | None:
    """On PostgreSQL, insert one job without a unique key through ``dbqueue_enqueue`` (planned once
    per session, unlike a statement sent from here) and return its row; elsewhere None."""
    connection = connections[using]
    if connection.vendor != "postgresql":
        return None
    cursor = kept_cursor(connection)
    params: tuple[Any, ...]
    if new.flow is None and new.batch_id is None:
        sql, params = _ENQUEUE_PLAIN, new[:_WITH_DELAY]
    else:
        sql, params = _ENQUEUE_FLOW, (*new[:_WITH_DELAY], *(new.flow or NO_FLOW), new.batch_id)
    refs = references(new.payload) if MODEL_TEXT in new.payload else None
    if refs:
        # The objects among its arguments, inserted by the same statement: in its transaction.
        sql, params = _WITH_REFERENCES.format(job=sql), (*params, refs)
    cursor.execute(sql, params)
    return Row(using, new, *cursor.fetchone())


# The function's parameters: ``NewJob``'s up to the delay, then maybe the ``Flow`` columns and the batch.
_WITH_DELAY = NewJob._fields.index("delay") + 1
_ENQUEUE_PLAIN = f"SELECT * FROM dbqueue_enqueue({', '.join(['%s'] * _WITH_DELAY)})"
_ENQUEUE_FLOW = f"SELECT * FROM dbqueue_enqueue({', '.join(['%s'] * (_WITH_DELAY + len(Flow._fields) + 1))})"
_REFERENCES = f"{JobReference._meta.db_table} (job_id, ref)"
# One job and its references (``refer``), in one statement: the job's function, then the INSERT of its id.
_WITH_REFERENCES = (
    f"WITH job AS ({{job}}), r AS (INSERT INTO {_REFERENCES} SELECT new_id, unnest(%s::text[]) FROM job) "
    "SELECT * FROM job"
)


class Stream:
    """Batches inserted one statement ahead in pipeline mode (PostgreSQL, in a transaction): ``send``
    returns the rows of the batch sent before, ``flush`` the last batch's."""

    def __init__(self, connection: BaseDatabaseWrapper, using: str) -> None:
        self.connection, self.using, self.usable = connection, using, connection.vendor == "postgresql"
        self._sent: tuple[Sequence[NewJob], Any] | None = None
        self._pipeline: Any = None

    def __enter__(self) -> Stream:
        return self

    def __exit__(self, *exc_info: Any) -> None:
        pipeline, self._pipeline = self._pipeline, None
        if pipeline is not None:
            pipeline.__exit__(*exc_info)

    def send(self, batch: Sequence[NewJob]) -> list[Row]:
        if self._pipeline is None:
            self._pipeline = _pipeline(self.connection)
            self._pipeline.__enter__()
        cursor = self.connection.cursor()
        cursor.execute(*unnest_insert(self.connection, batch))
        done = self._read()
        self._sent = (batch, cursor)
        return done

    def flush(self) -> list[Row]:
        done = self._read()
        self.__exit__(None, None, None)
        return done

    def _read(self) -> list[Row]:
        if self._sent is None:
            return []
        batch, cursor = self._sent
        self._sent = None
        with cursor:
            rows = _rows(self.using, batch, cursor.fetchall())
        refer(self.using, rows)
        return rows


def insert_rows(connection: BaseDatabaseWrapper, new_jobs: Sequence[NewJob]) -> int:
    """Insert ``new_jobs`` (none with a unique key) on SQLite or MariaDB/MySQL and return how many:
    ``executemany``, which SQLite prepares once and mysqlclient sends as one multi-row INSERT.
    (PostgreSQL sends such rows through ``Stream``: COPY lost to it, docs/performance.md.)"""
    if _refers(new_jobs):
        # Their references need their ids, which this INSERT does not read back.
        return len(_insert_values(connection, connection.alias, new_jobs, len(new_jobs)))
    with connection.cursor() as cursor:
        now, created = _clock(cursor, connection)
        adapt = connection.ops.adapt_datetimefield_value
        rows = [
            row_values(new, adapt(now + timedelta(seconds=new.delay)) if new.delay > 0 else created, created)
            for new in new_jobs
        ]
        cursor.executemany(f"INSERT INTO {_table(connection)} VALUES {_ROW_MARKS}", rows)
    return len(new_jobs)


@cached_sql
def _table(connection: BaseDatabaseWrapper) -> str:
    columns = ", ".join(column(connection, name) for name in COLUMNS)
    return f"{connection.ops.quote_name(Job._meta.db_table)} ({columns})"


def _insert_values(
    connection: BaseDatabaseWrapper, using: str, new_jobs: Sequence[NewJob], batch_size: int
) -> list[Job]:
    """One ``INSERT ... VALUES`` of many rows per batch (``RETURNING id`` where there is)."""
    limit = _max_params(connection)
    per_statement = max(1, min(batch_size, limit // len(COLUMNS))) if limit else batch_size
    ids_back = connection.features.can_return_rows_from_bulk_insert
    head = f"INSERT INTO {_table(connection)} VALUES "
    jobs: list[Job] = []
    with transaction.atomic(using=using, savepoint=False), connection.cursor() as cursor:
        now, created = _clock(cursor, connection)
        for start in range(0, len(new_jobs), per_statement):
            batch = new_jobs[start : start + per_statement]
            times = [now if new.delay <= 0 else now + timedelta(seconds=new.delay) for new in batch]
            adapt = connection.ops.adapt_datetimefield_value
            params: list[Any] = []
            for new, at in zip(batch, times, strict=True):
                params += row_values(new, created if at is now else adapt(at), created)
            sql = head + ", ".join([_ROW_MARKS] * len(batch))
            if ids_back:
                cursor.execute(f"{sql} RETURNING {column(connection, PK)}", params)
                ids: list[int | None] = [row[0] for row in cursor.fetchall()]
            else:
                cursor.execute(sql, params)
                # One row: its id is the connection's last one (plain MySQL); many: unknown there.
                ids = [cursor.lastrowid] if len(batch) == 1 else [None] * len(batch)
            jobs += [saved_job(using, new, pk, at, now) for new, pk, at in zip(batch, ids, times, strict=True)]
        refer(using, jobs)
    return jobs


_ROW_MARKS = "(" + ", ".join(["%s"] * len(COLUMNS)) + ")"


def _clock(cursor: Any, connection: BaseDatabaseWrapper) -> tuple[datetime, Any]:
    """The database's clock, as an aware UTC datetime and as stored: on SQLite its own text, which
    times compare as (Django's "…:05.123000" would wait for the next millisecond)."""
    if connection.vendor == "mysql":
        cursor.execute("SELECT UTC_TIMESTAMP(6)")
        (value,) = cursor.fetchone()
        clock: datetime = value.replace(tzinfo=UTC)
        return clock, connection.ops.adapt_datetimefield_value(clock)
    cursor.execute("SELECT STRFTIME('%Y-%m-%d %H:%M:%f', 'NOW')")
    (text,) = cursor.fetchone()
    return datetime.fromisoformat(text).replace(tzinfo=UTC), text


def _max_params(connection: BaseDatabaseWrapper) -> int | None:
    """How many parameters one statement may have (None: no limit); SQLite's from the connection."""
    if connection.vendor == "sqlite":
        connection.ensure_connection()
        return int(connection.connection.getlimit(sqlite3.SQLITE_LIMIT_VARIABLE_NUMBER))
    limit = connection.features.max_query_params
    return None if limit is None else int(limit)


def _insert_unique(
    connection: BaseDatabaseWrapper, using: str, new_jobs: Sequence[NewJob], batch_size: int, analyze: bool = True
) -> list[Job | Held]:
    """``insert_many`` of jobs with keys: the first of each key unless a row holds it; the others ``Held``."""
    todo = _Unique(connection, using, new_jobs, batch_size)
    if connection.vendor != "postgresql":
        todo.savepoints()
    elif len(new_jobs) == 1 and MODEL_TEXT not in new_jobs[0].payload:
        todo.on_conflict()  # one statement, atomic by itself (no references to record with it)
    else:
        with transaction.atomic(using=using, savepoint=False):
            todo.on_conflict()
    outcomes = first_holds(todo.keys, todo.results)
    if analyze:
        analyze_if_large(using, sum(isinstance(outcome, Job) for outcome in outcomes))
    return outcomes


def first_holds(keys: Sequence[str | None], results: Sequence[Job | Held | None]) -> list[Job | Held]:
    """``results`` with each None (a later job of a key) the ``Held`` of the key's first outcome."""
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


class _Unique:
    """One insert with unique keys: ``pending``, the jobs still to insert; ``results``, the outcomes."""

    def __init__(self, connection: BaseDatabaseWrapper, using: str, new_jobs: Sequence[NewJob], size: int) -> None:
        self.connection, self.using, self.new_jobs, self.size = connection, using, new_jobs, size
        self.keys = [new.unique_key for new in new_jobs]
        self.results: list[Job | Held | None] = [None] * len(new_jobs)
        first = {key: index for index, key in reversed(list(enumerate(self.keys)))}
        self.pending = [index for index, key in enumerate(self.keys) if key is None or first[key] == index]

    def on_conflict(self) -> None:
        """PostgreSQL: ``ON CONFLICT DO NOTHING``, then the holders of the keys left out are read."""
        self._round(SKIP)
        self.mark_held()
        if not self.pending:
            return
        # A holder ended between the conflict and its read: insert again, locking the holder this time.
        with transaction.atomic(using=self.using, savepoint=False):
            self._round(LOCK)
            self.mark_held()
        if self.pending:
            raise RuntimeError(
                f"unique key {self.keys[self.pending[0]]!r} was held by a row that could not be read; "
                "is the transaction's isolation level READ COMMITTED?"
            )

    def _round(self, conflict: str) -> None:
        batches = [self.pending[start : start + self.size] for start in range(0, len(self.pending), self.size)]
        with _pipeline(self.connection) if len(batches) > 1 else nullcontext():
            sent = []
            for batch in batches:
                cursor = self.connection.cursor()
                cursor.execute(*unnest_insert(self.connection, [self.new_jobs[index] for index in batch], conflict))
                sent.append((batch, cursor))
            for batch, cursor in sent:
                with cursor:
                    returned = cursor.fetchall()
                # Keyed rows are found by key (a left-out one returns nothing), the others in order.
                keyed = {row[3]: row for row in returned if row[3] is not None}
                plain = iter([row for row in returned if row[3] is None])
                for index in batch:
                    new = self.new_jobs[index]
                    row = keyed.get(new.unique_key) if new.unique_key else next(plain)
                    if row is not None:
                        self.results[index] = saved_job(self.using, new, *row[:3])
                refer(self.using, [job for job in map(self.results.__getitem__, batch) if isinstance(job, Job)])
        self.pending = [index for index in self.pending if self.results[index] is None]

    def savepoints(self) -> None:
        """Insert the pending jobs in a savepoint; after a conflict, read the keys' holders (still locked:
        each round finds one) and insert the rest again. InnoDB also locks the gap before the entry,
        where two enqueues deadlock: on MariaDB/MySQL held keys are read first, and alone a conflict
        ends the transaction (nothing was written yet)."""
        using, mysql = self.using, self.connection.vendor == "mysql"
        restart = mysql and not self.connection.in_atomic_block
        error: IntegrityError | None = None
        rounds = len(self.pending) + 2
        while rounds:
            with transaction.atomic(using=using):
                if mysql:
                    self.mark_held()
                while self.pending and rounds:
                    rounds -= 1
                    try:
                        with transaction.atomic(using=using):
                            batch = [self.new_jobs[index] for index in self.pending]
                            saved = _insert_values(self.connection, using, batch, self.size)
                    except IntegrityError as exc:
                        if not holds_unique_key(exc, self.connection):
                            raise
                        error = exc
                        if restart:
                            transaction.set_rollback(True, using=using)
                            break
                        # Read with a lock if need be: a consistent read under REPEATABLE READ may not see it yet.
                        if not self.mark_held():
                            self.mark_held(lock=True)
                        continue
                    for index, job in zip(self.pending, saved, strict=True):
                        self.results[index] = job
                    return
                if not self.pending:
                    return
        assert error is not None
        raise error

    def mark_held(self, *, lock: bool = False) -> bool:
        """Mark the pending jobs whose keys a row holds now as ``Held``; tell whether any was."""
        keys = [key for key in (self.keys[index] for index in self.pending) if key is not None]
        holders = unique_key_holders(self.using, keys, lock=lock)
        for index in self.pending:
            key = self.keys[index]
            if key is not None and key in holders:
                self.results[index] = Held(key, holders[key])
        left = [index for index in self.pending if self.results[index] is None]
        found, self.pending = len(left) < len(self.pending), left
        return found


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
        return (
            len(args) >= 2
            and args[0] == 1062
            and str(args[1]).rstrip().endswith((f"'{UNIQUE_INDEX}'", f".{UNIQUE_INDEX}'"))
        )
    if connection.vendor == "sqlite":
        key_column = FIELDS["unique_key"].column
        return str(exc) == f"UNIQUE constraint failed: {Job._meta.db_table}.{key_column}"
    return False


def bulk_enqueue(rows: Sequence[Job], using: str | None = None, *, batch_size: int = 1000) -> list[Job]:
    """Insert ``Job`` rows built by hand, checked against the table's bounds (a held unique key: left out)."""
    using = using or alias()
    check_rows(rows)
    if any(row.unique_key for row in rows):
        return [row for row in insert_each(rows, using) if row is not None]
    with transaction.atomic(using=using, savepoint=False):  # (bulk_create opens one anyway)
        inserted = Job.objects.using(using).bulk_create(rows, batch_size=batch_size)
        refer(using, inserted)
    analyze_if_large(using, len(inserted))
    return inserted


def insert_each(rows: Sequence[Job], using: str | None = None) -> list[Job | None]:
    """Insert rows built from stored steps (next steps, callbacks, retries) in one transaction; one whose
    unique key another job holds is left out under its savepoint (None in its place) and logged."""
    using = using or alias()
    check_rows(rows)
    inserted: list[Job | None] = []
    with transaction.atomic(using=using):
        for row in rows:
            try:
                with transaction.atomic(using=using) if row.unique_key else nullcontext():
                    row.save(force_insert=True, using=using)
            except IntegrityError as exc:
                if not row.unique_key or not holds_unique_key(exc, connections[using]):
                    raise
                holder = unique_key_holders(using, [row.unique_key]).get(row.unique_key)
                logger.info("job=%s not enqueued: job %s holds its unique key %r", row.name, holder, row.unique_key)
                row.pk = None
                inserted.append(None)
                continue
            inserted.append(row)
        refer(using, [row for row in inserted if row is not None])
    return inserted


def refer(using: str, jobs: Sequence[Job | Row]) -> None:
    """Record the objects among the arguments of ``jobs``, just inserted, in one INSERT (in their
    transaction); none for jobs without a model instance, which cost one ``in`` each. A job
    without an id (plain MySQL's bulk insert returns none) is not recorded (about.py)."""
    pairs = [(job.pk, ref) for job in jobs if MODEL_TEXT in job.payload and job.pk for ref in references(job.payload)]
    if not pairs:
        return
    connection = connections[using]
    with connection.cursor() as cursor:
        if connection.vendor == "postgresql":
            ids, refs = [pk for pk, _ in pairs], [ref for _, ref in pairs]
            cursor.execute(f"INSERT INTO {_REFERENCES} SELECT * FROM unnest(%s::bigint[], %s::text[])", [ids, refs])
        else:  # one statement of many rows on MariaDB/MySQL, one prepared on SQLite
            cursor.executemany(f"INSERT INTO {_REFERENCES} VALUES (%s, %s)", pairs)


@contextmanager
def _pipeline(connection: BaseDatabaseWrapper) -> Iterator[None]:
    """psycopg's pipeline mode where libpq has it; a broken connection raises its own error."""

    import psycopg

    raw = connection.connection
    if not psycopg.Pipeline.is_supported():
        yield
        return
    with connection.wrap_database_errors:
        pipeline = raw.pipeline()
        pipeline.__enter__()
        try:
            yield
        except BaseException as exc:
            # Its warnings dropped: an error that says more is on its way to the caller.
            quiet = logging.getLogger("psycopg")
            quiet.addFilter(_DROP_WARNINGS)
            try:
                pipeline.__exit__(type(exc), exc, exc.__traceback__)
            finally:
                quiet.removeFilter(_DROP_WARNINGS)
            raise
        try:
            pipeline.__exit__(None, None, None)
        except psycopg.Error as exc:
            if raw.broken or raw.closed:
                raise psycopg.OperationalError(f"the connection to the database was lost: {exc}") from exc
            raise


def _DROP_WARNINGS(record: logging.LogRecord) -> bool:
    return record.levelno > logging.WARNING
