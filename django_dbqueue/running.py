"""The job this thread (or asyncio task) runs now, as the worker sets it for every job.

Read by ``JobHandle.wait`` to refuse a wait inside a job that could deadlock. On the base floor:
it imports nothing of the package, so any module may read it.
"""

from __future__ import annotations

import contextvars

# (job id, registered name) while a job runs; each async job's task holds its own copy.
running: contextvars.ContextVar[tuple[int, str] | None] = contextvars.ContextVar("django_dbqueue_running", default=None)


def current_job() -> tuple[int, str] | None:
    """The id and name of the job running here; None outside a job."""
    return running.get()
