"""The queue's depth for an autoscaler: the SQL that KEDA's PostgreSQL scaler runs, and the same
counts from Python (docs/howto/autoscaling.md).

A waiting job is one a worker could claim now, as the claim sees it (``claims.plain``): not
reserved, not blocked, ``available_at`` passed by the database's clock, of a queue that is not
paused. On PostgreSQL the count reads the claim's own partial index (``dbqueue_job_waiting``:
``(queue, priority DESC, available_at, id) WHERE reserved_at IS NULL AND NOT blocked``, migration
0008), in its order, so a ``LIMIT`` stops in the index after that many entries: without the
``ORDER BY``, the planner reads a table whose pages are not all-visible in its order on disk, every
row when fewer than ``LIMIT`` match (bench/keda_explain.py). The paused queues leave the list before
the index is read, so a paused queue's jobs cost nothing. Other databases count with the ORM's
named querysets.
"""

from __future__ import annotations

from collections.abc import Iterable

from django.db import connections
from django.db.models import QuerySet

from .db import alias
from .models import Job, PausedQueue
from .validation import check_queue_name

# The rows of the waiting jobs of the queues ``{queues}`` (quoted, comma-separated) that are not
# paused, in the order of the claim's index, one line each.
_WAITING_ROWS = (
    "SELECT 1 FROM dbqueue_job",
    "WHERE queue = ANY (ARRAY(SELECT unnest(ARRAY[{queues}]) EXCEPT SELECT queue FROM dbqueue_paused_queue))",
    "  AND reserved_at IS NULL AND NOT blocked AND available_at <= STATEMENT_TIMESTAMP()",
    "ORDER BY queue, priority DESC, available_at, id",
)

# The jobs a worker could claim now in the queues ``{queues}``, paused queues left out, at most
# ``{limit}`` (``ALL``: every one). ``scaler_query`` fills both in.
WAITING_SQL = "\n".join(
    ["SELECT count(*) FROM (", *(f"  {line}" for line in _WAITING_ROWS), "  LIMIT {limit}", ") AS waiting"]
)

# The work in flight: the reserved jobs of the queues (running, or claimed and about to run; of a
# paused queue too, since a pause lets them end) and their waiting jobs, at most ``{limit}``.
# Zero means that no worker has anything to do: the one safe moment to scale to zero.
IN_FLIGHT_SQL = "\n".join(
    [
        "SELECT count(*) FROM (",
        "  (SELECT 1 FROM dbqueue_job WHERE queue IN ({queues}) AND reserved_at IS NOT NULL)",
        "  UNION ALL",
        f"  ({_WAITING_ROWS[0]}",
        *(f"   {line}" for line in _WAITING_ROWS[1:-1]),
        f"   {_WAITING_ROWS[-1]})",
        "  LIMIT {limit}",
        ") AS in_flight",
    ]
)


def scaler_query(sql: str, queues: Iterable[str], *, limit: int | None) -> str:
    """Return ``sql`` (``WAITING_SQL`` or ``IN_FLIGHT_SQL``) for ``queues``, counting at most ``limit``
    jobs (None: all), as one literal statement for a scaler that sends no parameters. Raise ValueError
    for an invalid queue name (a valid one holds no quote), no queue, or a limit below 1."""
    names = _names(queues)
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
        raise ValueError(f"limit must be a whole number from 1, or None for no limit, not {limit!r}")
    return sql.format(queues=", ".join(f"'{name}'" for name in names), limit="ALL" if limit is None else limit)


def waiting_count(queues: Iterable[str], using: str | None = None, *, limit: int | None = None) -> int:
    """Count the jobs a worker could claim now in ``queues``, paused queues left out, up to ``limit``
    (None: all of them): ``WAITING_SQL`` on PostgreSQL, the ORM's ``waiting()`` elsewhere."""
    names = _names(queues)
    using = using or alias()
    if connections[using].vendor == "postgresql":
        return _run(using, scaler_query(WAITING_SQL, names, limit=limit))
    return _capped(_waiting(using, names), limit)


def in_flight_count(queues: Iterable[str], using: str | None = None, *, limit: int | None = None) -> int:
    """Count the reserved jobs of ``queues`` and their waiting ones (``waiting_count``), up to ``limit``
    (None: all of them): ``IN_FLIGHT_SQL`` on PostgreSQL, the ORM's named querysets elsewhere."""
    names = _names(queues)
    using = using or alias()
    if connections[using].vendor == "postgresql":
        return _run(using, scaler_query(IN_FLIGHT_SQL, names, limit=limit))
    reserved = _capped(Job.objects.db_manager(using).get_queryset().reserved().filter(queue__in=names), limit)
    if limit is not None and reserved >= limit:
        return reserved
    return reserved + _capped(_waiting(using, names), None if limit is None else limit - reserved)


def _names(queues: Iterable[str]) -> list[str]:
    """The queue names, each checked (ValueError for an invalid one), without repeats; at least one."""
    if isinstance(queues, str):
        raise ValueError(f"queues must be a list of queue names, not the string {queues!r}")
    names = list(dict.fromkeys(check_queue_name(queue) for queue in queues))
    if not names:
        raise ValueError("name at least one queue")
    return names


def _waiting(using: str, names: list[str]) -> QuerySet[Job]:
    paused = PausedQueue.objects.using(using).values("queue")
    return Job.objects.db_manager(using).get_queryset().waiting().filter(queue__in=names).exclude(queue__in=paused)


def _capped(rows: QuerySet[Job], limit: int | None) -> int:
    """How many of ``rows`` there are, counting at most ``limit`` (a ``LIMIT`` in a subquery)."""
    rows = rows.order_by()
    return rows.count() if limit is None else rows[:limit].count()


def _run(using: str, sql: str) -> int:
    """The one number ``sql`` returns, read as a scaler reads it: a literal statement, no parameters."""
    with connections[using].cursor() as cursor:
        cursor.execute(sql)
        row = cursor.fetchone()
    return int(row[0])
