"""Throughput history: jobs started, succeeded, failed and retried per minute, queue and name
(a django.tasks task's own path: ``shown_name``), with run times. A worker counts in memory
(``Recorder``) and its heartbeat adds the counts to the ``JobHistory`` rows with one upsert per
beat (a ``kill -9`` loses one beat's worth). Buckets are minutes of the worker's clock;
``DBQUEUE["HISTORY"] = False`` turns it off.
"""

from __future__ import annotations

import bisect
import functools
import logging
import threading
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

from django.db import connections, transaction
from django.db.models import Max, Sum

from . import conf, payload
from .db import DbNow, alias
from .exceptions import PayloadError
from .handles import TASKS_JOB
from .models import Job, JobHistory

logger = logging.getLogger("django_dbqueue")

# The longest name a history row holds.
_NAME_LENGTH = JobHistory._meta.get_field("name").max_length or 200
# Upper bounds (seconds) of the run-time buckets h0..h11; h12 counts longer runs.
BOUNDS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 60.0)
BINS = tuple(f"h{i}" for i in range(len(BOUNDS) + 1))
# A run that ended is one of: succeeded; failed (the job went to the failed jobs, for good);
# retried (it raised and the job was released to run again: it may succeed later).
COUNTS = ("started", "succeeded", "failed", "retried")
# The columns an upsert adds to.
ADDED = (*COUNTS, "run_time", *BINS)


@dataclass
class Tally:
    """One minute, queue and name's counts, in memory."""

    started: int = 0
    succeeded: int = 0
    failed: int = 0
    retried: int = 0
    run_time: float = 0.0
    bins: list[int] = field(default_factory=lambda: [0] * len(BINS))

    def values(self) -> list[Any]:
        return [self.started, self.succeeded, self.failed, self.retried, self.run_time, *self.bins]

    @classmethod
    def of(cls, value: Any) -> Tally:
        """A tally of the counts ``value(column)`` reads (a row's)."""
        started, succeeded, failed, retried = (value(name) for name in COUNTS)
        return cls(started, succeeded, failed, retried, value("run_time"), [value(name) for name in BINS])

    def add(self, other: Tally) -> None:
        self.started += other.started
        self.succeeded += other.succeeded
        self.failed += other.failed
        self.retried += other.retried
        self.run_time += other.run_time
        self.bins = [a + b for a, b in zip(self.bins, other.bins, strict=True)]


Key = tuple[datetime, str, str]


def _minute(now: float) -> datetime:
    return datetime.fromtimestamp(now - now % 60, tz=UTC)


def enabled() -> bool:
    return bool(conf.get("HISTORY"))


# The argument of a django.tasks job that names its task (tasks.py puts it there).
TASK_PATH = "task_path"


def shown_name(job: Job) -> str:
    """The name ``job``'s runs are counted and logged under: a django.tasks task's own path
    (``shop.tasks.send_receipt``), not the internal job that runs it; else the job's name.

    Read from the envelope, so no query; a row enqueued before tasks carried their path, or
    a path longer than the history's column, keeps the job's name.
    """
    if job.name != TASKS_JOB:
        return job.name
    try:
        path = payload.decode(job.payload)["kwargs"].get(TASK_PATH)
    except PayloadError:
        return job.name
    if isinstance(path, str) and 0 < len(path) <= _NAME_LENGTH:
        return path
    return job.name


class Recorder:
    """A worker's counts since its last flush (any thread counts; the heartbeat flushes)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        # Keyed by the minute's number: made a datetime at the flush, not per job.
        self._tallies: dict[tuple[int, str, str], Tally] = {}
        self.on = enabled()

    def _tally(self, queue: str, name: str) -> Tally:
        key = (int(time.time()) // 60, queue, name)
        tally = self._tallies.get(key)
        if tally is None:
            tally = self._tallies[key] = Tally()
        return tally

    def started(self, queue: str, name: str) -> None:
        if not self.on:
            return
        with self._lock:
            self._tally(queue, name).started += 1

    def ended(self, queue: str, name: str, status: str, duration: float) -> None:
        """Count a run's outcome: ``succeeded``, ``failed`` or ``retried``."""
        if not self.on:
            return
        with self._lock:
            tally = self._tally(queue, name)
            if status == "succeeded":
                tally.succeeded += 1
            elif status == "failed":
                tally.failed += 1
            else:
                tally.retried += 1
            tally.run_time += duration
            tally.bins[bisect.bisect_left(BOUNDS, duration)] += 1

    def pending(self) -> bool:
        with self._lock:
            return bool(self._tallies)

    def flush(self, using: str | None = None) -> int:
        """Add the counts to the rows; return how many. On an error they are kept, and it raised."""
        with self._lock:
            counted, self._tallies = self._tallies, {}
        if not counted:
            return 0
        tallies = {(_minute(minute * 60), queue, name): tally for (minute, queue, name), tally in counted.items()}
        try:
            add(tallies, using)
        except Exception:
            with self._lock:
                for key, tally in counted.items():
                    kept = self._tallies.get(key)
                    if kept is None:
                        self._tallies[key] = tally
                    else:
                        kept.add(tally)
            raise
        return len(tallies)


def add(tallies: dict[Key, Tally], using: str | None = None) -> None:
    """Add ``tallies`` to their rows in one statement: insert, or add to the row there."""
    using = using or alias()
    connection = connections[using]
    quote = connection.ops.quote_name
    meta = JobHistory._meta
    column = {f.name: quote(str(f.column)) for f in meta.concrete_fields}
    names = ["bucket", "queue", "name", *ADDED]
    row = "(" + ", ".join(["%s"] * len(names)) + ")"
    table = quote(meta.db_table)
    if connection.vendor == "mysql":
        update = ", ".join(f"{column[n]} = {column[n]} + VALUES({column[n]})" for n in ADDED)
        conflict = f"ON DUPLICATE KEY UPDATE {update}"
    else:
        update = ", ".join(f"{column[n]} = {table}.{column[n]} + EXCLUDED.{column[n]}" for n in ADDED)
        conflict = f"ON CONFLICT ({column['bucket']}, {column['queue']}, {column['name']}) DO UPDATE SET {update}"
    params: list[Any] = []
    # Sorted: two workers' upserts lock the rows in the same order (no deadlock).
    for (bucket, queue, name), tally in sorted(tallies.items()):
        field_value = JobHistory._meta.get_field("bucket").get_db_prep_value(bucket, connection)
        params += [field_value, queue, name, *tally.values()]
    sql = (
        f"INSERT INTO {table} ({', '.join(column[n] for n in names)}) VALUES "
        f"{', '.join([row] * len(tallies))} {conflict}"
    )
    with transaction.atomic(using=using), connection.cursor() as cursor:
        cursor.execute(sql, params)


# The bucket of pruned rows' sums per queue and name: the totals (Prometheus counters) never go down.
EVER = datetime(1970, 1, 1, tzinfo=UTC)


def prune(hours: float) -> int:
    """Fold history rows older than ``hours`` into the ``EVER`` bucket; return how many rows went."""
    using = alias()
    with transaction.atomic(using=using):
        newest = (
            JobHistory.objects.using(using)
            .filter(bucket__lt=DbNow() - timedelta(hours=hours), bucket__gt=EVER)
            .aggregate(newest=Max("bucket"))["newest"]
        )
        if newest is None:
            return 0
        old = JobHistory.objects.using(using).filter(bucket__lte=newest, bucket__gt=EVER)
        sums = old.values("queue", "name").order_by().annotate(**{name: Sum(name) for name in ADDED})
        folded = {(EVER, row["queue"], row["name"]): Tally.of(row.__getitem__) for row in sums}
        deleted, _ = old.delete()
        add(folded, using)
    return deleted


# -- reading ---------------------------------------------------------------------


class Totals(Tally):
    """Counts over a period (and per minute, for charts), read back from the rows."""

    @property
    def ended(self) -> int:
        return self.succeeded + self.failed + self.retried

    def percentile(self, q: float) -> float | None:
        """The run time (a bucket's upper bound) below which ``q`` (0..1) of the runs ended; None without runs."""
        total = sum(self.bins)
        if not total:
            return None
        rank = q * total
        seen = 0
        for index, count in enumerate(self.bins):
            seen += count
            if seen >= rank and count:
                return BOUNDS[min(index, len(BOUNDS) - 1)]
        return BOUNDS[-1]


def rows_since(since: datetime, *, queues: Sequence[str] | None = None) -> Iterable[JobHistory]:
    rows = JobHistory.objects.filter(bucket__gte=max(since, EVER + timedelta(minutes=1)))
    if queues:
        rows = rows.filter(queue__in=list(queues))
    return rows.order_by("bucket")


def totals(rows: Iterable[JobHistory], by: str | None = None) -> dict[Any, Totals]:
    """Sum ``rows`` by ``by`` (``"queue"``, ``"name"``, ``"bucket"``; None: one total under None)."""
    result: dict[Any, Totals] = {}
    for row in rows:
        key = getattr(row, by) if by else None
        result.setdefault(key, Totals()).add(Tally.of(functools.partial(getattr, row)))
    return result
