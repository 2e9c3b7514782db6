"""The one vocabulary of where a job and a batch are, and of how a run ends.

``State``: where a job row is (the admin's filter, the commands, ``JobQuerySet.in_state``);
``JobStatus``: where a job is as its caller follows it (``JobHandle``), its row's ``State``
read through ``State.status`` until the row is gone; ``BatchState``: where a batch is;
``WorkflowState``: where a workflow is (from its nodes' ``NodeState``, models.workflows);
``Ended``: how a run or a reservation ended, as the worker records it and the reactions are told.
Plain enums: importing this module imports no model.
"""

from __future__ import annotations

import enum
from typing import Literal

from django.db.models import TextChoices


class JobStatus(enum.StrEnum):
    """Where a job is now, as a handle reads it; ``status.finished`` is true for the last three."""

    WAITING = "waiting"
    DELAYED = "delayed"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"

    @property
    def finished(self) -> bool:
        return self in (JobStatus.SUCCEEDED, JobStatus.FAILED, JobStatus.CANCELLED)


class State(TextChoices):
    """Where a job row is. A job that ended has no row: it succeeded (deleted) or is a ``FailedJob``."""

    WAITING = "waiting", "waiting"
    DELAYED = "delayed", "delayed"
    BLOCKED = "blocked", "blocked"  # waiting for a free slot of its concurrency key, or for its parents
    RESERVED = "reserved", "reserved"
    EXPIRED = "expired", "reservation expired"  # reserved past its retry_after: to be reclaimed

    @property
    def status(self) -> JobStatus:
        """The row's state as its caller follows it: blocked is waiting, reserved or expired running."""
        return STATUSES[self]


STATUSES = {
    State.WAITING: JobStatus.WAITING,
    State.DELAYED: JobStatus.DELAYED,
    State.BLOCKED: JobStatus.WAITING,
    State.RESERVED: JobStatus.RUNNING,
    State.EXPIRED: JobStatus.RUNNING,
}


class BatchState(TextChoices):
    """Where a batch is (``JobBatch.state``); ``failed``: finished with failures."""

    RUNNING = "running", "running"
    FINISHED = "finished", "finished"
    FAILED = "failed", "failed (finished, some members failed)"
    CANCELLING = "cancelling", "cancelling (members still running)"
    CANCELLED = "cancelled", "cancelled"


class WorkflowState(TextChoices):
    """Where a workflow is, from its nodes: ``failed``: every node ended, some failed or were cancelled."""

    RUNNING = "running", "running"
    SUCCEEDED = "succeeded", "succeeded"
    FAILED = "failed", "failed (finished, some nodes failed or were cancelled)"
    CANCELLING = "cancelling", "cancelling (nodes still running)"
    CANCELLED = "cancelled", "cancelled"


class Ended(enum.StrEnum):
    """How a run or a reservation ended: a run's outcome is one of the first three (``RunStatus``);
    a cancel, a retry from ``FailedJob`` back into a batch and a row left by an operator end rows too."""

    SUCCEEDED = "succeeded"
    RELEASED = "released"
    FAILED = "failed"
    CANCELLED = "cancelled"
    RETRIED = "retried"
    LEFT = "left"


# The outcome of one run of a job (``execution.Outcome.status``): the first three of ``Ended``.
RunStatus = Literal["succeeded", "released", "failed"]
