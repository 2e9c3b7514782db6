"""Database helpers shared by the models and the worker: the clock, vendor facts, cursors,
lost-connection tests and one SQL cache."""

from __future__ import annotations

import functools
import os
import re
import select
import socket
from collections.abc import Callable, Iterable, Sequence
from typing import Any, NamedTuple

from django.db import DatabaseError, InterfaceError, OperationalError, connections
from django.db.models.functions import Now

from . import conf


class DbNow(Now):
    """The database's clock as a timezone-aware UTC datetime, on every backend (Django's ``Now``
    follows MySQL's session time zone, where Django stores naive UTC)."""

    def as_mysql(self, compiler: Any, connection: Any, **extra_context: Any) -> Any:
        return self.as_sql(compiler, connection, template="UTC_TIMESTAMP(6)", **extra_context)


# The vendors whose claim this package knows (skip locked, or compare-and-set on SQLite).
CLAIM_VENDORS = ("postgresql", "mysql", "sqlite")


def alias() -> str:
    """Return the database alias that holds the queue."""
    return str(conf.get("DATABASE"))


def vendor(using: str | None = None) -> str:
    return str(connections[using or alias()].vendor)


def claims_with_skip_locked(using: str | None = None) -> bool:
    """Tell whether the claim can use ``SELECT ... FOR UPDATE SKIP LOCKED``."""
    return bool(connections[using or alias()].features.has_select_for_update_skip_locked)


# MySQL/MariaDB errors that mean the session is gone or could not be opened: shutdown, too many
# connections, aborted or killed, network interrupted, cannot connect, gone away, lost.
MYSQL_CONNECTION_ERRORS = frozenset({1040, 1053, 1152, 1159, 1161, 1927, 2002, 2003, 2006, 2013, 2055, 4031})


def is_connection_error(exc: BaseException, using: str | None = None) -> bool:
    """Tell whether ``exc`` means the session with the server broke, not that the database refused a query.

    Asked of the driver's error (Django may have reconnected already); SQLite has no session to lose,
    and it and MySQL report a missing column as OperationalError too.
    """
    if not isinstance(exc, (OperationalError, InterfaceError)):
        return False
    vendor = connections[using or alias()].vendor
    if vendor == "sqlite":
        return False
    if isinstance(exc, InterfaceError):
        return True
    cause = exc.__cause__
    if vendor == "postgresql":
        # Client-side errors have no SQLSTATE; 08: connection exception; 57P: the server ended the session.
        sqlstate = getattr(cause, "sqlstate", None) or getattr(cause, "pgcode", None)
        return sqlstate is None or sqlstate.startswith(("08", "57P"))
    if vendor == "mysql":
        code = cause.args[0] if cause is not None and cause.args else None
        return code in MYSQL_CONNECTION_ERRORS
    return True


def caused_by_lost_connection(exc: BaseException, using: str | None = None) -> bool:
    """Tell whether ``exc``, or one it was raised from or while handling, is a lost connection:
    a job that wraps the database's error in its own still lost its connection."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        if is_connection_error(current, using):
            return True
        seen.add(id(current))
        current = current.__cause__ or current.__context__
    return False


# MySQL/MariaDB errors whose message quotes a value of the statement (duplicate entry, incorrect
# value, the text near a syntax error).
_MYSQL_DUPLICATE = re.compile(r"^Duplicate entry '.*' for key '([^']*)'$", re.DOTALL)
MYSQL_QUOTING_VALUES = frozenset({1062, 1064, 1292, 1366, 1367, 1411, 1525})


def error_text(exc: BaseException) -> str:
    """Return what may be logged of a database error: its class, code and primary message.

    Never the driver's whole text, whose details quote the row (a job's arguments): the message is
    cut before a quoted value (PostgreSQL's class 22, ``MYSQL_QUOTING_VALUES``); SQLite's quote none.
    """
    name = type(exc).__name__
    driver = exc.__cause__ if exc.__cause__ is not None else exc
    diag = getattr(driver, "diag", None)
    if diag is not None:
        sqlstate = getattr(driver, "sqlstate", None) or getattr(driver, "pgcode", None)
        primary = getattr(diag, "message_primary", None)
        if isinstance(sqlstate, str) and isinstance(primary, str):
            if sqlstate.startswith("22"):
                primary = primary.split(":", 1)[0]
            return f"{name} sqlstate={sqlstate}: {primary}"
        if sqlstate is None:
            lines = str(driver).strip().splitlines()
            return f"{name}: {lines[0]}" if lines else name
        return name
    args = driver.args
    sqlite_name = getattr(driver, "sqlite_errorname", None)
    if isinstance(sqlite_name, str):
        return f"{name} code={sqlite_name}: {args[0]}" if args and isinstance(args[0], str) else name
    is_mysql = type(driver).__module__.startswith("MySQLdb") or isinstance(exc, DatabaseError)
    if is_mysql and len(args) == 2 and isinstance(args[0], int) and isinstance(args[1], str):
        code, message = args
        if code == 1062:
            match = _MYSQL_DUPLICATE.match(message)
            message = f"Duplicate entry '...' for key '{match[1]}'" if match else "Duplicate entry"
        elif code in MYSQL_QUOTING_VALUES:
            message = message.split("'", 1)[0].rstrip(" :")
        return f"{name} code={code}: {message}"
    return name


def drop_connection(using: str | None = None) -> None:
    """Close the queue's connection so the next query opens a fresh one."""
    connection = connections[using or alias()]
    try:
        connection.close()
    except DatabaseError:
        # The socket is already gone; forget it.
        connection.connection = None


# The oldest open transaction: on PostgreSQL, of the sessions of this database that hold a snapshot
# or an xid (the horizon below which vacuum may not remove the rows of finished jobs); on MariaDB and
# MySQL, of the server's InnoDB transactions (purge is server-wide). Its age in seconds, its
# session (backend pid, connection id) and who opened it (application_name; user@host).
_OLDEST_TRANSACTION_SQL = {
    "postgresql": "SELECT EXTRACT(EPOCH FROM clock_timestamp() - xact_start), pid, application_name, state "
    "FROM pg_stat_activity WHERE datname = current_database() AND pid <> pg_backend_pid() "
    "AND (backend_xmin IS NOT NULL OR backend_xid IS NOT NULL) ORDER BY xact_start LIMIT 1",
    "mysql": "SELECT TIMESTAMPDIFF(MICROSECOND, trx_started, NOW(6)) / 1e6, trx_mysql_thread_id, "
    "CONCAT(p.USER, '@', p.HOST), p.COMMAND FROM information_schema.INNODB_TRX "
    "LEFT JOIN information_schema.PROCESSLIST AS p ON p.ID = trx_mysql_thread_id "
    "WHERE trx_mysql_thread_id <> CONNECTION_ID() ORDER BY trx_started LIMIT 1",
}


class OpenTransaction(NamedTuple):
    """The oldest transaction open on the queue's database server (``oldest_transaction``)."""

    seconds: float
    session: int
    application: str
    state: str

    def __str__(self) -> str:
        who = f"application {self.application!r}, " if self.application else ""
        return f"open for {self.seconds:.0f} s by session {self.session} ({who}{self.state or 'state unknown'})"


def oldest_transaction(using: str | None = None) -> OpenTransaction | None:
    """The oldest transaction open on the queue's database server but this session's (see
    ``_OLDEST_TRANSACTION_SQL``); None when there is none, or on SQLite, whose readers hold nothing back."""
    connection = connections[using or alias()]
    sql = _OLDEST_TRANSACTION_SQL.get(connection.vendor)
    if sql is None:
        return None
    with connection.cursor() as cursor:
        cursor.execute(sql)
        row = cursor.fetchone()
    if not row or row[0] is None:
        return None
    return OpenTransaction(float(row[0]), int(row[1]), row[2] or "", row[3] or "")


def oldest_transaction_seconds(using: str | None = None) -> float | None:
    """Seconds the oldest transaction open on the queue's database server has run (``oldest_transaction``)."""
    oldest = oldest_transaction(using)
    return oldest.seconds if oldest else None


def pool_size(connection: Any) -> int | None:
    """The most connections Django's pool (``OPTIONS["pool"]``, PostgreSQL) opens per process;
    None without one. psycopg_pool's own defaults: ``min_size`` 4, ``max_size`` = ``min_size``."""
    options = connection.settings_dict["OPTIONS"].get("pool") if connection.vendor == "postgresql" else None
    if not options:
        return None
    options = options if isinstance(options, dict) else {}
    return int(options.get("max_size") or options.get("min_size") or 4)


def close_before_fork() -> None:
    """Close every connection of this process, and the pools behind them (``OPTIONS["pool"]``,
    PostgreSQL): a forked child must open sockets of its own, not share the parent's."""
    for connection in connections.all(initialized_only=True):
        connection.close()
    for connection in connections.all():
        # A pool (its sockets, its threads) belongs to the alias, not to one thread's wrapper.
        if pool_size(connection) is not None:
            connection.close_pool()  # type: ignore[attr-defined]  # PostgreSQL's wrapper


def read_back(instance: Any, *fields: str) -> None:
    """Replace database-clock expressions left on a saved instance by their stored values.

    Django 6 reads them back in the INSERT's RETURNING clause; Django 5.2, UPDATEs
    and backends without RETURNING leave the expression on the instance.
    """
    # Django 6.1 defers a field saved from an expression; reading it would fetch it
    # from wherever a router sends reads. Read it from the database the row was saved to.
    deferred = instance.get_deferred_fields()
    if any(name in deferred or hasattr(getattr(instance, name), "resolve_expression") for name in fields):
        instance.refresh_from_db(fields=list(fields), using=instance._state.db)


def apply_network_timeout(connection: Any, seconds: float | None = None) -> bool:
    """Bound how long a silent network can stall a query on a TCP ``connection``; return whether its socket was set.

    A read from a server hidden by a broken network never returns: keepalives (from a third of
    ``seconds``) and the user timeout end it after about ``seconds`` (default ``NETWORK_TIMEOUT``).
    """
    seconds = conf.get("NETWORK_TIMEOUT") if seconds is None else seconds
    raw = getattr(connection, "connection", None)
    if seconds is None or raw is None or connection.vendor == "sqlite":
        return False
    try:
        fd = os.dup(raw.fileno())
    except Exception:  # noqa: BLE001 - a lost connection raises the driver's own error (psycopg), or names a closed descriptor (MySQLdb)
        # Nothing to bound: the next query fails, and the worker's outage path reconnects.
        return False
    try:
        sock = socket.socket(fileno=fd)
    except OSError:
        # MySQLdb's descriptor of a lost connection may since name another file.
        os.close(fd)
        return False
    try:
        if sock.family not in (socket.AF_INET, socket.AF_INET6):
            return False
        idle = max(1, int(seconds / 3))
        count = 3
        interval = max(1, int((seconds - idle) / count))
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, idle)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, interval)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT, count)
        if hasattr(socket, "TCP_USER_TIMEOUT"):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, int(seconds * 1000))
        return True
    except OSError:
        return False
    finally:
        # Closes the duplicate only; the options belong to the shared socket.
        sock.close()


def _on_connection_created(sender: Any, connection: Any, **kwargs: Any) -> None:
    apply_network_timeout(connection)


def watch_network() -> None:
    """Apply ``apply_network_timeout`` to every connection this process opens from now on (a worker
    cut off from its database must notice and reconnect, without a restart)."""
    from django.db.backends.signals import connection_created

    connection_created.connect(_on_connection_created, dispatch_uid="django_dbqueue.network_timeout")
    for connection in connections.all(initialized_only=True):
        if connection.connection is not None:
            apply_network_timeout(connection)


def bound_cursor(connection: Any) -> Any:
    """A cursor for the worker's fixed statements: on psycopg 3, one that binds the parameters on the
    server (no formatting into the SQL in Python); elsewhere the connection's usual cursor."""
    if connection.vendor != "postgresql":
        return connection.cursor()
    from django.db.backends.postgresql.psycopg_any import is_psycopg3

    if not is_psycopg3:
        return connection.cursor()
    import psycopg

    connection.ensure_connection()
    return _wrapped(connection, psycopg.Cursor(connection.connection))


def kept_cursor(connection: Any) -> Any:
    """Django's cursor over a driver cursor kept for this connection (not to be closed), for a
    statement sent once per call, such as a single enqueue (docs/performance.md)."""
    connection.ensure_connection()
    kept = connection.__dict__.get("_dbqueue_kept_cursor")
    if kept is None or kept[0] is not connection.connection or kept[1].closed:
        kept = connection.__dict__["_dbqueue_kept_cursor"] = (connection.connection, connection.create_cursor())
    return _wrapped(connection, kept[1])


def _wrapped(connection: Any, cursor: Any) -> Any:
    """A driver cursor in Django's cursor wrapper, as ``connection.cursor()`` wraps its own."""
    connection.validate_thread_sharing()
    return connection.make_debug_cursor(cursor) if connection.queries_logged else connection.make_cursor(cursor)


def cached_sql(build: Callable[[Any], str]) -> Callable[[Any], str]:
    """Build a fixed statement once per database vendor."""
    texts: dict[str, str] = {}

    @functools.wraps(build)
    def sql(connection: Any) -> str:
        text = texts.get(connection.vendor)
        if text is None:
            text = texts[connection.vendor] = build(connection)
        return text

    return sql


# Where idle workers listen for queues with jobs ready to claim (``listener``): a NOTIFY's payload
# is a queue's name. The INSERT trigger of migration 0002 and ``dbqueue_release`` send it too.
QUEUE_CHANNEL = "dbqueue"


def notify_queues(using: str, queues: Iterable[str]) -> None:
    """Wake the workers listening for ``queues`` (PostgreSQL; nothing elsewhere) when the caller's
    transaction commits: jobs there became ready otherwise than by an INSERT."""
    connection = connections[using]
    if connection.vendor != "postgresql":
        return
    with connection.cursor() as cursor:
        for queue in sorted(set(queues)):
            cursor.execute("SELECT pg_notify(%s, %s)", [QUEUE_CHANNEL, queue])


# What one NOTIFY may carry (PostgreSQL's limit is 8,000 bytes): ids are joined in chunks of this.
NOTIFY_IDS = 400


def notify_ids(using: str, channel: str, ids: Iterable[int]) -> None:
    """Send ``ids`` on ``channel`` (PostgreSQL; nothing elsewhere), comma-separated, in the caller's
    transaction: delivered when it commits, never if it rolls back."""
    chosen = [str(int(pk)) for pk in ids]
    connection = connections[using]
    if not chosen or connection.vendor != "postgresql":
        return
    with connection.cursor() as cursor:
        for start in range(0, len(chosen), NOTIFY_IDS):
            cursor.execute("SELECT pg_notify(%s, %s)", [channel, ",".join(chosen[start : start + NOTIFY_IDS])])


class IdListener:
    """A connection of its own that LISTENs on ``channel`` for ``notify_ids`` (PostgreSQL through
    psycopg 3); ``open`` is False elsewhere, or when it cannot listen: the caller polls then."""

    def __init__(self, using: str, channel: str) -> None:
        self.using, self.channel = using, channel
        self.connection: Any = None

    def open(self) -> bool:
        if connections[self.using].vendor != "postgresql":
            return False
        from django.db.backends.postgresql.psycopg_any import is_psycopg3

        if not is_psycopg3:
            return False
        connection = connections.create_connection(self.using)
        try:
            with connection.cursor() as cursor:
                # The channel is ours, a fixed identifier (never a caller's text).
                cursor.execute(f"LISTEN {self.channel}")
        except DatabaseError:
            connection.close()
            return False
        self.connection = connection
        return True

    def wait(self, seconds: float) -> set[int]:
        """The ids notified within ``seconds`` (returns at the first notification); empty after the
        time, or if the connection broke (then it stops listening: the caller polls)."""
        if self.connection is None:
            return set()
        raw = self.connection.connection
        try:
            ready, _, _ = select.select([raw.pgconn.socket], [], [], max(0.0, seconds))
            if not ready:
                return set()
            raw.pgconn.consume_input()
            ids: set[int] = set()
            while (notification := raw.pgconn.notifies()) is not None:
                ids.update(int(part) for part in notification.extra.decode().split(",") if part.isdigit())
            return ids
        except Exception:  # noqa: BLE001 - a broken socket (the driver's own error): poll instead
            self.close()
            return set()

    def close(self) -> None:
        if self.connection is not None:
            try:
                self.connection.close()
            except DatabaseError:
                pass
            self.connection = None


# SQLSTATEs of PostgreSQL (lock not available, deadlock, serialization) and MySQL's error
# numbers (lock wait timeout, deadlock) that mean another transaction held what this one needed.
POSTGRESQL_LOCKS = frozenset({"55P03", "40P01", "40001"})
MYSQL_LOCKS = frozenset({1205, 1213})


def is_lock(exc: DatabaseError) -> bool:
    """Tell whether ``exc`` says another transaction held a lock this one needed (it may be run again)."""
    cause = exc.__cause__ if exc.__cause__ is not None else exc
    sqlite_name = getattr(cause, "sqlite_errorname", None)
    if isinstance(sqlite_name, str):
        return sqlite_name.startswith(("SQLITE_BUSY", "SQLITE_LOCKED"))
    sqlstate = getattr(cause, "sqlstate", None) or getattr(cause, "pgcode", None)
    if sqlstate is not None:
        return sqlstate in POSTGRESQL_LOCKS
    args: tuple[Any, ...] = getattr(cause, "args", ())
    if args and isinstance(args[0], int):
        return args[0] in MYSQL_LOCKS
    return bool(args) and isinstance(args[0], str) and "is locked" in args[0]


def update_rows(model: Any, rows: Sequence[Any], names: Sequence[str], using: str) -> None:
    """Write the fields ``names`` of many ``rows`` of ``model`` with one UPDATE through ``executemany``
    (``bulk_update``'s CASE per field and row would hold a worker's GIL for seconds in a catch-up)."""
    connection = connections[using]
    meta = model._meta
    by_name = {field.name: field for field in meta.concrete_fields}
    fields = [by_name[name] for name in names]
    quote = connection.ops.quote_name
    assignments = ", ".join(f"{quote(str(field.column))} = %s" for field in fields)
    pk = quote(str(by_name["id"].column))
    sql = f"UPDATE {quote(meta.db_table)} SET {assignments} WHERE {pk} = %s"
    params = [
        [field.get_db_prep_save(getattr(row, field.attname), connection) for field in fields] + [row.pk] for row in rows
    ]
    with connection.cursor() as cursor:
        cursor.executemany(sql, params)
