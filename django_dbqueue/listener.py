"""Wake idle workers on PostgreSQL: LISTEN for the NOTIFY a trigger sends for the queues of rows
an INSERT made available, so a new job starts within a round trip; polling finds the rest. A
transaction pooler cannot carry LISTEN: set ``DBQUEUE["LISTEN_DATABASE"]`` to a direct alias,
or ``DBQUEUE["LISTEN"] = False``.
"""

from __future__ import annotations

import logging
from typing import Any

from django.db import DatabaseError, connections

from . import conf
from .claims import forget_paused
from .db import alias, drop_connection, error_text

logger = logging.getLogger("django_dbqueue")

CHANNEL = "dbqueue"


class Listener:
    """LISTEN on the queue's connection, or ``LISTEN_DATABASE``'s; again after a reconnect."""

    def __init__(self, using: str | None = None) -> None:
        self.using = using or alias()
        self._listening_on: Any = None

    @classmethod
    def configured(cls) -> Listener | None:
        """The listener the settings ask for; None: ``LISTEN`` off, or no PostgreSQL."""
        if not conf.get("LISTEN"):
            return None
        using = conf.get("LISTEN_DATABASE") or alias()
        return cls(using) if cls.supported(using) else None

    @staticmethod
    def supported(using: str | None = None) -> bool:
        """PostgreSQL through psycopg 3 (psycopg2's connection has no ``pgconn``)."""
        if connections[using or alias()].vendor != "postgresql":
            return False
        from django.db.backends.postgresql.psycopg_any import is_psycopg3

        return bool(is_psycopg3)

    def fileno(self) -> int | None:
        """The socket to wait on, LISTENing first if needed; None if not possible."""
        connection = connections[self.using]
        try:
            connection.ensure_connection()
            raw = connection.connection
            if raw is not self._listening_on:
                with connection.cursor() as cursor:
                    cursor.execute(f"LISTEN {CHANNEL}")
                self._listening_on = raw
            return int(raw.pgconn.socket)
        except (DatabaseError, AttributeError, OSError) as exc:
            logger.debug("cannot listen for new jobs: %s", error_text(exc))
            self._forget()
            return None

    def drain(self) -> int:
        """Read the notifications that arrived; return how many."""
        connection = connections[self.using]
        raw = connection.connection
        if raw is None:
            return 0
        queues: list[str] = []
        try:
            raw.pgconn.consume_input()
            while (notification := raw.pgconn.notifies()) is not None:
                queues.append(notification.extra.decode(errors="replace"))
        except Exception as exc:  # noqa: BLE001 - a broken socket: the next reserve reconnects
            logger.debug("reading notifications failed: %s", error_text(exc))
            self._forget()
        if queues:
            # A resume notifies its queue: the next claim reads the paused queues again.
            forget_paused(queues)
        return len(queues)

    def _forget(self) -> None:
        """LISTEN again on the next wait, on a fresh connection if it is its own."""
        self._listening_on = None
        if self.using != alias():
            drop_connection(self.using)
