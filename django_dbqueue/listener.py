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
from .db import QUEUE_CHANNEL, alias, drop_connection, error_text

logger = logging.getLogger("django_dbqueue")

CHANNEL = QUEUE_CHANNEL


class Listener:
    """LISTEN on the queue's connection, or ``LISTEN_DATABASE``'s; again after a reconnect."""

    def __init__(self, using: str | None = None) -> None:
        self.using = using or alias()
        self._listening_on: Any = None
        # Queues named by notifications that came in while the connection ran a statement (a claim,
        # or the commit of the worker's own release): psycopg hands those to its handlers, and
        # without one keeps them in a list that grows for the connection's life.
        self._heard: set[str] = set()
        self._heard_on: Any = None

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
            if raw is not self._heard_on:
                raw.add_notify_handler(self._hear)
                self._heard_on = raw
            if raw is not self._listening_on:
                with connection.cursor() as cursor:
                    cursor.execute(f"LISTEN {CHANNEL}")
                self._listening_on = raw
            return int(raw.pgconn.socket)
        except (DatabaseError, AttributeError, OSError) as exc:
            logger.debug("cannot listen for new jobs: %s", error_text(exc))
            self._forget()
            return None

    def _hear(self, notification: Any) -> None:
        self._heard.add(notification.payload)

    def heard(self) -> bool:
        """Whether a notification came in during a statement since the last ``drain`` (then the
        socket stays quiet: wake without waiting)."""
        return bool(self._heard)

    def drain(self) -> int:
        """Read the notifications that arrived; return how many."""
        connection = connections[self.using]
        raw = connection.connection
        queues: list[str] = list(self._heard)
        self._heard.clear()
        if raw is None:
            return len(queues)
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
