"""A job queue for Django that lives in the project's own database."""

from typing import TYPE_CHECKING, Any

from .exceptions import (
    JobCancelled,
    JobNotRegistered,
    JobTimeout,
    PayloadError,
    PayloadTooLarge,
    Snooze,
    UnknownQueue,
    WaitTimeout,
)
from .registry import Exponential, JobCall, JobDefinition, job
from .states import JobStatus, WorkflowState

if TYPE_CHECKING:  # loaded on first use, as the names of _LAZY (they import the models)
    from .about import jobs_for
    from .context import JobContext
    from .enqueue import enqueue_many
    from .workflows import CycleError, WorkflowBuilder, WorkflowHandle, enqueue_after, get_workflow, workflow

# The one place the version is written: pyproject.toml reads it (setuptools dynamic version).
__version__ = "0.1.0"

# Names whose modules import the models: loaded on first use, so importing
# ``django_dbqueue`` (for ``@job``) works before the app registry is ready.
_LAZY = {
    name: module
    for module, names in {
        "about": ("jobs_for",),
        "batches": ("Batch", "BatchClosed", "BatchHandle", "batch", "get_batch"),
        "chains": ("Chain", "chain"),
        "context": ("JobContext",),
        "enqueue": ("enqueue_many",),
        "handles": ("JobHandle", "aget_job", "get_job"),
        "pauses": ("pause_queue", "paused_queues", "resume_queue"),
        "progress": ("get_progress", "progress_token", "set_progress"),
        "schedules": ("periodic",),
        "workflows": ("CycleError", "WorkflowBuilder", "WorkflowHandle", "enqueue_after", "get_workflow", "workflow"),
    }.items()
    for name in names
}

__all__ = [
    "Batch",
    "BatchClosed",
    "BatchHandle",
    "Chain",
    "CycleError",
    "Exponential",
    "JobCall",
    "JobCancelled",
    "JobContext",
    "JobDefinition",
    "JobHandle",
    "JobNotRegistered",
    "JobStatus",
    "JobTimeout",
    "PayloadError",
    "PayloadTooLarge",
    "Snooze",
    "UnknownQueue",
    "WaitTimeout",
    "WorkflowBuilder",
    "WorkflowHandle",
    "WorkflowState",
    "aget_job",
    "batch",
    "chain",
    "enqueue_after",
    "enqueue_many",
    "get_batch",
    "get_job",
    "get_progress",
    "get_workflow",
    "job",
    "jobs_for",
    "pause_queue",
    "paused_queues",
    "periodic",
    "progress_token",
    "resume_queue",
    "set_progress",
    "workflow",
]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        from importlib import import_module

        return getattr(import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module 'django_dbqueue' has no attribute {name!r}")
