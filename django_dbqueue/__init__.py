"""A job queue for Django that lives in the project's own database."""

from .exceptions import JobNotRegistered, JobTimeout, PayloadError
from .registry import JobCall, JobContext, JobDefinition, enqueue_many, job

__all__ = [
    "JobCall",
    "JobContext",
    "JobDefinition",
    "JobNotRegistered",
    "JobTimeout",
    "PayloadError",
    "enqueue_many",
    "job",
]
