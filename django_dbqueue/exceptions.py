"""Exceptions raised by django-dbqueue."""

from __future__ import annotations


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


class MaxAttemptsExceeded(DbQueueError):
    """A reservation expired on a job that had used its tries."""


class WorkerLost(DbQueueError):
    """The worker process that held a job died."""


class FailedJobsNotFound(DbQueueError, LookupError):
    """Some of the failed job ids asked for do not exist."""

    def __init__(self, message: str, ids: list[int]) -> None:
        super().__init__(message)
        self.ids = ids


class JobTimeout(BaseException):
    """Raised inside a job that ran past its timeout.

    A BaseException, so a job's ``except Exception`` does not swallow it.
    """


class WorkerStopped(BaseException):
    """Raised inside a job when the worker is told to stop a second time."""


# Errors that running the job again cannot fix: the job fails at once.
PERMANENT_ERRORS: tuple[type[BaseException], ...] = (JobNotRegistered, PayloadError)
