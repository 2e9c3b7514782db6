"""Live workers: one ``QueueWorker`` row per worker process, so operators (and
``queue_monitor``) can tell which queues someone serves.

A worker writes its row when it starts, its heartbeat thread refreshes
``last_seen_at`` every ``SEEN_INTERVAL`` seconds, and the worker deletes it when
it stops. A killed worker leaves its row behind: it stops being live after
``LIVE_FOR`` seconds and idle workers prune it after ``PRUNE_AFTER``.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Sequence
from datetime import timedelta

from .db import DbNow
from .models import QueueWorker

# Seconds between two refreshes of a worker's row.
SEEN_INTERVAL = 10.0
# A row not refreshed for this many seconds belongs to a worker that is gone.
LIVE_FOR = 60.0
# Seconds after which idle workers delete the rows of workers that are gone.
PRUNE_AFTER = 3600.0


def register(worker_id: str, queues: Sequence[str]) -> None:
    """Write (or overwrite) the row of this worker process."""
    QueueWorker.objects.update_or_create(
        worker_id=worker_id,
        defaults={
            "hostname": socket.gethostname()[:100],
            "pid": os.getpid(),
            "queues": ",".join(queues),
            "started_at": DbNow(),
            "last_seen_at": DbNow(),
        },
    )


def seen(worker_id: str, queues: Sequence[str]) -> None:
    """Refresh the row's ``last_seen_at``; write it again if it was pruned meanwhile."""
    if not QueueWorker.objects.filter(worker_id=worker_id).update(last_seen_at=DbNow()):
        register(worker_id, queues)


def unregister(worker_id: str) -> None:
    QueueWorker.objects.filter(worker_id=worker_id).delete()


def prune(seconds: float = PRUNE_AFTER) -> int:
    """Delete the rows of workers not seen for ``seconds``; return how many."""
    deleted, _ = QueueWorker.objects.filter(last_seen_at__lt=DbNow() - timedelta(seconds=seconds)).delete()
    return deleted
