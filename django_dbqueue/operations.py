"""What operators do to the queue; shared by the admin and the management commands."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Iterable, Iterator, Sequence
from datetime import datetime, timedelta

from django.db import connections, transaction
from django.db.models import Count, Max, Min, Q, QuerySet

from . import conf, lifecycle, workers
from .db import DbNow, alias
from .exceptions import FailedJobsNotFound
from .insert import analyze_if_large
from .models import ANALYZE_AFTER, FailedJob, FailedJobQuerySet, Job, PausedQueue, QueueControl, QueueWorker

RESTART_KEY = "restart"
# Failed jobs retried per transaction: memory and lock time stay bounded, and an
# interrupted retry leaves each job either retried or still failed. Under
# ANALYZE_AFTER, so PostgreSQL's ANALYZE of the job table runs once at the end of a
# large retry, not after every chunk (docs/performance.md).
RETRY_CHUNK = ANALYZE_AFTER - 1
# Query parameters per statement when selecting by explicit ids: far under every
# database's limit (SQLite 32766 or 250000, PostgreSQL 65535).
IDS_PER_QUERY = 1000


def job_state(job: Job, now: datetime | None) -> str:
    """Where a job is, in words: waiting, delayed, blocked, reserved or reservation expired (``Job.state``)."""
    return str(job.state(now).label)


@dataclasses.dataclass(frozen=True)
class QueueStats:
    queue: str
    waiting: int = 0
    delayed: int = 0
    reserved: int = 0
    failed: int = 0
    oldest_waiting_seconds: float | None = None
    # When the queue was paused (see pauses.py); None: it is not paused.
    paused_at: datetime | None = None
    # Waiting for a free slot of their concurrency key (see concurrency.py).
    blocked: int = 0

    @property
    def size(self) -> int:
        """Jobs not yet done: waiting, delayed, blocked and reserved."""
        return self.waiting + self.delayed + self.blocked + self.reserved

    @property
    def paused(self) -> bool:
        return self.paused_at is not None


def read_alias() -> str:
    """The alias the read-only counts use: ``READ_DATABASE`` (a replica), else ``DATABASE``."""
    return str(conf.get("READ_DATABASE") or alias())


def queue_overview() -> list[QueueStats]:
    """Counts per queue from two grouped queries, and the paused queues from a third, all
    on ``read_alias()``; a paused queue without jobs is listed too."""
    using = read_alias()
    now = DbNow()
    waiting = Q(reserved_at__isnull=True, blocked=False, available_at__lte=now)
    rows = (
        Job.objects.using(using)
        .order_by()
        .values("queue")
        .annotate(
            waiting=Count("id", filter=waiting),
            delayed=Count("id", filter=Q(reserved_at__isnull=True, blocked=False, available_at__gt=now)),
            held=Count("id", filter=Q(reserved_at__isnull=True, blocked=True)),
            reserved=Count("id", filter=Q(reserved_at__isnull=False)),
            oldest=Min("available_at", filter=waiting),
            clock=Min(now),
        )
    )
    failed = dict(
        FailedJob.objects.using(using).order_by().values("queue").annotate(n=Count("id")).values_list("queue", "n")
    )
    stats = {}
    for row in rows:
        oldest = row["oldest"]
        age = max((row["clock"] - oldest).total_seconds(), 0.0) if oldest is not None else None
        stats[row["queue"]] = QueueStats(
            row["queue"],
            row["waiting"],
            row["delayed"],
            row["reserved"],
            failed.get(row["queue"], 0),
            age,
            blocked=row["held"],
        )
    for queue, count in failed.items():
        stats.setdefault(queue, QueueStats(queue, failed=count))
    for queue, paused_at in PausedQueue.objects.using(using).values_list("queue", "paused_at"):
        stats[queue] = dataclasses.replace(stats.get(queue, QueueStats(queue)), paused_at=paused_at)
    return sorted(stats.values(), key=lambda item: item.queue)


def queue_overview_of(queues: Sequence[str]) -> list[QueueStats]:
    """Counts for ``queues``, in that order; a queue without jobs gets zeros."""
    stats = {item.queue: item for item in queue_overview()}
    return [stats.get(queue, QueueStats(queue)) for queue in dict.fromkeys(queues)]


def queues_over(stats: Iterable[QueueStats], limit: int) -> list[QueueStats]:
    """The queues holding more than ``limit`` jobs not yet done."""
    return [item for item in stats if item.size > limit]


def live_workers(max_age: float | None = None) -> QuerySet[QueueWorker]:
    """The workers seen within ``max_age`` seconds of the database's clock (default:
    ``workers.dead_after()``, three beats: the age at which a worker counts as dead)."""
    if max_age is None:
        max_age = workers.dead_after()
    return QueueWorker.objects.filter(last_seen_at__gte=DbNow() - timedelta(seconds=max_age))


def served_queues(max_age: float | None = None) -> set[str]:
    """The queues that at least one live worker serves."""
    served: set[str] = set()
    for queues in live_workers(max_age).values_list("queues", flat=True):
        served.update(queue for queue in queues.split(",") if queue)
    return served


def unserved(stats: Iterable[QueueStats], max_age: float | None = None) -> list[QueueStats]:
    """The queues among ``stats`` that have waiting jobs and no live worker serving them."""
    waiting = [item for item in stats if item.waiting]
    if not waiting:
        return []
    served = served_queues(max_age)
    return [item for item in waiting if item.queue not in served]


def delete_unreserved(ids: Sequence[int]) -> list[Job]:
    """Delete the jobs among ``ids`` that no worker has reserved; return the rows deleted.

    A reserved job is left alone: its worker may be running it, and deleting it
    would drop its outcome and, in a chain, the steps still to run.
    """
    return lifecycle.delete_unreserved(ids)


def cancel_jobs(ids: Iterable[int], *, hard: bool = False, reason: str = "") -> dict[int, str]:
    """Cancel jobs by id; return each id's outcome (see ``lifecycle.cancel``): ``cancelled``,
    ``requested``, or ``missing`` (no such job is waiting or running)."""
    return {pk: lifecycle.cancel(pk, hard=hard, reason=reason) for pk in dict.fromkeys(ids)}


def run_now(jobs: QuerySet[Job]) -> int:
    """Make unreserved jobs available at once; return how many."""
    return lifecycle.run_now(jobs)


def release_expired(jobs: QuerySet[Job] | None = None) -> int:
    """Reclaim the expired reservations among ``jobs`` (all jobs if None); return how many."""
    ids = list(jobs.values_list("pk", flat=True)) if jobs is not None else None
    return lifecycle.reclaim_expired(ids=ids)


def retry_failed(
    failed: QuerySet[FailedJob],
    *,
    chunk_size: int = RETRY_CHUNK,
    progress: Callable[[int], object] | None = None,
) -> int:
    """Put failed jobs back as fresh jobs and remove their failed rows, a chunk per transaction; return how many.

    The selection is walked in id order, ``chunk_size`` ids at a time, so memory
    stays bounded whatever its size. ``progress`` is called after each chunk with
    the number retried so far; if it (or anything) raises, the chunks done stay
    retried and the rest stay failed.
    """
    retried = 0
    for chunk in _id_chunks(failed, chunk_size):
        retried += len(lifecycle.retry(FailedJob.objects.filter(pk__in=chunk)))
        if progress is not None:
            progress(retried)
    analyze_if_large(failed.db, retried)
    return retried


def _id_chunks(selection: QuerySet[FailedJob], chunk_size: int) -> Iterator[list[int]]:
    """The ids of ``selection`` in ascending order, ``chunk_size`` at a time (keyset pagination).

    Each chunk is read after the one before was used, so rows the caller deleted
    are not read again and no list of every id is built.
    """
    limit = connections[selection.db].features.max_query_params
    size = max(1, min(chunk_size, limit) if limit else chunk_size)
    ordered = selection.order_by("pk")
    last: int | None = None
    while True:
        page = ordered if last is None else ordered.filter(pk__gt=last)
        chunk = list(page.values_list("pk", flat=True)[:size])
        if not chunk:
            return
        yield chunk
        if len(chunk) < size:
            return
        last = chunk[-1]


def failed_older_than(hours: float) -> QuerySet[FailedJob]:
    return FailedJob.objects.filter(failed_at__lt=DbNow() - timedelta(hours=hours))


def failed_jobs(*, queue: str | None = None, name: str | None = None) -> FailedJobQuerySet:
    """Failed jobs, newest first; only those of ``queue`` and ``name`` when given."""
    failed = FailedJob.objects.get_queryset()
    if queue is not None:
        failed = failed.filter(queue=queue)
    if name is not None:
        failed = failed.filter(name=name)
    return failed.order_by("-failed_at", "-id")


def retry_failed_ids(ids: Sequence[int]) -> int:
    """Retry the failed jobs with these ids, all or none, in one transaction; return how many.

    Raise ``FailedJobsNotFound`` naming the ids that do not exist; then nothing is retried.
    """
    with transaction.atomic(using=alias()):
        return sum(retry_failed(failed) for failed in _all_failed(ids))


def delete_failed_ids(ids: Sequence[int]) -> int:
    """Delete the failed jobs with these ids, all or none; return how many.

    Raise ``FailedJobsNotFound`` naming the ids that do not exist; then nothing is deleted.
    """
    with transaction.atomic(using=alias()):
        return sum(failed.delete()[0] for failed in _all_failed(ids))


@dataclasses.dataclass(frozen=True)
class Prunable:
    """The failed jobs older than ``hours`` (all if None), counted before ``prune_failed`` deletes them."""

    hours: float | None
    count: int
    # Highest id counted, so jobs that fail after the count are not deleted.
    last_id: int | None


def prunable(hours: float | None = None) -> Prunable:
    """Count the failed jobs older than ``hours`` (all of them if None)."""
    failed = failed_older_than(hours) if hours is not None else FailedJob.objects.all()
    found = failed.order_by().aggregate(count=Count("id"), last_id=Max("id"))
    return Prunable(hours, found["count"], found["last_id"])


def prune_failed(hours: float | None = None, *, counted: Prunable | None = None) -> int:
    """Delete the failed jobs older than ``hours`` (all of them if None); return how many.

    With ``counted``, only those counted are deleted: not the jobs that failed since.
    """
    if counted is not None:
        if counted.last_id is None:
            return 0
        hours = counted.hours
    failed = failed_older_than(hours) if hours is not None else FailedJob.objects.all()
    if counted is not None:
        failed = failed.filter(id__lte=counted.last_id)
    deleted, _ = failed.delete()
    return deleted


def _all_failed(ids: Sequence[int]) -> list[FailedJobQuerySet]:
    """The failed jobs with these ids, a few ids per query, locked until the transaction ends.

    Raise ``FailedJobsNotFound`` if one is missing.
    """
    groups = [FailedJob.objects.get_queryset().filter(condition) for condition in _pk_conditions(ids)]
    found: set[int] = set()
    for failed in groups:
        found.update(failed.select_for_update().values_list("pk", flat=True))
    missing = [pk for pk in ids if pk not in found]
    if missing:
        which = f"id {missing[0]}" if len(missing) == 1 else f"ids {format_ids(missing)}"
        raise FailedJobsNotFound(f"no failed job has the {which}", missing)
    return groups


@dataclasses.dataclass(frozen=True)
class Clearable:
    """The waiting and delayed jobs of a queue, counted before ``clear_queue`` deletes them."""

    queue: str
    count: int
    # Highest id counted, so jobs enqueued after the count are not deleted.
    last_id: int | None


def clearable(queue: str) -> Clearable:
    """Count the waiting and delayed (not reserved) jobs of ``queue``."""
    found = (
        Job.objects.filter(queue=queue, reserved_at__isnull=True)
        .order_by()
        .aggregate(count=Count("id"), last_id=Max("id"))
    )
    return Clearable(queue, found["count"], found["last_id"])


def clear_queue(counted: Clearable) -> int:
    """Delete the jobs ``counted`` that are still waiting or delayed; return how many.

    Reserved jobs stay, and so do jobs enqueued after the count.
    """
    if counted.last_id is None:
        return 0
    return lifecycle.delete_waiting(counted.queue, counted.last_id)


_ID_RANGE = re.compile(r"^(\d+)(?:-(\d+))?$")


def parse_ids(specs: list[str]) -> list[int]:
    """Turn ``["3", "5-7", "9,10"]`` into ``[3, 5, 6, 7, 9, 10]``; raise ValueError naming a bad part."""
    ids: list[int] = []
    for spec in specs:
        for part in spec.split(","):
            match = _ID_RANGE.match(part.strip())
            if not match:
                raise ValueError(f"{part.strip()!r} is not an id or a range like 5-9")
            start, end = int(match[1]), int(match[2] or match[1])
            if end < start:
                raise ValueError(f"{part.strip()!r} is a range that ends before it starts")
            if end - start > 1_000_000:
                raise ValueError(f"{part.strip()!r} spans more than a million ids")
            ids.extend(range(start, end + 1))
    return list(dict.fromkeys(ids))


def format_ids(ids: Iterable[int], *, most: int = 10) -> str:
    """Write ids as ``parse_ids`` reads them, ranges joined: ``[3, 5, 6, 7]`` gives ``"3, 5-7"``.

    Only the first ``most`` parts are written, then how many more there are.
    """
    parts = [str(start) if start == end else f"{start}-{end}" for start, end in _id_runs(ids)]
    more = f" and {len(parts) - most} more" if len(parts) > most else ""
    return ", ".join(parts[:most]) + more


def _id_runs(ids: Iterable[int]) -> list[tuple[int, int]]:
    """Runs of consecutive ids, sorted: ``[7, 1, 2, 3]`` gives ``[(1, 3), (7, 7)]``."""
    runs: list[tuple[int, int]] = []
    for pk in sorted(set(ids)):
        if runs and pk == runs[-1][1] + 1:
            runs[-1] = (runs[-1][0], pk)
        else:
            runs.append((pk, pk))
    return runs


def _pk_conditions(ids: Iterable[int], most: int = IDS_PER_QUERY) -> list[Q]:
    """Conditions that together select ``ids``, each with at most ``most`` parameters.

    Each run of consecutive ids is one BETWEEN, so 1-100000 is two parameters.
    """
    conditions: list[Q] = []
    singles: list[int] = []
    ranges: list[tuple[int, int]] = []

    def flush() -> None:
        condition = Q(pk__in=list(singles)) if singles else Q()
        for start, end in ranges:
            condition |= Q(pk__range=(start, end))
        conditions.append(condition)
        singles.clear()
        ranges.clear()

    for start, end in _id_runs(ids):
        if len(singles) + 2 * len(ranges) + (1 if start == end else 2) > most:
            flush()
        if start == end:
            singles.append(start)
        else:
            ranges.append((start, end))
    if singles or ranges:
        flush()
    return conditions


def request_restart() -> datetime:
    """Ask every worker, on every host, to finish its current job and exit."""
    with transaction.atomic(using=alias()):
        marker, _ = QueueControl.objects.update_or_create(key=RESTART_KEY, defaults={"updated_at": DbNow()})
    marker.refresh_from_db(fields=["updated_at"], using=marker._state.db)
    updated_at: datetime = marker.updated_at
    return updated_at


def restart_marker() -> datetime | None:
    """When a restart was last requested, or None."""
    return QueueControl.objects.filter(key=RESTART_KEY).values_list("updated_at", flat=True).first()
