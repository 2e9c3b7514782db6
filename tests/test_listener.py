"""The worker's listener (PostgreSQL): notifications that arrive while its connection runs a
statement are heard, not lost to the next poll, and not kept by psycopg for the connection's life."""

from __future__ import annotations

import select
from collections.abc import Iterator

import psycopg
import pytest
from django.db import connection

from django_dbqueue.listener import CHANNEL, Listener
from tests.conftest import needs_listen

pytestmark = [pytest.mark.django_db(transaction=True), needs_listen]


@pytest.fixture(autouse=True)
def fresh_connection() -> Iterator[None]:
    """The tests LISTEN on this process's connection: the next test gets a new one, not listening."""
    yield
    connection.close()


def notify(queues: list[str]) -> None:
    settings = connection.settings_dict
    with psycopg.connect(
        host=settings["HOST"], port=settings["PORT"], user=settings["USER"], dbname=settings["NAME"], autocommit=True
    ) as other:
        for queue in queues:
            other.execute("SELECT pg_notify(%s, %s)", [CHANNEL, queue])


def test_notifications_that_come_in_during_a_statement_wake_the_next_wait_and_are_not_kept():
    listener = Listener(connection.alias)
    assert listener.fileno() is not None
    assert not listener.heard()
    notify([f"q{i % 50}" for i in range(1000)])
    # The listening connection is the worker's own: its next statement reads the notifications.
    with connection.cursor() as cursor:
        cursor.execute("SELECT 1")
    assert listener.heard()
    assert listener.drain() == 50  # one per queue named
    assert not listener.heard()
    # Without a handler, psycopg keeps each one in a list that grows for the connection's life.
    assert len(connection.connection._notifies_backlog) == 0


def test_notifications_read_from_the_socket_while_idle_are_drained_as_before():
    listener = Listener(connection.alias)
    socket = listener.fileno()
    notify(["default", "emails"])
    ready, _, _ = select.select([socket], [], [], 10)
    assert ready and listener.drain() >= 1
