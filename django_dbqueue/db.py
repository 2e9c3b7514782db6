"""Database helpers shared by the models and the worker."""

from __future__ import annotations

from typing import Any

from django.db import DatabaseError, InterfaceError, OperationalError, connections
from django.db.models.functions import Now

from . import conf


class DbNow(Now):
    """The database's clock as a timezone-aware UTC datetime, on every backend.

    Django's ``Now`` is ``CURRENT_TIMESTAMP(6)`` on MySQL, which follows the
    session time zone; Django stores naive UTC there, so use ``UTC_TIMESTAMP``.
    """

    def as_mysql(self, compiler: Any, connection: Any, **extra_context: Any) -> Any:
        return self.as_sql(compiler, connection, template="UTC_TIMESTAMP(6)", **extra_context)


def alias() -> str:
    """Return the database alias that holds the queue."""
    return str(conf.get("DATABASE"))


def vendor(using: str | None = None) -> str:
    return str(connections[using or alias()].vendor)


def claims_with_skip_locked(using: str | None = None) -> bool:
    """Tell whether the claim can use ``SELECT ... FOR UPDATE SKIP LOCKED``."""
    return bool(connections[using or alias()].features.has_select_for_update_skip_locked)


def is_connection_error(exc: BaseException, using: str | None = None) -> bool:
    """Tell whether ``exc`` may mean the connection is gone rather than a bad query.

    Drivers report a killed session or a restarted server as OperationalError
    or InterfaceError, sometimes while still calling the connection idle.
    """
    if isinstance(exc, (OperationalError, InterfaceError)):
        return True
    if not isinstance(exc, DatabaseError):
        return False
    connection = connections[using or alias()]
    if connection.connection is None:
        return True
    try:
        return not connection.is_usable()
    except Exception:  # noqa: BLE001 - any failure here means unusable
        return True


def drop_connection(using: str | None = None) -> None:
    """Close the queue's connection so the next query opens a fresh one."""
    connection = connections[using or alias()]
    try:
        connection.close()
    except DatabaseError:
        # The socket is already gone; forget it.
        connection.connection = None
