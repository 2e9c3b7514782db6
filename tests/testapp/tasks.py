"""django.tasks tasks used by tests/test_tasks.py (imported on Django 6 only)."""

import time

import django
from django.tasks import TaskContext, task

from django_dbqueue.tasks import DbQueueTask

from .models import Run


@task
def add_numbers(a: int, b: int) -> int:
    return a + b


@task(takes_context=True)
def remember_attempt(context: TaskContext, key: str) -> dict[str, object]:
    Run.objects.create(key=f"{key}-{context.attempt}")
    return {"attempt": context.attempt, "result_id": context.task_result.id}


@task
def always_fails(message: str) -> None:
    raise ValueError(message)


@task
def fails_until_allowed(key: str) -> str:
    if not Run.objects.filter(key=f"{key}-allow").exists():
        raise RuntimeError(f"{key} is not allowed yet")
    return "done"


@task
async def double(value: int) -> int:
    return value * 2


@task(queue_name="low")
def record_key(key: str) -> None:
    Run.objects.create(key=key)


@task
def slow_task(key: str, seconds: float) -> str:
    time.sleep(seconds)
    Run.objects.create(key=key)
    return key


def once_only() -> None:
    raise RuntimeError("no second chance")


if django.VERSION >= (6, 1):
    # Django 6.1 passes unknown @task options to the backend's task class.
    once_only = task(tries=1, timeout=5, retry_after=20)(once_only)  # type: ignore[assignment]
else:
    once_only = DbQueueTask(  # type: ignore[assignment]
        func=once_only,
        priority=0,
        backend="default",
        queue_name="default",
        run_after=None,
        takes_context=False,
        tries=1,
        timeout=5,
        retry_after=20,
    )


@task
def returns_object() -> object:
    return object()


def not_named_context(ctx: object) -> None:
    """Decorated in a test with takes_context=True, which Django refuses."""
