"""What operators do to the queue; shared by the admin and the management commands."""

from __future__ import annotations

import dataclasses
import re
from datetime import datetime, timedelta

from django.db import transaction
from django.db.models import Count, Min, Q, QuerySet

from .db import DbNow
from .models import FailedJob, Job, QueueControl

RESTART_KEY = "restart"


def job_state(job: Job, now: datetime | None) -> str:
    """One word for where a job is: waiting, delayed, reserved or reservation expired."""
    if job.reserved_at is not None:
        if now is not None and job.reserved_at + timedelta(seconds=job.retry_after) <= now:
            return "reservation expired"
        return "reserved"
    if now is not None and job.available_at > now:
        return "delayed"
    return "waiting"


@dataclasses.dataclass(frozen=True)
class QueueStats:
    queue: str
    waiting: int = 0
    delayed: int = 0
    reserved: int = 0
    failed: int = 0
    oldest_waiting_seconds: float | None = None

    @property
    def size(self) -> int:
        """Jobs not yet done: waiting, delayed and reserved."""
        return self.waiting + self.delayed + self.reserved


def queue_overview() -> list[QueueStats]:
    """Counts per queue, from two grouped queries."""
    now = DbNow()
    waiting = Q(reserved_at__isnull=True, available_at__lte=now)
    rows = (
        Job.objects.order_by()
        .values("queue")
        .annotate(
            waiting=Count("id", filter=waiting),
            delayed=Count("id", filter=Q(reserved_at__isnull=True, available_at__gt=now)),
            reserved=Count("id", filter=Q(reserved_at__isnull=False)),
            oldest=Min("available_at", filter=waiting),
            clock=Min(now),
        )
    )
    failed = dict(FailedJob.objects.order_by().values("queue").annotate(n=Count("id")).values_list("queue", "n"))
    stats = {}
    for row in rows:
        oldest = row["oldest"]
        age = max((row["clock"] - oldest).total_seconds(), 0.0) if oldest is not None else None
        stats[row["queue"]] = QueueStats(row["queue"], row["waiting"], row["delayed"], row["reserved"],
                                         failed.get(row["queue"], 0), age)
    for queue, count in failed.items():
        stats.setdefault(queue, QueueStats(queue, failed=count))
    return sorted(stats.values(), key=lambda item: item.queue)


def run_now(jobs: QuerySet[Job]) -> int:
    """Make unreserved jobs available at once; return how many."""
    return jobs.filter(reserved_at__isnull=True).update(available_at=DbNow())


def release_expired(jobs: QuerySet[Job] | None = None) -> int:
    """Reclaim the expired reservations among ``jobs`` (all jobs if None); return how many."""
    ids = list(jobs.values_list("pk", flat=True)) if jobs is not None else None
    return Job.objects.reclaim_expired(ids=ids)


def retry_failed(failed: QuerySet[FailedJob]) -> list[Job]:
    """Put failed jobs back as fresh jobs and remove their failed rows, in one transaction."""
    return FailedJob.objects.retry(failed.values_list("pk", flat=True))


def failed_older_than(hours: float) -> QuerySet[FailedJob]:
    return FailedJob.objects.filter(failed_at__lt=DbNow() - timedelta(hours=hours))


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


def request_restart() -> datetime:
    """Ask every worker, on every host, to finish its current job and exit."""
    with transaction.atomic(using=QueueControl.objects.db):
        marker, _ = QueueControl.objects.update_or_create(key=RESTART_KEY, defaults={"updated_at": DbNow()})
    marker.refresh_from_db(fields=["updated_at"])
    updated_at: datetime = marker.updated_at
    return updated_at


def restart_marker() -> datetime | None:
    """When a restart was last requested, or None."""
    return QueueControl.objects.filter(key=RESTART_KEY).values_list("updated_at", flat=True).first()
