"""What was enqueued: the job rows read as calls, and the assertions over them (``testing``)."""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable, Iterable, Sequence
from datetime import datetime
from typing import Any

from django.db import models

from .. import payload, registry
from ..db import alias
from ..handles import TASKS_JOB
from ..models import DB_NOW, Job, TaskResultRecord
from ..registry import JobDefinition

# A job, as the helpers take it: its definition, its registered name, or a django.tasks ``Task``.
Target = JobDefinition[..., Any] | str | Any


@dataclasses.dataclass(frozen=True)
class EnqueuedJob:
    """A job row as enqueued: its call (model arguments as ``payload.ModelRef``) and options."""

    id: int
    name: str  # the registered name; a django.tasks task's own path
    queue: str
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    state: str  # waiting, delayed, blocked, reserved, expired (states.State)
    priority: int
    available_at: datetime
    attempts: int
    max_tries: int | None
    unique_key: str | None
    batch_id: int | None
    row: Job = dataclasses.field(repr=False, compare=False)

    def __str__(self) -> str:
        return f"{call_text(self.name, self.args, self.kwargs)} on {self.queue!r} (job {self.id}, {self.state})"


# -- reading what was enqueued -----------------------------------------------------


def enqueued_jobs(queue: str | None = None, name: Target | None = None) -> list[EnqueuedJob]:
    """The job rows (waiting, delayed, blocked or running), in the order enqueued; only those of
    ``queue`` and of the job ``name`` (a definition, its registered name, or a django.tasks ``Task``)."""
    rows = Job.objects.using(alias()).order_by("pk").annotate(**DB_NOW)
    if queue is not None:
        rows = rows.filter(queue=queue)
    wanted = None if name is None else target_name(name)
    if wanted is not None and not is_task(name):
        rows = rows.filter(name=wanted)
    elif wanted is not None:
        rows = rows.filter(name=TASKS_JOB)
    jobs = list(rows)
    tasks = _task_records(jobs)
    found = []
    for row in jobs:
        job_name, args, kwargs = call_of(row, tasks)
        if wanted is not None and job_name != wanted:
            continue
        found.append(
            EnqueuedJob(
                id=row.pk,
                name=job_name,
                queue=row.queue,
                args=args,
                kwargs=kwargs,
                state=str(row.state(row.db_now).value),
                priority=row.priority,
                available_at=row.available_at,
                attempts=row.attempts,
                max_tries=row.max_tries,
                unique_key=row.unique_key,
                batch_id=row.batch_id,
                row=row,
            )
        )
    return found


def assert_enqueued(
    target: Target, /, *args: Any, queue: str | None = None, count: int | None = None, **kwargs: Any
) -> list[EnqueuedJob]:
    """Assert that ``target`` was enqueued (with these arguments, if any are given; on ``queue``;
    ``count`` times); return the matching jobs. Arguments compare as the job's signature binds them."""
    name = target_name(target)
    jobs = enqueued_jobs(queue=queue, name=target)
    matching = [job for job in jobs if _matches(target, job, args, kwargs)] if args or kwargs else jobs
    if (count is None and matching) or (count is not None and len(matching) == count):
        return matching
    wanted = call_text(name, args, kwargs) if args or kwargs else f"{name}(...)"
    where = f" on queue {queue!r}" if queue is not None else ""
    times = f" {count} time(s), found {len(matching)}" if count is not None else ""
    raise AssertionError(f"expected {wanted} enqueued{where}{times}; {_listing(queue)}")


def assert_not_enqueued(target: Target, /, *args: Any, queue: str | None = None, **kwargs: Any) -> None:
    """Assert that ``target`` was not enqueued (with these arguments, if any are given; on ``queue``)."""
    jobs = enqueued_jobs(queue=queue, name=target)
    matching = [job for job in jobs if _matches(target, job, args, kwargs)] if args or kwargs else jobs
    if matching:
        wanted = call_text(target_name(target), args, kwargs) if args or kwargs else f"{target_name(target)}(...)"
        where = f" on queue {queue!r}" if queue is not None else ""
        found = ", ".join(str(job) for job in matching)
        raise AssertionError(f"expected {wanted} not enqueued{where}; found {found}")


def _listing(queue: str | None) -> str:
    jobs = enqueued_jobs(queue=queue)
    if not jobs:
        return "no job is enqueued" + (f" on {queue!r}" if queue is not None else "")
    shown = ", ".join(str(job) for job in jobs[:20])
    return f"enqueued: {shown}" + (f" and {len(jobs) - 20} more" if len(jobs) > 20 else "")


def is_task(target: Any) -> bool:
    return not isinstance(target, (JobDefinition, str)) and hasattr(target, "module_path")


def target_name(target: Target) -> str:
    if isinstance(target, JobDefinition):
        return target.name
    if isinstance(target, str):
        return target
    if is_task(target):
        return str(target.module_path)
    raise TypeError(f"expected a job (its @job definition, its name or a django.tasks Task), not {target!r}")


def _task_records(jobs: Iterable[Job]) -> dict[int, TaskResultRecord]:
    ids = [job.pk for job in jobs if job.name == TASKS_JOB]
    if not ids:
        return {}
    records = TaskResultRecord.objects.using(alias()).filter(job_id__in=ids)
    return {record.job_id: record for record in records if record.job_id is not None}


def call_of(job: Job, tasks: dict[int, TaskResultRecord] | None = None) -> tuple[str, tuple[Any, ...], dict[str, Any]]:
    """The name and the arguments of a stored call; a django.tasks task's, from its result row."""
    if job.name == TASKS_JOB:
        record = (tasks if tasks is not None else _task_records([job])).get(job.pk)
        if record is not None:
            return record.task_path, tuple(record.args), dict(record.kwargs)
    envelope = payload.decode(job.payload)
    return job.name, tuple(envelope["args"]), dict(envelope["kwargs"])


def _matches(target: Target, job: EnqueuedJob, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Tell whether ``job`` is the call ``target(*args, **kwargs)``: bound to the function's signature
    (defaults applied) when it has one, model instances compared by label and primary key."""
    func = target.func if isinstance(target, JobDefinition) else None
    if func is None and isinstance(target, str):
        definition = registry.find(target)
        func = definition.func if definition is not None else None
    if func is None and is_task(target):
        func = getattr(target, "func", None)
    if func is not None:
        context = isinstance(target, JobDefinition) and target.takes_context
        expected, stored = _bound(func, args, kwargs, context), _bound(func, job.args, job.kwargs, context)
        if expected is not None and stored is not None:
            return bool(_comparable(expected) == _comparable(stored))
    return bool(_comparable((list(args), kwargs)) == _comparable((list(job.args), job.kwargs)))


def _bound(func: Callable[..., Any], args: Sequence[Any], kwargs: dict[str, Any], context: bool) -> Any:
    try:
        bound = inspect.signature(func).bind(*((None,) if context else ()), *args, **kwargs)
    except TypeError:
        return None
    bound.apply_defaults()
    values = dict(bound.arguments)
    if context:
        values.pop(next(iter(values)))
    return values


def _comparable(value: Any) -> Any:
    """``value`` with model instances and stored references both as (label, pk); JSON's lists as tuples."""
    if isinstance(value, models.Model):
        return ("model", value._meta.label_lower, value.pk)
    if isinstance(value, payload.ModelRef):
        return ("model", value.label, value.pk)
    if isinstance(value, (list, tuple)):
        return tuple(_comparable(item) for item in value)
    if isinstance(value, dict):
        return {key: _comparable(item) for key, item in value.items()}
    return value


def call_text(name: str, args: Sequence[Any], kwargs: dict[str, Any]) -> str:
    parts = [_value_text(arg) for arg in args] + [f"{key}={_value_text(arg)}" for key, arg in kwargs.items()]
    return f"{name}({', '.join(parts)})"


def _value_text(value: Any) -> str:
    if isinstance(value, payload.ModelRef):
        return f"<{value.label} pk={value.pk!r}>"
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
