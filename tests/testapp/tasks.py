"""django.tasks tasks used by tests/test_tasks.py (imported on Django 6 only)."""

import time

from django.tasks import TaskContext, task

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


@task(tries=1, timeout=5, retry_after=20)
def once_only() -> None:
    raise RuntimeError("no second chance")


@task
def returns_object() -> object:
    return object()


def not_named_context(ctx: object) -> None:
    """Decorated in a test with takes_context=True, which Django refuses."""
