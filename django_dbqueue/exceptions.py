"""Exceptions raised by django-dbqueue."""

from __future__ import annotations

from datetime import timedelta

from .validation import MAX_SECONDS


class DbQueueError(Exception):
    """Base class of the queue's own errors."""


class JobNotRegistered(DbQueueError):
    """A job row names no registered job definition."""


class PayloadError(DbQueueError):
    """A job's payload cannot be decoded, or does not fit its job definition."""


class ModelReferenceMissing(PayloadError):
    """A model instance passed to a job no longer exists."""


class PayloadTooLarge(DbQueueError, ValueError):
    """A job's encoded payload is over ``DBQUEUE['MAX_PAYLOAD_SIZE']``; nothing was enqueued."""

    def __init__(self, message: str, *, name: str, size: int, limit: int) -> None:
        super().__init__(message)
        self.name = name
        self.size = size
        self.limit = limit


class UnknownQueue(DbQueueError, ValueError):
    """A job was enqueued into a queue that ``DBQUEUE['QUEUES']`` does not list; nothing was enqueued."""


class WaitTimeout(DbQueueError, TimeoutError):
    """``JobHandle.wait`` ran out of time before the job finished; the job was left as it was."""

    def __init__(self, message: str, *, job_id: int, status: str) -> None:
        super().__init__(message)
        self.job_id = job_id
        self.status = status


class MaxAttemptsExceeded(DbQueueError):
    """A reservation expired on a job that had used its tries."""


class WorkerLost(DbQueueError):
    """The worker process that held a job died."""


class InvalidJobRow(DbQueueError):
    """A job row holds a value the worker cannot act on (written by hand, ``update()``, raw SQL
    or before the table's checks): it was moved to ``FailedJob`` unrun."""


class FailedJobsNotFound(DbQueueError, LookupError):
    """Some of the failed job ids asked for do not exist."""

    def __init__(self, message: str, ids: list[int]) -> None:
        super().__init__(message)
        self.ids = ids


class JobTimeout(BaseException):
    """Raised inside a job that ran past its timeout: a BaseException, which ``except Exception`` lets through."""


class JobCancelled(BaseException):
    """Raised inside a cancelled job by ``context.check_cancelled()`` and ``context.progress()``, or at
    once for a hard cancel; a BaseException like JobTimeout. The job moves to ``FailedJob`` as
    cancelled, with no retry and no ``on_failure`` callback."""


class Snooze(BaseException):
    """Raised by a job (or ``context.snooze(seconds)``) to run again after ``seconds`` without
    spending one of its tries; a BaseException like JobTimeout."""

    def __init__(self, seconds: float | timedelta = 0) -> None:
        self.seconds = snooze_seconds(seconds)
        # The seconds as the only argument, so a copy or an unpickled one is rebuilt alike.
        super().__init__(self.seconds)

    def __str__(self) -> str:
        return f"snoozed for {self.seconds:g} s"


def snooze_seconds(seconds: object) -> float:
    """Return ``seconds`` (a number or a timedelta) as a float; raise if it is no valid delay."""
    if isinstance(seconds, timedelta):
        seconds = seconds.total_seconds()
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)):
        raise TypeError(f"a snooze takes seconds (a number) or a timedelta, not {type(seconds).__name__}")
    # The database's date arithmetic holds at most MAX_SECONDS; NaN fails every comparison.
    if not 0 <= seconds <= MAX_SECONDS:
        raise ValueError(f"a snooze takes seconds from 0 to {MAX_SECONDS}, not {seconds!r}")
    return float(seconds)


class WorkerStopped(BaseException):
    """Raised inside a job when the worker is told to stop a second time."""


# Errors that running the job again cannot fix: the job fails at once.
PERMANENT_ERRORS: tuple[type[BaseException], ...] = (JobNotRegistered, PayloadError, JobCancelled)
