"""The job and failed-job tables, their named querysets and the one vocabulary of a job's state.

No state change lives here: a job's life after its claim is ``lifecycle``, the
claim is ``claims``; every INSERT of job rows is ``insert``.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from datetime import datetime, timedelta
from typing import Any

from django.core.validators import MaxValueValidator, MinValueValidator
from django.db import models
from django.db.models import F, Func, Q

from ..db import DbNow, alias
from ..states import JobStatus, State
from ..validation import MAX_PRIORITY, MIN_PRIORITY, ROW_BOUNDS, row_error

logger = logging.getLogger("django_dbqueue")

# Rows inserted at once after which PostgreSQL re-analyzes the job table.
ANALYZE_AFTER = 1000
# Reads the database's clock into ``db_now`` (a dict, so the type checker keeps the model's attribute).
DB_NOW = {"db_now": DbNow()}
UNIQUE_INDEX = "dbqueue_job_unique"  # on Job.unique_key (migration 0008)
# Values of ``Job.cancel``.
NO_CANCEL, CANCEL, CANCEL_HARD = 0, 1, 2
CANCELLED_CLASS = "django_dbqueue.exceptions.JobCancelled"
INVALID_ROW_CLASS = "django_dbqueue.exceptions.InvalidJobRow"


class LeaseOver(Func):
    """True where a reservation is older than its ``retry_after``, by the database's clock (in SQL)."""

    conditional = True
    output_field = models.BooleanField()

    def __init__(self) -> None:
        super().__init__(F("reserved_at"), F("retry_after"))

    def _columns(self, compiler: Any, connection: Any) -> tuple[str, str, list[Any]]:
        at, at_params = compiler.compile(self.source_expressions[0])
        after, after_params = compiler.compile(self.source_expressions[1])
        return at, after, [*at_params, *after_params]

    def as_sql(self, compiler: Any, connection: Any, *args: Any, **extra_context: Any) -> Any:  # SQLite
        at, after, params = self._columns(compiler, connection)
        return f"(julianday({at}) + {after} / 86400.0 <= julianday('now'))", params

    def as_postgresql(self, compiler: Any, connection: Any, **extra_context: Any) -> Any:
        at, after, params = self._columns(compiler, connection)
        return f"({at} + {after} * interval '1 second' <= STATEMENT_TIMESTAMP())", params

    def as_mysql(self, compiler: Any, connection: Any, **extra_context: Any) -> Any:
        at, after, params = self._columns(compiler, connection)
        return f"(TIMESTAMPADD(SECOND, {after}, {at}) <= UTC_TIMESTAMP(6))", params


class QueueDatabaseManager(models.Manager[Any]):
    """Reads and writes the database that holds the queue."""

    def get_queryset(self) -> models.QuerySet[Any]:
        return super().get_queryset().using(self._db or alias())


class JobQuerySet(models.QuerySet["Job"]):
    def waiting(self) -> JobQuerySet:
        """Jobs a worker may reserve now (unless their queue is paused)."""
        return self.filter(reserved_at__isnull=True, blocked=False, available_at__lte=DbNow())

    def blocked(self) -> JobQuerySet:
        """Jobs waiting for a free slot of their concurrency key."""
        return self.filter(reserved_at__isnull=True, blocked=True)

    def delayed(self) -> JobQuerySet:
        """Jobs that become available later (a delay, a backoff, a rate limit)."""
        return self.filter(reserved_at__isnull=True, blocked=False, available_at__gt=DbNow())

    def reserved(self) -> JobQuerySet:
        """Jobs a worker holds, their reservation expired or not."""
        return self.filter(reserved_at__isnull=False)

    def expired(self) -> JobQuerySet:
        """Reserved jobs whose reservation is older than their ``retry_after`` (to be reclaimed)."""
        return self.filter(LeaseOver(), reserved_at__isnull=False)

    def in_state(self, state: str) -> JobQuerySet:
        """The jobs in ``state`` (a ``State``); ``RESERVED`` leaves the expired reservations out."""
        if state == State.RESERVED:
            return self.reserved().alias(lease_over=LeaseOver()).filter(lease_over=False)
        return {
            State.WAITING: self.waiting,
            State.DELAYED: self.delayed,
            State.BLOCKED: self.blocked,
            State.EXPIRED: self.expired,
        }[State(state)]()

    def held(self, job: Job) -> JobQuerySet:
        """The row of ``job`` if nobody reserved it since ``job`` was read."""
        return self.filter(pk=job.pk, attempts=job.attempts)

    def held_by(self, jobs: Iterable[Job]) -> JobQuerySet:
        """The rows that still carry these jobs' reservations: ``(id, attempts)`` unchanged."""
        condition = Q()
        for job in jobs:
            condition |= Q(pk=job.pk, attempts=job.attempts)
        return self.filter(condition)

    def delete_now(self) -> int:
        """Delete the matching rows in one DELETE statement; return how many.

        ``QuerySet.delete()`` SELECTs the rows first when a delete signal receiver is
        connected, which would drop the ``attempts`` condition of a compare-and-set.
        """
        # None when the filter can match nothing (``pk__in=[]``): no statement is sent.
        return int(self._raw_delete(self.db) or 0)


class _JobManager(models.Manager["Job"]):
    def get_queryset(self) -> JobQuerySet:
        return JobQuerySet(self.model, using=self._db or alias())

    def expired(self) -> list[Job]:
        """The expired reservations, as a list (``get_queryset().expired()`` is the queryset)."""
        return list(self.get_queryset().expired())


JobManager = _JobManager.from_queryset(JobQuerySet)


def check_rows(rows: Iterable[Job]) -> None:
    """Raise ValueError naming the first row that holds a value out of the table's bounds."""
    for row in rows:
        error = row_error(row.__dict__)
        if error is not None:
            raise ValueError(f"Cannot enqueue {row.name}: {error}")


def sql_names(connection: Any, *fields: str) -> list[str]:
    """The job table's quoted name, then the quoted columns of ``fields`` (from the model, never input)."""
    meta = Job._meta
    qn = connection.ops.quote_name
    columns = {field.name: str(field.column) for field in meta.concrete_fields}
    return [str(qn(meta.db_table)), *(str(qn(columns[name])) for name in fields)]


NOT_NEGATIVE = [MinValueValidator(0)]


def bounds_condition() -> Q:
    """The job table's CHECK: every column of ``ROW_BOUNDS`` within its bounds.

    A NULL passes a CHECK, so nullable columns need no ``IS NULL OR`` (each node
    costs PostgreSQL work in every statement that writes a row).
    """
    condition = Q()
    for column, (low, high) in ROW_BOUNDS.items():
        condition &= Q(**{f"{column}__gte": low}) if high is None else Q(**{f"{column}__range": (low, high)})
    return condition


class Job(models.Model):
    """A job waiting, delayed, blocked or reserved. A job that succeeded is deleted."""

    id = models.BigAutoField(primary_key=True)
    queue = models.CharField(max_length=100, default="default")
    name = models.CharField(max_length=200, help_text="Registered name of the job definition.")
    payload = models.TextField(help_text="JSON envelope: arguments and options.")
    # Higher runs first (Django's Tasks: -100..100). The bounds are the table's one
    # CHECK (Meta.constraints), checked first by validation.row_error; validators tell forms.
    priority = models.SmallIntegerField(
        default=0, validators=[MinValueValidator(MIN_PRIORITY), MaxValueValidator(MAX_PRIORITY)]
    )
    # Bumped by every reserve, never reset: with the id, it names a reservation.
    attempts = models.IntegerField(default=0, validators=NOT_NEGATIVE)
    # Reservations that spent no try (never started, or a lost connection): tries count ``attempts - given_back``.
    given_back = models.IntegerField(default=0, db_default=0, validators=NOT_NEGATIVE)
    # NO_CANCEL, CANCEL (stop at the next check) or CANCEL_HARD (as at a timeout): see lifecycle.cancel.
    cancel = models.SmallIntegerField(default=0, db_default=0, validators=NOT_NEGATIVE)
    # Attempts that ended in an exception and were released (for ``max_exceptions``).
    exceptions = models.IntegerField(default=0, db_default=0, validators=NOT_NEGATIVE)
    # None: the worker's --tries (or DBQUEUE["TRIES"]) applies.
    max_tries = models.SmallIntegerField(null=True, blank=True, validators=NOT_NEGATIVE)
    # Stored per row so any worker can tell when a reservation has expired.
    retry_after = models.IntegerField(validators=NOT_NEGATIVE)
    # Seconds one run may take; None: the worker's --timeout applies.
    timeout = models.IntegerField(null=True, blank=True, validators=NOT_NEGATIVE)
    available_at = models.DateTimeField()
    reserved_at = models.DateTimeField(null=True, blank=True)
    # The worker process holding the reservation (a supervisor reclaims a dead child's jobs).
    reserved_by = models.CharField(max_length=100, blank=True, default="")
    created_at = models.DateTimeField()
    # Flow control (docs/flow.md): NULL, not "", when unused, so unique and partial indexes leave the row out.
    unique_key = models.CharField(max_length=255, null=True, blank=True)  # noqa: DJ001
    unique_until_start = models.BooleanField(default=False, db_default=False)
    # ``blocked``: waiting for a slot of its concurrency key, skipped by claims until one is freed.
    concurrency_key = models.CharField(max_length=255, null=True, blank=True)  # noqa: DJ001
    concurrency_limit = models.SmallIntegerField(null=True, blank=True, validators=NOT_NEGATIVE)
    blocked = models.BooleanField(default=False, db_default=False)
    # The rate bucket its starts spend, and its limit as "count/seconds/burst" (rates.py).
    rate_key = models.CharField(max_length=255, null=True, blank=True)  # noqa: DJ001
    rate_limit = models.CharField(max_length=50, null=True, blank=True)  # noqa: DJ001
    batch_id = models.BigIntegerField(null=True, blank=True)
    # Its workflow node (models.workflows); ``blocked`` while a parent has not ended.
    node_id = models.BigIntegerField(null=True, blank=True)

    objects = JobManager()

    # The database's clock, on rows read by queries that annotate it.
    db_now: datetime
    # Not a column: seconds the worker timed this reservation's run, for the history of
    # finished jobs (``finished``); None where nobody ran it.
    ran_for: float | None = None

    class Meta:
        db_table = "dbqueue_job"
        ordering = ["-priority", "available_at", "id"]
        # The migrations make the indexes, per database: dbqueue_job_claim for the claim
        # (partial on PostgreSQL: dbqueue_job_waiting), dbqueue_job_reserved for the reclaim.
        permissions = [("cancel_job", "Can cancel jobs, waiting or running")]
        constraints = [models.CheckConstraint(condition=bounds_condition(), name="dbqueue_job_bounds")]

    def __str__(self) -> str:
        return f"{self.name} #{self.pk}"

    def tries_allowed(self, default: int) -> int:
        return self.max_tries if self.max_tries is not None else default

    @property
    def tries_spent(self) -> int:
        """Reservations that count against the job's tries."""
        return self.attempts - self.given_back

    def state(self, now: datetime | None) -> State:
        """The row's ``State`` at the database time ``now`` (None: delays and leases are not judged)."""
        if self.reserved_at is not None:
            expired = now is not None and self.reserved_at + timedelta(seconds=self.retry_after) <= now
            return State.EXPIRED if expired else State.RESERVED
        if self.blocked:
            return State.BLOCKED
        return State.DELAYED if now is not None and self.available_at > now else State.WAITING


# Result records of ``@job`` jobs: their ``backend``, and the status of one retried
# from FailedJob (its ``job_id`` names the new run).
JOB_RECORDS = ""
RETRIED = "retried"


def record_id(job_id: int) -> str:
    """The result store's key for a ``@job`` job."""
    return f"job:{job_id}"


def last_line(error: str) -> str:
    """The last non-empty line of an error: the exception and its message."""
    lines = [line for line in error.strip().splitlines() if line.strip()]
    return lines[-1].strip() if lines else ""


class FailedJobQuerySet(models.QuerySet["FailedJob"]):
    pass


class FailedJobManager(models.Manager["FailedJob"]):
    def get_queryset(self) -> FailedJobQuerySet:
        return FailedJobQuerySet(self.model, using=self._db or alias())


class FailedJob(models.Model):
    """A job that used its tries or could not run: the dead-letter table."""

    id = models.BigAutoField(primary_key=True)
    job_id = models.BigIntegerField(help_text="Id the job had while it was queued.")
    queue = models.CharField(max_length=100)
    name = models.CharField(max_length=200)
    payload = models.TextField(help_text="The whole envelope, as it was queued.")
    # The job's options, so a retry queues it exactly as it was.
    priority = models.SmallIntegerField(default=0)
    max_tries = models.PositiveSmallIntegerField(null=True, blank=True)
    retry_after = models.PositiveIntegerField(default=60)
    timeout = models.PositiveIntegerField(null=True, blank=True)
    attempts = models.PositiveIntegerField()
    exception_class = models.CharField(max_length=255)
    error = models.TextField(help_text="The full traceback, or why the job could not run.")
    created_at = models.DateTimeField(help_text="When the job was first enqueued.")
    failed_at = models.DateTimeField()
    # A retry puts the job back into this batch, and this workflow node.
    batch_id = models.BigIntegerField(null=True, blank=True)
    node_id = models.BigIntegerField(null=True, blank=True)

    objects = FailedJobManager()

    class Meta:
        db_table = "dbqueue_failed_job"
        ordering = ["-failed_at", "-id"]
        indexes = [
            models.Index(fields=["failed_at"], name="dbqueue_failed_at"),
            models.Index(fields=["batch_id"], name="dbqueue_failed_batch"),
            # A job's failed row by the id it had (handles, the history, jobs_for, a retry).
            models.Index(fields=["job_id"], name="dbqueue_failed_job_id"),
        ]

    def __str__(self) -> str:
        return f"{self.name} (failed #{self.pk})"

    @property
    def error_summary(self) -> str:
        return last_line(self.error)


FINISHED_OUTCOMES = [(status.value, status.value) for status in JobStatus if status.finished]


class FinishedJob(models.Model):
    """One row per job that ended, kept ``DBQUEUE["KEEP_FINISHED"]`` hours (``finished``): written
    in the transaction that ends the job, so it never disagrees with the queue. On PostgreSQL
    the table is partitioned by day of ``finished_at`` (migration 0018), its primary key
    ``(id, finished_at)``; ``id`` alone is unique, from one sequence."""

    id = models.BigAutoField(primary_key=True)
    job_id = models.BigIntegerField(help_text="Id the job had while it was queued.")
    queue = models.CharField(max_length=100)
    name = models.CharField(max_length=200)
    # The envelope as queued, read as JSON (None if it could not be read): searched by argument content.
    payload = models.JSONField(null=True, blank=True)
    priority = models.SmallIntegerField(default=0)
    outcome = models.CharField(max_length=16, choices=FINISHED_OUTCOMES)
    attempts = models.IntegerField(default=0)
    worker = models.CharField(max_length=100, blank=True, default="", help_text="The worker that ran it last.")
    created_at = models.DateTimeField(help_text="When the job was first enqueued.")
    started_at = models.DateTimeField(null=True, blank=True, help_text="When its last attempt was claimed.")
    finished_at = models.DateTimeField()
    duration = models.FloatField(null=True, blank=True, help_text="Seconds its last run took, as its worker timed it.")
    exception_class = models.CharField(max_length=255, blank=True, default="")
    error = models.TextField(blank=True, default="")
    batch_id = models.BigIntegerField(null=True, blank=True)
    node_id = models.BigIntegerField(null=True, blank=True)

    objects = QueueDatabaseManager()

    class Meta:
        db_table = "dbqueue_finished_job"
        ordering = ["-finished_at", "-id"]
        verbose_name = "finished job"
        # PostgreSQL adds a GIN index on payload (jsonb_path_ops), for argument search, and a
        # partial one on finished_at for failures (migration 0018).
        indexes = [
            models.Index(fields=["finished_at"], name="dbqueue_finished_at"),
            models.Index(fields=["name", "finished_at"], name="dbqueue_finished_name"),
            models.Index(fields=["queue", "finished_at"], name="dbqueue_finished_queue"),
            models.Index(fields=["job_id"], name="dbqueue_finished_job_id"),
        ]

    def __str__(self) -> str:
        return f"{self.name} ({self.outcome} #{self.job_id})"

    @property
    def error_summary(self) -> str:
        return last_line(self.error)
