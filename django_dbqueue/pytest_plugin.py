"""The pytest plugin of the test helpers (``pytest11`` entry point): fixtures over ``django_dbqueue.testing``.

Loaded by every pytest run once the package is installed, before Django is set up: the package's
modules are imported only once Django is ready (``django_dbqueue.testing``, for immediate mode) or
a fixture is used. The fixtures need the database as any test does (``db``, ``transactional_db``).
"""

from __future__ import annotations

from collections.abc import Iterator
from types import ModuleType
from typing import Any

import pytest


def _helpers() -> ModuleType:
    from django_dbqueue import testing

    return testing


class JobQueue:
    """What the ``dbqueue`` fixture gives a test: the helpers of ``django_dbqueue.testing``."""

    def __init__(self) -> None:
        self._testing = _helpers()

    def run_jobs(self, queue: Any = None, **options: Any) -> Any:
        return self._testing.run_jobs(queue, **options)

    drain = run_jobs

    def enqueued_jobs(self, queue: str | None = None, name: Any = None) -> Any:
        return self._testing.enqueued_jobs(queue=queue, name=name)

    def assert_enqueued(self, target: Any, /, *args: Any, **kwargs: Any) -> Any:
        return self._testing.assert_enqueued(target, *args, **kwargs)

    def assert_not_enqueued(self, target: Any, /, *args: Any, **kwargs: Any) -> None:
        self._testing.assert_not_enqueued(target, *args, **kwargs)


@pytest.fixture(autouse=True, scope="session")
def _dbqueue_helpers_loaded() -> None:
    """Import the helpers once Django is set up with the app, so that ``DBQUEUE["IMMEDIATE"]``
    finds what runs its jobs; nothing in a project without Django or without the app."""
    try:
        from django.apps import apps
    except ImportError:
        return
    if apps.ready and apps.is_installed("django_dbqueue"):
        _helpers()


@pytest.fixture
def dbqueue() -> JobQueue:
    """Run enqueued jobs as a worker would (``dbqueue.run_jobs()``) and assert what was enqueued."""
    return JobQueue()


@pytest.fixture
def dbqueue_immediate(settings: Any) -> Iterator[JobQueue]:
    """Turn ``DBQUEUE["IMMEDIATE"]`` on for one test (pytest-django's ``settings`` fixture)."""
    settings.DBQUEUE = {**(getattr(settings, "DBQUEUE", None) or {}), "IMMEDIATE": True}
    yield JobQueue()
