"""Live workers: one ``QueueWorker`` row per worker process (who serves which queues, how much
each did, what runs now). A worker writes it as it starts, its heartbeat refreshes it every
``beat_seconds()``, it deletes it as it stops. A row ``dead_after()`` old (database clock) is
dead: idle workers reclaim its jobs at once, and prune the row after ``PRUNE_AFTER``.
"""

from __future__ import annotations

import functools
import logging
import os
import resource
import secrets
import socket
import threading
import time
from collections.abc import Sequence
from datetime import timedelta

from django.db import DatabaseError
from django.db.models import Q

from . import about, concurrency, conf, finished, handles, history, lifecycle, progress, steps
from .db import DbNow, error_text
from .lifecycle import reclaim_worker
from .models import FlowLimit, Job, QueueWorker

logger = logging.getLogger("django_dbqueue")

# Seconds after which a row not refreshed belongs to a worker gone (``queue_monitor``).
LIVE_FOR = 60.0
# Seconds after which idle workers delete the rows of workers that are gone.
PRUNE_AFTER = 3600.0
# Beats a worker may miss before it counts as dead.
BEATS_TO_DEATH = 3

WORKER_LOST_ERROR = (
    "The worker {worker} that ran this job stopped beating (no sign of it for {seconds:.0f} s, "
    "three heartbeats): it was killed or cut off from the database, and the job had used its tries."
)


def beat_seconds() -> float:
    """Seconds between two refreshes of a worker's row."""
    return float(conf.get("WORKER_BEAT"))


def dead_after() -> float:
    """Seconds without a refresh after which a worker's row is dead, and its jobs reclaimed."""
    return BEATS_TO_DEATH * beat_seconds()


class Stats:
    """What a worker writes into its row with each beat (any thread writes, the heartbeat reads)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.processed = 0
        self.failed = 0
        # id -> (monotonic start, name); the text is made by the beat, not per job.
        self._running: dict[int, tuple[float, str]] = {}

    def started(self, job: Job) -> None:
        with self._lock:
            self._running[job.pk] = (time.monotonic(), history.shown_name(job))

    def stopped(self, job: Job) -> None:
        """The run of ``job`` ended (its outcome may wait for a batched DELETE)."""
        with self._lock:
            self._running.pop(job.pk, None)

    def ended(self, job: Job, *, failed: bool) -> None:
        """The outcome of ``job`` was stored."""
        with self._lock:
            self._running.pop(job.pk, None)
            self.processed += 1
            if failed:
                self.failed += 1

    def values(self) -> dict[str, object]:
        with self._lock:
            oldest = min(((since, pk, name) for pk, (since, name) in self._running.items()), default=None)
            return {
                "processed": self.processed,
                "failed": self.failed,
                "running": len(self._running),
                "current_job": f"{oldest[2]} #{oldest[1]}"[:255] if oldest else "",
            }


def new_worker_id(pid: int | None = None, token: str | None = None) -> str:
    """Return an id naming a worker process: host, pid and a random part."""
    return f"{socket.gethostname()[:60]}:{pid or os.getpid()}:{token or secrets.token_hex(3)}"


def memory_mb() -> float:
    """Resident memory of this process in MB."""
    try:
        with open("/proc/self/statm") as statm:
            pages = int(statm.read().split()[1])
        return pages * os.sysconf("SC_PAGE_SIZE") / 1024 / 1024
    except (OSError, ValueError, IndexError):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def hostname() -> str:
    """This machine's name as worker rows store it."""
    return socket.gethostname()[:100]


def register(worker_id: str, queues: Sequence[str], options: str = "", stats: Stats | None = None) -> None:
    """Write (or overwrite) the row of this worker process."""
    QueueWorker.objects.update_or_create(
        worker_id=worker_id,
        defaults={
            "hostname": hostname(),
            "pid": os.getpid(),
            "queues": ",".join(queues),
            "options": options[:200],
            "started_at": DbNow(),
            "last_seen_at": DbNow(),
            **(stats.values() if stats is not None else {}),
        },
    )


def seen(worker_id: str, queues: Sequence[str], options: str = "", stats: Stats | None = None) -> None:
    """Refresh the row's ``last_seen_at``, options and counts; write it again if it was pruned meanwhile."""
    values = {"options": options[:200], **(stats.values() if stats is not None else {})}
    if not QueueWorker.objects.filter(worker_id=worker_id).update(last_seen_at=DbNow(), **values):
        register(worker_id, queues, options, stats)


def unregister(worker_id: str) -> None:
    QueueWorker.objects.filter(worker_id=worker_id).delete()


def prune(seconds: float = PRUNE_AFTER) -> int:
    """Delete the rows of workers not seen for ``seconds``; return how many."""
    deleted, _ = QueueWorker.objects.filter(last_seen_at__lt=DbNow() - timedelta(seconds=seconds)).delete()
    return deleted


def dead_rows() -> Q:
    """Rows of workers that missed ``BEATS_TO_DEATH`` beats (by the database's clock)."""
    return Q(last_seen_at__lt=DbNow() - timedelta(seconds=dead_after()))


_reclaimed_at = 0.0


def reclaim_dead(*, default_tries: int | None = None) -> int:
    """Release or fail the jobs held by dead workers, at most once per beat per process; return how many."""
    global _reclaimed_at
    if time.monotonic() - _reclaimed_at < beat_seconds():
        return 0
    _reclaimed_at = time.monotonic()
    dead = list(
        QueueWorker.objects.filter(dead_rows(), last_seen_at__gte=DbNow() - timedelta(seconds=PRUNE_AFTER))
        .filter(worker_id__in=Job.objects.filter(reserved_at__isnull=False).values("reserved_by"))
        .annotate(silent_for=DbNow())
        .values_list("worker_id", "last_seen_at", "silent_for")
    )
    count = 0
    for worker_id, last_seen, now in dead:
        seconds = (now - last_seen).total_seconds()
        error = WORKER_LOST_ERROR.format(worker=worker_id, seconds=seconds)
        reclaimed = reclaim_worker(worker_id, error_for=functools.partial(_same, error), default_tries=default_tries)
        if reclaimed:
            logger.warning(
                "reclaimed jobs=%s of dead worker_id=%s silent_for=%.0fs (before their retry_after)",
                reclaimed,
                worker_id,
                seconds,
            )
        count += reclaimed
    return count


def postpone_reclaim() -> None:
    """Reclaim no dead worker's jobs in this process for ``dead_after()`` seconds: after an outage
    every row reads as dead until its worker's next beat."""
    global _reclaimed_at
    _reclaimed_at = max(_reclaimed_at, time.monotonic() + dead_after() - beat_seconds())


def _same(error: str, _seconds_held: float) -> str:
    return error


def forget_reclaim() -> None:
    """Let the next ``reclaim_dead`` look at once (tests)."""
    global _reclaimed_at
    _reclaimed_at = 0.0


# Hours after which rows pruned without a setting go (a flow-limit row unused for a day holds
# no slot, and its rate bucket is full again long before; a job reference has no age, it goes
# once its job is in no table).
FIXED_PRUNE_HOURS = {"worker rows": PRUNE_AFTER / 3600, "flow limit rows": 24.0, "job references": 0.0}


def prune_old_rows() -> None:
    """Delete old rows (an idle worker does, now and then): as ``DBQUEUE["PROGRESS_MAX_AGE"]``,
    ``["RESULT_MAX_AGE"]``, ``["STEP_MAX_AGE"]``, ``["WORKFLOW_MAX_AGE"]``, ``["HISTORY_MAX_AGE"]``,
    ``["KEEP_FINISHED"]`` and ``FIXED_PRUNE_HOURS`` say."""
    for setting, what, prune_rows in (
        ("PROGRESS_MAX_AGE", "progress rows", progress.prune),
        ("RESULT_MAX_AGE", "results", handles.prune_results),
        ("STEP_MAX_AGE", "step rows", steps.prune),
        ("WORKFLOW_MAX_AGE", "workflows", lifecycle.prune_workflows),
        (None, "worker rows", lambda hours: prune(hours * 3600)),
        ("HISTORY_MAX_AGE", "history rows", history.prune),
        ("KEEP_FINISHED", "finished jobs", finished.prune),
        (None, "flow limit rows", _prune_flow_limits),
        (None, "job references", lambda hours: about.prune()),
    ):
        max_age = conf.get(setting) if setting is not None else FIXED_PRUNE_HOURS[what]
        if max_age is None:
            continue
        try:
            count = prune_rows(float(max_age))
        except DatabaseError as exc:
            logger.warning("prune of %s failed: %s", what, error_text(exc))
            continue
        if count:
            logger.info("pruned %s=%s older_than_hours=%s", what.replace(" ", "_"), count, max_age)


def _prune_flow_limits(hours: float) -> int:
    return FlowLimit.objects.prune(older_than=timedelta(hours=hours), concurrency_prefix=concurrency.PREFIX)
