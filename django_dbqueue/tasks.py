"""A backend for Django's Tasks framework (``django.tasks``, Django 6).

A task is stored as a job of the internal job ``django_dbqueue.run_task``, run by ``queue_work``
with the queue's retries, timeouts and recovery; its outcome stays in ``TaskResultRecord``. The
job carries the task's path too, so the history, the dashboard, the metrics and the logs name
the task (``history.shown_name``), not ``run_task``.
"""

from __future__ import annotations

import dataclasses
import logging
import traceback
import uuid
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from django.apps import apps
from django.core import checks
from django.db import connections, transaction
from django.dispatch import receiver
from django.tasks import Task, TaskContext, TaskResult, TaskResultStatus
from django.tasks.backends.base import BaseTaskBackend
from django.tasks.base import TaskError
from django.tasks.exceptions import InvalidTask, TaskResultDoesNotExist
from django.tasks.signals import task_enqueued, task_finished, task_started
from django.utils.json import normalize_json

from . import insert, payload, registry, validation
from .context import JobContext
from .db import CLAIM_VENDORS, DbNow, alias, read_back
from .errors import clean
from .exceptions import JobCancelled, JobNotRegistered, PayloadError, Snooze, WorkerStopped
from .handles import TASKS_JOB
from .history import TASK_PATH
from .models import CANCELLED_CLASS, FailedJob, Job, TaskResultRecord
from .registry import job
from .rows import new_job
from .signals import job_cancelled, job_enqueued

logger = logging.getLogger("django_dbqueue")

RUN_TASK = TASKS_JOB
OPTION_KEYS = ("TRIES", "RETRY_AFTER", "TIMEOUT", "BACKOFF")
# The job options a task may set, else the backend's OPTIONS.
TASK_OPTIONS = tuple(key.lower() for key in OPTION_KEYS)

if TYPE_CHECKING:
    _TaskBase = Task[..., Any]
else:
    # Generic only in django-stubs.
    _TaskBase = Task

# Tasks by module path, filled as task modules are imported: only these run.
_tasks: dict[str, Task[..., Any]] = {}


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class DbQueueTask(_TaskBase):
    """Django's Task with the queue's options (``@task(tries=5, timeout=30)`` on Django 6.1)."""

    tries: int | None = None
    retry_after: int | None = None
    timeout: int | None = None
    backoff: float | list[float] | None = None

    def __post_init__(self) -> None:
        Task.__post_init__(self)
        # The decorated task, not the copies that using() makes.
        _tasks.setdefault(self.module_path, self)


class DatabaseBackend(BaseTaskBackend):
    task_class = DbQueueTask

    # Tasks with run_after wait in the queue as delayed jobs.
    supports_defer = True
    # Coroutine tasks run through async_to_sync in the worker.
    supports_async_task = True
    # Results live in TaskResultRecord, readable from any process.
    supports_get_result = True
    # Higher priority runs first within a queue.
    supports_priority = True

    def validate_task(self, task: Task[..., Any]) -> None:
        super().validate_task(task)
        for option in ("tries", "retry_after", "timeout"):
            value = getattr(task, option, None)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise InvalidTask(f"{option} must be a whole number of at least 1, not {value!r}.")
        backoff = getattr(task, "backoff", None)
        if backoff is not None and not registry.valid_backoff(backoff):
            raise InvalidTask(f"backoff must be seconds (>= 0) or a list of them, not {backoff!r}.")

    def _option(self, task: Task[..., Any], name: str) -> Any:
        value = getattr(task, name, None)
        return value if value is not None else self.options.get(name.upper())

    def enqueue(self, task: Task[..., Any], args: Iterable[Any], kwargs: dict[str, Any]) -> TaskResult[Any, Any]:
        self.validate_task(task)
        args = tuple(args)
        validation.check_call(task.module_path, task.func, args, kwargs, takes_context=task.takes_context)
        try:
            stored_args, stored_kwargs = normalize_json(list(args)), normalize_json(dict(kwargs))
        except TypeError as exc:
            raise TypeError(f"Cannot enqueue {task.module_path}: its arguments must be JSON: {exc}") from None
        # The arguments live in the result row, not in the job's payload: same limit.
        payload.check_size(task.module_path, payload.dumps({"args": stored_args, "kwargs": stored_kwargs}))
        result_id = uuid.uuid4().hex
        step = {
            "name": RUN_TASK,
            "queue": task.queue_name,
            "priority": task.priority,
            **{option: self._option(task, option) for option in TASK_OPTIONS},
            **payload.encode_arguments((result_id,), {TASK_PATH: task.module_path}),
        }
        row = new_job(step).to_job()
        if task.run_after is not None:
            row.available_at = task.run_after
        with transaction.atomic(using=alias()):
            insert.insert_each([row])
            record = TaskResultRecord.objects.create(
                id=result_id,
                task_path=task.module_path,
                backend=self.alias,
                queue=task.queue_name,
                priority=task.priority,
                status=TaskResultStatus.READY,
                args=stored_args,
                kwargs=stored_kwargs,
                job_id=row.pk,
                enqueued_at=DbNow(),
            )
        read_back(record, "enqueued_at")
        result = to_task_result(record, task)
        _send(task_enqueued, result)
        return result

    def get_result(self, result_id: str) -> TaskResult[Any, Any]:
        record = TaskResultRecord.objects.filter(pk=result_id).first()
        if record is None:
            raise TaskResultDoesNotExist(result_id)
        try:
            task = find_task(record.task_path)
        except JobNotRegistered:
            raise TaskResultDoesNotExist(
                f"the result {result_id} names the task {record.task_path!r}, which is not registered in this "
                "process; only registered tasks are read, never imported from the path a row names. Define the "
                "task with @task in a module imported at startup (an installed app's tasks.py)."
            ) from None
        return to_task_result(reconcile(record), task)

    def check(self, **kwargs: Any) -> list[Any]:
        messages: list[Any] = list(super().check(**kwargs))
        if not apps.is_installed("django_dbqueue"):
            messages.append(
                checks.Error(
                    f"TASKS[{self.alias!r}] uses django-dbqueue, which is not in INSTALLED_APPS.",
                    hint="Add 'django_dbqueue' to INSTALLED_APPS and run migrate.",
                    id="dbqueue.E007",
                )
            )
        vendor = connections[alias()].vendor if alias() in connections else None
        if vendor is not None and vendor not in CLAIM_VENDORS:
            messages.append(
                checks.Error(
                    f"TASKS[{self.alias!r}] stores tasks in the database {alias()!r} ({vendor}), where "
                    "django-dbqueue cannot claim jobs safely.",
                    hint="Use PostgreSQL, MariaDB >= 10.6, MySQL >= 8 or SQLite for DBQUEUE['DATABASE'].",
                    id="dbqueue.E010",
                )
            )
        for key in self.options:
            if key not in OPTION_KEYS:
                messages.append(
                    checks.Error(
                        f"TASKS[{self.alias!r}]['OPTIONS'] has an unknown key {key!r}.",
                        hint=f"Known keys: {', '.join(OPTION_KEYS)}.",
                        id="dbqueue.E008",
                    )
                )
        return messages


def find_task(task_path: str) -> Task[..., Any]:
    """The task registered at ``task_path``; raise ``JobNotRegistered`` for any other path.

    Never imported: the path comes from a row, and importing the module a row names runs its code.
    """
    task = _tasks.get(task_path)
    if task is None:
        raise JobNotRegistered(
            f"No django.tasks task is registered under {task_path!r}. Define it with @task in a module "
            "that is imported at startup (an installed app's tasks.py), with the django-dbqueue backend."
        )
    return task


def _errors(record: TaskResultRecord) -> list[TaskError]:
    return [TaskError(exception_class_path=e["exception_class_path"], traceback=e["traceback"]) for e in record.errors]


def to_task_result(record: TaskResultRecord, task: Task[..., Any]) -> TaskResult[Any, Any]:
    result = TaskResult(
        task=task,
        id=record.id,
        status=TaskResultStatus(record.status),
        enqueued_at=record.enqueued_at,
        started_at=record.started_at,
        finished_at=record.finished_at,
        last_attempted_at=record.last_attempted_at,
        args=record.args,
        kwargs=record.kwargs,
        backend=record.backend,
        errors=_errors(record),
        worker_ids=list(record.worker_ids),
    )
    object.__setattr__(result, "_return_value", record.return_value)
    return result


def reconcile(record: TaskResultRecord) -> TaskResultRecord:
    """Bring an unfinished result in line with its job: waiting, running, or failed without a word
    (by a worker killed, or a job ended by force at its timeout, which cannot write its result)."""
    if record.status not in (TaskResultStatus.READY, TaskResultStatus.RUNNING) or record.job_id is None:
        return record
    current = Job.objects.filter(pk=record.job_id).values_list("reserved_at", flat=True)
    if current.exists():
        status = TaskResultStatus.RUNNING if current.first() is not None else TaskResultStatus.READY
        if status != record.status:
            record.status = status
            record.save(update_fields=["status"])
        return record
    failed = FailedJob.objects.filter(job_id=record.job_id).order_by("-failed_at").first()
    if failed is not None:
        _add_error(record, failed.exception_class, failed.error, failed.failed_at)
    return record


def _add_error(record: TaskResultRecord, class_path: str, text: str, finished_at: Any) -> None:
    """Store an error of ``record``'s task: FAILED at ``finished_at``, or READY to run again if it is None."""
    record.errors = [*record.errors, {"exception_class_path": class_path, "traceback": text}]
    record.status = TaskResultStatus.FAILED if finished_at is not None else TaskResultStatus.READY
    record.finished_at = finished_at
    record.save(update_fields=["status", "errors", "finished_at"])


def _send(signal: Any, result: TaskResult[Any, Any]) -> None:
    """Send a Tasks signal; a receiver that raises is logged and changes nothing."""
    for handler, response in signal.send_robust(sender=DatabaseBackend, task_result=result):
        if isinstance(response, Exception):
            logger.error("task signal receiver %r raised", handler, exc_info=response)


@job(name=RUN_TASK, takes_context=True)
def run_task(context: JobContext, result_id: str, task_path: str = "") -> Any:
    """Run one django.tasks task with Django's semantics, recording its result (``task_path``:
    the task's path, for what names the run; jobs enqueued before it was carried have none)."""
    record = TaskResultRecord.objects.filter(pk=result_id).first()
    if record is None:
        whose = f"the task {task_path}'s" if task_path else "the task's"
        raise PayloadError(f"the task result {result_id} no longer exists, and with it {whose} arguments")
    task = find_task(record.task_path)
    record.status = TaskResultStatus.RUNNING
    record.worker_ids = [*record.worker_ids, context.worker_id]
    record.last_attempted_at = DbNow()
    fields = ["status", "worker_ids", "last_attempted_at"]
    if record.started_at is None:
        record.started_at = DbNow()
        fields.append("started_at")
    record.save(update_fields=fields)
    read_back(record, "started_at", "last_attempted_at")
    result = to_task_result(record, task)
    _send(task_started, result)
    try:
        call_args = (TaskContext(task_result=result), *record.args) if task.takes_context else tuple(record.args)
        value = normalize_json(task.call(*call_args, **record.kwargs))
    except Snooze:
        # Put back without spending a try: not an error of the task.
        raise
    except BaseException as exc:
        # A cancelled task does not run again, whatever its tries.
        last = isinstance(exc, JobCancelled) or (not isinstance(exc, WorkerStopped) and context.is_last_attempt)
        cls = type(exc)
        # Stored like FailedJob.error: scrubbed and capped.
        text = clean("".join(traceback.format_exception(exc)))
        _add_error(record, f"{cls.__module__}.{cls.__qualname__}", text, DbNow() if last else None)
        if last:
            read_back(record, "finished_at")
            _send(task_finished, to_task_result(record, task))
        raise
    record.status = TaskResultStatus.SUCCESSFUL
    record.return_value = value
    record.finished_at = DbNow()
    record.save(update_fields=["status", "return_value", "finished_at"])
    read_back(record, "finished_at")
    _send(task_finished, to_task_result(record, task))
    return value


def _result_id(row: Job | FailedJob | None) -> str | None:
    """The result id a ``run_task`` row carries; None for any other row."""
    if row is None or row.name != RUN_TASK:
        return None
    try:
        return str(payload.decode(row.payload)["args"][0])
    except (PayloadError, IndexError, KeyError):
        return None


@receiver(job_cancelled)
def _cancel_task(sender: Any, job_id: int, failed_job: FailedJob | None = None, **kwargs: Any) -> None:
    """A task cancelled before it ran: its result is FAILED, with the cancellation as its error
    (django.tasks has no cancelled status)."""
    result_id = _result_id(failed_job)
    record = TaskResultRecord.objects.filter(pk=result_id).first() if result_id is not None else None
    if record is not None and failed_job is not None:
        _add_error(record, CANCELLED_CLASS, failed_job.error, DbNow())


@receiver(job_enqueued, sender=FailedJob)
def _follow_retried_job(sender: Any, job: Job, **kwargs: Any) -> None:
    """A task retried from FailedJob runs as a new job: its result follows it (connected for that
    sender alone, so ``enqueue_many`` can skip its signals)."""
    result_id = _result_id(job)
    if result_id is not None:
        TaskResultRecord.objects.filter(pk=result_id).update(
            job_id=job.pk, status=TaskResultStatus.READY, finished_at=None
        )
