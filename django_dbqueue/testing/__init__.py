"""Test helpers: run enqueued jobs as a worker would, and assert what was enqueued (docs/howto/testing.md).

``run_jobs`` runs a ``Worker`` in the test's own process and thread, on the test's connection, so
it sees the jobs a ``TestCase`` enqueued in its open transaction; ``enqueued_jobs``,
``assert_enqueued`` and ``assert_not_enqueued`` read the job rows without running them.
``DBQUEUE["IMMEDIATE"]`` runs each job once its enqueue commits, through ``run_jobs``.
``JobsTestMixin`` (unittest) and the pytest plugin (``django_dbqueue.pytest_plugin``) are thin over these.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from .enqueued import EnqueuedJob, Target, assert_enqueued, assert_not_enqueued, enqueued_jobs
from .runs import Ran, RanJob, drain, run_immediately, run_jobs

__all__ = [
    "EnqueuedJob",
    "JobsTestMixin",
    "Ran",
    "RanJob",
    "assert_enqueued",
    "assert_not_enqueued",
    "drain",
    "enqueued_jobs",
    "run_immediately",
    "run_jobs",
]


class JobsTestMixin:
    """For ``TestCase`` and ``TransactionTestCase``: the helpers as methods, in unittest's spelling."""

    def run_jobs(self, queue: str | Sequence[str] | None = None, **options: Any) -> Ran:
        return run_jobs(queue, **options)

    def enqueued_jobs(self, queue: str | None = None, name: Target | None = None) -> list[EnqueuedJob]:
        return enqueued_jobs(queue=queue, name=name)

    def assertEnqueued(self, target: Target, /, *args: Any, **kwargs: Any) -> list[EnqueuedJob]:
        return assert_enqueued(target, *args, **kwargs)

    def assertNotEnqueued(self, target: Target, /, *args: Any, **kwargs: Any) -> None:
        assert_not_enqueued(target, *args, **kwargs)
