"""What operators do to the queue; shared by the admin and the management commands."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable, Sequence
from datetime import datetime, timedelta
from typing import Any

from django.db import transaction
from django.db.models import Count, Max, Min, Q, QuerySet

from . import bulk, conf, enqueue, lifecycle, registry, rows, workers
from .db import DbNow, alias, read_back
from .exceptions import FailedJobsNotFound
from .models import FailedJob, FailedJobQuerySet, FinishedJob, Job, PausedQueue, QueueControl, QueueWorker
from .registry import Handle

RESTART_KEY = "restart"
# Failed jobs retried per transaction (bulk.py): bounded memory and lock time, and an interrupted
# retry leaves each job retried or still failed.
RETRY_CHUNK = bulk.CHUNK
# Query parameters per statement when selecting by explicit ids: far under every database's limit.
IDS_PER_QUERY = 1000


def job_state(job: Job, now: datetime | None) -> str:
    """Where a job is, in words (``Job.state``)."""
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
    """Counts per queue, and the paused queues (with or without jobs), read on ``read_alias()``."""
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
        counts = {"failed": failed.get(row["queue"], 0), "oldest_waiting_seconds": age, "blocked": row["held"]}
        stats[row["queue"]] = QueueStats(row["queue"], row["waiting"], row["delayed"], row["reserved"], **counts)
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
    """The workers seen within ``max_age`` seconds of the database's clock (default: ``workers.dead_after()``)."""
    seconds = workers.dead_after() if max_age is None else max_age
    return QueueWorker.objects.filter(last_seen_at__gte=DbNow() - timedelta(seconds=seconds))


def served_queues(max_age: float | None = None) -> set[str]:
    """The queues that at least one live worker serves."""
    served: set[str] = set()
    for queues in live_workers(max_age).values_list("queues", flat=True):
        served.update(queue for queue in queues.split(",") if queue)
    return served


def unserved(stats: Iterable[QueueStats], max_age: float | None = None) -> list[QueueStats]:
    """The queues among ``stats`` that have waiting jobs and no live worker serving them."""
    waiting = [item for item in stats if item.waiting]
    served = served_queues(max_age) if waiting else set()
    return [item for item in waiting if item.queue not in served]


# The admin's actions, named here with the commands' operations.
delete_unreserved = lifecycle.delete_unreserved
run_now = lifecycle.run_now
# Retry a selection of failed jobs, a chunk per transaction (bulk.py, with the bulk actions on a filter).
retry_failed = bulk.retry_failed


def cancel_jobs(ids: Iterable[int], *, hard: bool = False, reason: str = "") -> dict[int, str]:
    """Cancel jobs by id; return each id's outcome: ``cancelled``, ``requested`` or ``missing``."""
    return {pk: lifecycle.cancel(pk, hard=hard, reason=reason) for pk in dict.fromkeys(ids)}


def release_expired(jobs: QuerySet[Job] | None = None) -> int:
    """Reclaim the expired reservations among ``jobs`` (all jobs if None); return how many."""
    ids = list(jobs.values_list("pk", flat=True)) if jobs is not None else None
    return lifecycle.reclaim_expired(ids=ids)


def _failed_older_than(hours: float | None) -> QuerySet[FailedJob]:
    """The failed jobs older than ``hours``; all of them if None."""
    if hours is None:
        return FailedJob.objects.all()
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
    """Retry the failed jobs with these ids in one transaction; if one is missing, raise ``FailedJobsNotFound``."""
    with transaction.atomic(using=alias()):
        return sum(retry_failed(failed) for failed in _all_failed(ids))


def delete_failed_ids(ids: Sequence[int]) -> int:
    """Delete the failed jobs with these ids in one transaction; if one is missing, raise ``FailedJobsNotFound``."""
    with transaction.atomic(using=alias()):
        return sum(failed.delete()[0] for failed in _all_failed(ids))


def enqueue_again(ids: Sequence[int]) -> list[Handle]:
    """Enqueue each finished run among ``ids`` (``FinishedJob``) again, as a new job with the same
    arguments and its definition's options of today, in one transaction; return the handles (of
    a unique job whose key another holds: that job's). ``ValueError`` names a row that cannot be:
    its job no longer registered, or its payload unreadable."""
    steps = []
    for row in FinishedJob.objects.filter(pk__in=ids).order_by("id"):
        definition = registry.find(row.name)
        if definition is None:
            raise ValueError(f"finished job {row.pk} cannot be enqueued again: no job is registered as {row.name!r}")
        envelope = row.payload
        if not (
            isinstance(envelope, dict)
            and isinstance(envelope.get("args"), list)
            and isinstance(envelope.get("kwargs"), dict)
        ):
            raise ValueError(f"finished job {row.pk} cannot be enqueued again: its arguments were not kept readable")
        step = {
            "name": row.name, "queue": row.queue, "priority": definition.priority, "tries": definition.tries,
            "retry_after": definition.retry_after or int(conf.get("RETRY_AFTER")), "timeout": definition.timeout,
            "args": envelope["args"], "kwargs": envelope["kwargs"],
            **{key: envelope[key] for key in ("backoff", "flow", "retry_until", "max_exceptions") if key in envelope},
        }  # fmt: skip
        steps.append(step)
    with transaction.atomic(using=alias()):
        return [enqueue.store(rows.new_job(step)) for step in steps]


@dataclasses.dataclass(frozen=True)
class Prunable:
    """The failed jobs older than ``hours`` (all if None), counted before ``prune_failed`` deletes them."""

    hours: float | None
    count: int
    # Highest id counted, so jobs that fail after the count are not deleted.
    last_id: int | None


def prunable(hours: float | None = None) -> Prunable:
    """Count the failed jobs older than ``hours`` (all of them if None)."""
    return Prunable(hours, *_count(_failed_older_than(hours)))


def prune_failed(hours: float | None = None, *, counted: Prunable | None = None) -> int:
    """Delete the failed jobs older than ``hours`` (all if None), or only those ``counted``; return how many."""
    if counted is None:
        return _failed_older_than(hours).delete()[0]
    if counted.last_id is None:
        return 0
    return _failed_older_than(counted.hours).filter(id__lte=counted.last_id).delete()[0]


def _count(selected: QuerySet[Any]) -> tuple[int, int | None]:
    """How many rows ``selected`` has, and the highest id among them."""
    found = selected.order_by().aggregate(count=Count("id"), last_id=Max("id"))
    return found["count"], found["last_id"]


def _all_failed(ids: Sequence[int]) -> list[FailedJobQuerySet]:
    """The failed jobs with these ids, a few per query, locked; raise ``FailedJobsNotFound`` if one is missing."""
    groups = [FailedJob.objects.get_queryset().filter(condition) for condition in _pk_conditions(ids)]
    found: set[int] = set()
    for failed in groups:
        found.update(failed.select_for_update().values_list("pk", flat=True))
    missing = [pk for pk in ids if pk not in found]
    if missing:
        raise FailedJobsNotFound(f"no failed job has the {which_ids(missing)}", missing)
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
    return Clearable(queue, *_count(Job.objects.filter(queue=queue, reserved_at__isnull=True)))


def clear_queue(counted: Clearable) -> int:
    """Delete the jobs ``counted`` that are still waiting or delayed (not those enqueued since); return how many."""
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
    """Write ids as ``parse_ids`` reads them (``[3, 5, 6, 7]``: ``"3, 5-7"``), then how many more past ``most``."""
    parts = [str(start) if start == end else f"{start}-{end}" for start, end in _id_runs(ids)]
    more = f" and {len(parts) - most} more" if len(parts) > most else ""
    return ", ".join(parts[:most]) + more


def which_ids(ids: Sequence[int]) -> str:
    """``id 3``, or ``ids 3, 5-7``: the ids a refusal names."""
    return f"id {ids[0]}" if len(ids) == 1 else f"ids {format_ids(ids)}"


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
    """Conditions that together select ``ids``, each with at most ``most`` parameters (a run of ids is one BETWEEN)."""
    groups: list[list[tuple[int, int]]] = []
    used = most
    for start, end in _id_runs(ids):
        cost = 1 if start == end else 2
        if used + cost > most:
            groups.append([])
            used = 0
        groups[-1].append((start, end))
        used += cost
    return [_pk_condition(runs) for runs in groups]


def _pk_condition(runs: list[tuple[int, int]]) -> Q:
    singles = [start for start, end in runs if start == end]
    condition = Q(pk__in=singles) if singles else Q()
    for start, end in runs:
        if start != end:
            condition |= Q(pk__range=(start, end))
    return condition


def request_restart() -> datetime:
    """Ask every worker, on every host, to finish its current job and exit."""
    with transaction.atomic(using=alias()):
        marker, _ = QueueControl.objects.update_or_create(key=RESTART_KEY, defaults={"updated_at": DbNow()})
    read_back(marker, "updated_at")
    updated_at: datetime = marker.updated_at
    return updated_at


def restart_marker() -> datetime | None:
    """When a restart was last requested, or None."""
    return QueueControl.objects.filter(key=RESTART_KEY).values_list("updated_at", flat=True).first()
