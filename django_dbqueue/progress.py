"""Progress of jobs and chains, readable from any process.

Writes go through a connection of their own, so a progress write is never
rolled back with the job's transaction, and never fails the job: errors are
logged and dropped. Rows are upserts on ``key``; the last writer wins.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from datetime import timedelta
from typing import Any

from django.core import signing
from django.db import DatabaseError, connections
from django.db.models.constants import OnConflict
from django.db.models.sql import InsertQuery

from . import conf
from .db import DbNow, alias, error_text
from .errors import clean
from .models import JobBatch, JobProgress

logger = logging.getLogger("django_dbqueue")
_local = threading.local()
_UPDATE_FIELDS = ("percent", "stage", "finished", "failed", "error", "updated_at")
# Dedicated to progress tokens, so no other value signed with SECRET_KEY can pass for one.
TOKEN_SALT = "django_dbqueue.progress"


class _SharedWriter:
    """One progress connection for all the threads of a pooled worker (``share_writer``)."""

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.wrapper: Any = None


_shared: _SharedWriter | None = None


@contextmanager
def share_writer() -> Iterator[None]:
    """Make every thread write progress through one connection, one write at a time, until the block
    ends: a worker running N jobs at once keeps one progress connection, not N."""
    global _shared
    _shared = _SharedWriter()
    try:
        yield
    finally:
        shared, _shared = _shared, None
        if shared.wrapper is not None:
            with shared.lock, suppress(DatabaseError):
                shared.wrapper.close()


def _writer() -> Any:
    """This thread's own connection to the queue's database (or the pool's shared one, see
    ``share_writer``): outside Django's ``connections``, so in no transaction of the job's."""
    if _shared is not None:
        if _shared.wrapper is None:
            _shared.wrapper = connections.create_connection(alias())
            _shared.wrapper.inc_thread_sharing()
        return _shared.wrapper
    if getattr(_local, "wrapper", None) is None:
        _local.wrapper = connections.create_connection(alias())
    return _local.wrapper


def close_writer() -> None:
    if _shared is not None:
        return  # kept for the pool's life
    wrapper = getattr(_local, "wrapper", None)
    _local.wrapper = None
    if wrapper is not None:
        with suppress(DatabaseError):
            wrapper.close()


@contextmanager
def keep_writer() -> Iterator[None]:
    """Keep the progress connection open for the writes of one job run, then close it."""
    _local.keep = True
    try:
        yield
    finally:
        _local.keep = False
        close_writer()


def clamp(percent: float) -> float:
    """``percent`` within 0..100, rounded to hundredths (a chain's shares are fractions)."""
    return round(max(0.0, min(100.0, float(percent))), 2)


_offload_lock = threading.Lock()
_offload: concurrent.futures.ThreadPoolExecutor | None = None


def set_progress(
    key: str, percent: float, stage: str = "", *, finished: bool = False, failed: bool = False, error: str = ""
) -> bool:
    """Store the progress of ``key``; return False (and log) if it could not be stored.
    On a running event loop (an ``async def`` job) the write is handed to a thread: True means queued."""
    global _offload
    if asyncio._get_running_loop() is not None:
        # An ``async def`` job must not block the worker's loop, and Django refuses sync database
        # calls there. One thread, so writes keep their order.
        with _offload_lock:
            if _offload is None:
                _offload = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="dbqueue-progress")
        _offload.submit(set_progress, key, percent, stage, finished=finished, failed=failed, error=error)
        return True
    row = JobProgress(
        key=key,
        percent=clamp(percent),
        stage=stage[:200],
        finished=finished,
        failed=failed,
        # Callers outside the worker may pass raw exception text.
        error=clean(error),
        updated_at=DbNow(),
    )
    shared = _shared
    try:
        if shared is not None:
            shared.lock.acquire()
        wrapper = _writer()
        meta = JobProgress._meta
        with_target = wrapper.features.supports_update_conflicts_with_target
        query = InsertQuery(
            JobProgress,
            on_conflict=OnConflict.UPDATE,
            update_fields=[meta.get_field(name) for name in _UPDATE_FIELDS],
            # MySQL's ON DUPLICATE KEY UPDATE names no target; the unique key is implied.
            unique_fields=[meta.get_field("key")] if with_target else [],
        )
        query.insert_values([f for f in meta.concrete_fields if not f.primary_key], [row])
        query.get_compiler(connection=wrapper).execute_sql()
    except DatabaseError as exc:
        logger.warning("progress not stored key=%s: %s", key, error_text(exc))
        if shared is not None and shared.wrapper is not None:
            # Opened afresh by the next write.
            broken, shared.wrapper = shared.wrapper, None
            with suppress(DatabaseError):
                broken.close()
        close_writer()
        return False
    finally:
        if shared is not None:
            shared.lock.release()
        elif not getattr(_local, "keep", False):
            close_writer()
    return True


def get_progress(key: str) -> dict[str, Any] | None:
    """Return the progress stored under ``key`` as a dict, or None. ``batch:<id>`` is a batch's, read from
    its counters, with ``total``, ``done``, ``pending``, ``failed_members``, ``cancelled_members`` and ``state``."""
    if key.startswith("batch:"):
        return _batch_progress(key)
    row = JobProgress.objects.filter(key=key).values("key", *_UPDATE_FIELDS).first()
    if row is not None:
        row["updated_at"] = row["updated_at"].isoformat()
    return row


def _batch_progress(key: str) -> dict[str, Any] | None:
    batch_id = key.partition(":")[2]
    # ASCII digits only: str.isdigit also takes "²", which int() refuses.
    row = JobBatch.objects.filter(pk=int(batch_id)).first() if batch_id.isascii() and batch_id.isdigit() else None
    if row is None:
        return None
    finished = row.finished_at is not None
    return {
        "key": key,
        "percent": row.percent,
        "stage": row.state if finished or row.cancelled_at else f"{row.done} of {row.total} done",
        "finished": finished,
        # As for a chain: the batch ended with failures (failed_members counts them meanwhile).
        "failed": finished and bool(row.failed),
        "error": "",
        "updated_at": (row.finished_at or row.cancelled_at or row.created_at).isoformat(),
        "total": row.total,
        "done": row.done,
        "pending": row.pending,
        "failed_members": row.failed,
        "cancelled_members": row.cancelled,
        "state": row.state,
    }


def progress_token(key: str | int) -> str:
    """Return a signed token that lets its bearer read the progress of ``key`` (a job id or ``chain:<id>``),
    and of no other key, for ``PROGRESS_TOKEN_MAX_AGE`` seconds; hand it only to the user who enqueued the job."""
    return signing.dumps(str(key), salt=TOKEN_SALT)


def key_from_token(token: str) -> str:
    """Return the key a progress token names; raise ``signing.BadSignature`` if it is forged, or its
    subclass ``signing.SignatureExpired`` if it expired."""
    key = signing.loads(token, salt=TOKEN_SALT, max_age=conf.get("PROGRESS_TOKEN_MAX_AGE"))
    if not isinstance(key, str):
        raise signing.BadSignature("a progress token names a key")
    return key


def shown_error(error: str) -> str:
    """Return the error text the progress view may serve: its last line, or nothing unless ``PROGRESS_SHOW_ERROR``."""
    return _last_line(error) if conf.get("PROGRESS_SHOW_ERROR") else ""


def prune(hours: float) -> int:
    """Delete progress rows not updated for ``hours``; return how many."""
    deleted, _ = JobProgress.objects.filter(updated_at__lt=DbNow() - timedelta(hours=hours)).delete()
    return deleted


class Tracker:
    """Progress for one run of a job: the job's own key, or its chain's."""

    def __init__(self, job_id: int, chain: dict[str, Any] | None) -> None:
        self.chain = chain
        self.key = f"chain:{chain['id']}" if chain else str(job_id)
        self.reported = False
        self.pending: tuple[float, str] | None = None

    def overall(self, percent: float) -> float:
        """A step's percent as a percent of the whole chain."""
        if not self.chain:
            return clamp(percent)
        step, total = int(self.chain["step"]), max(int(self.chain["total"]), 1)
        return clamp(((step - 1) + clamp(percent) / 100) / total * 100)

    def report(self, percent: float, stage: str = "") -> None:
        self.reported = True
        queue_connection = connections[alias()]
        if queue_connection.vendor == "sqlite" and queue_connection.in_atomic_block:
            # SQLite has one writer, and the job's transaction holds it: a second
            # connection would wait for it. Write when the job's transaction is over.
            self.pending = (self.overall(percent), stage)
            return
        set_progress(self.key, self.overall(percent), stage)

    def flush(self) -> None:
        """Write progress held back while the job was in a transaction (SQLite)."""
        if self.pending is not None:
            percent, stage = self.pending
            self.pending = None
            set_progress(self.key, percent, stage)

    def succeeded(self) -> None:
        """Mark the end of a step: finished if it was the last, else the step done."""
        self.pending = None
        if self.chain:
            step, total = int(self.chain["step"]), int(self.chain["total"])
            last = step >= total
            set_progress(
                self.key, self.overall(100), "finished" if last else f"step {step} of {total} done", finished=last
            )
        elif self.reported:
            set_progress(self.key, 100, "finished", finished=True)

    def failed(self, error: str) -> None:
        self.flush()
        if self.chain or self.reported:
            try:
                current = get_progress(self.key)
            except DatabaseError as exc:
                logger.warning("progress not read key=%s: %s", self.key, error_text(exc))
                current = None
            at = current["percent"] if current else 0
            set_progress(self.key, at, "failed", failed=True, error=_last_line(error))


def _last_line(error: str) -> str:
    """The line that names the exception: the last non-empty line of a traceback."""
    lines = [line.strip() for line in error.strip().splitlines() if line.strip()]
    return lines[-1][:500] if lines else ""
