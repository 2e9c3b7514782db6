"""The queue's other tables: progress, workers, result records, schedules (where each stands,
and those stored at runtime), flow limits, unique windows, paused queues, batches, history and
the objects jobs are about."""

from __future__ import annotations

import secrets
from collections.abc import Iterable
from datetime import datetime, timedelta
from typing import Any

from django.core.validators import MaxValueValidator
from django.db import connections, models, transaction
from django.db.models import Exists, F, OuterRef, Q
from django.db.models.functions import Substr

from ..payload import REFERENCE_LENGTH
from ..states import BatchState
from .jobs import DB_NOW, Job, QueueDatabaseManager


class QueueTable(models.Model):
    """A table of the queue, read and written on the queue's database."""

    objects = QueueDatabaseManager()

    class Meta:
        abstract = True


class JobProgress(QueueTable):
    """Progress of one job (key = its id) or chain (key = ``chain:<id>``)."""

    id = models.BigAutoField(primary_key=True)
    key = models.CharField(max_length=100, unique=True)
    percent = models.FloatField(default=0)
    stage = models.CharField(max_length=200, blank=True, default="")
    finished = models.BooleanField(default=False)
    failed = models.BooleanField(default=False)
    error = models.TextField(blank=True, default="")
    updated_at = models.DateTimeField()

    class Meta:
        db_table = "dbqueue_job_progress"
        verbose_name_plural = "job progress"
        indexes = [models.Index(fields=["updated_at"], name="dbqueue_progress_updated")]
        constraints = [
            models.CheckConstraint(condition=Q(percent__gte=0, percent__lte=100), name="dbqueue_progress_percent_range")
        ]

    def __str__(self) -> str:
        return f"{self.key}: {self.percent:.0f}%"


class QueueControl(QueueTable):
    """Markers every worker on every host reads, such as a restart request."""

    key = models.CharField(max_length=100, unique=True)
    updated_at = models.DateTimeField()

    class Meta:
        db_table = "dbqueue_control"
        verbose_name = "queue control marker"

    def __str__(self) -> str:
        return f"{self.key} at {self.updated_at}"


class QueueWorker(QueueTable):
    """A live worker process, written at start and by its heartbeat; removed when it stops."""

    id = models.BigAutoField(primary_key=True)
    worker_id = models.CharField(max_length=100, unique=True, help_text="As in Job.reserved_by.")
    hostname = models.CharField(max_length=100)
    pid = models.PositiveIntegerField()
    queues = models.TextField(help_text="Queues served, comma-separated, highest priority first.")
    started_at = models.DateTimeField()
    last_seen_at = models.DateTimeField()
    # The options that matter to an operator, as "name=value" words (threads=4 batch=10 ...).
    options = models.CharField(max_length=200, blank=True, default="", db_default="")
    # Written by the heartbeat: jobs run, failed for good, running now, and the one running longest.
    processed = models.PositiveBigIntegerField(default=0, db_default=0)
    failed = models.PositiveBigIntegerField(default=0, db_default=0)
    running = models.PositiveIntegerField(default=0, db_default=0)
    current_job = models.CharField(max_length=255, blank=True, default="", db_default="")

    class Meta:
        db_table = "dbqueue_worker"
        verbose_name = "worker"
        indexes = [models.Index(fields=["last_seen_at"], name="dbqueue_worker_seen")]

    def __str__(self) -> str:
        return self.worker_id

    @property
    def queue_list(self) -> list[str]:
        return [queue for queue in self.queues.split(",") if queue]


class TaskResultRecord(QueueTable):
    """The outcome of a ``django.tasks`` task, kept after its job row is gone."""

    id = models.CharField(max_length=64, primary_key=True)
    task_path = models.CharField(max_length=255)
    backend = models.CharField(max_length=100)
    queue = models.CharField(max_length=100)
    priority = models.SmallIntegerField(default=0)
    status = models.CharField(max_length=20, db_index=True)
    args = models.JSONField(default=list)
    kwargs = models.JSONField(default=dict)
    return_value = models.JSONField(null=True, blank=True)
    # [{"exception_class_path": ..., "traceback": ...}], one per failed attempt.
    errors = models.JSONField(default=list)
    worker_ids = models.JSONField(default=list)
    # The job row running it now (a retry from FailedJob gets a new one).
    job_id = models.BigIntegerField(null=True, blank=True)
    enqueued_at = models.DateTimeField()
    started_at = models.DateTimeField(null=True, blank=True)
    last_attempted_at = models.DateTimeField(null=True, blank=True)
    finished_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        db_table = "dbqueue_task_result"
        verbose_name = "task result"
        indexes = [models.Index(fields=["finished_at"], name="dbqueue_task_result_finished")]

    def __str__(self) -> str:
        return f"{self.task_path} {self.id}: {self.status}"


class ScheduleState(QueueTable):
    """Where one periodic schedule declared in code stands (``schedules``): next tick, last run, enabled.

    A row whose schedule left the code is kept, with its history, and shown as stale.
    """

    id = models.BigAutoField(primary_key=True)
    name = models.CharField(max_length=200, unique=True)
    job_name = models.CharField(max_length=200)
    # As declared: a cron expression, a shorthand (@daily) or an interval ("every 30s").
    expression = models.CharField(max_length=200)
    timezone = models.CharField(max_length=64)
    arguments = models.TextField(default="{}")
    enabled = models.BooleanField(default=True)
    # None: computed from the database's clock by the next worker that looks.
    next_tick = models.DateTimeField(null=True, blank=True)
    # The last run enqueued: its tick (a scheduled time), when it was enqueued (a tick or "run now"), its job.
    last_tick = models.DateTimeField(null=True, blank=True)
    last_run_at = models.DateTimeField(null=True, blank=True)
    last_job_id = models.BigIntegerField(null=True, blank=True)
    # Runs enqueued, and ticks not run (missed while no worker ticked, or overlapping).
    runs = models.PositiveIntegerField(default=0)
    skipped = models.PositiveIntegerField(default=0)
    created_at = models.DateTimeField()
    updated_at = models.DateTimeField()

    # The database's clock, on rows read by queries that annotate it.
    db_now: datetime

    class Meta:
        db_table = "dbqueue_schedule"
        verbose_name = "schedule"
        ordering = ["name"]
        indexes = [models.Index(fields=["next_tick"], name="dbqueue_schedule_next")]
        permissions = [("run_schedule", "Can run a schedule now")]

    def __str__(self) -> str:
        return self.name


# The longest jitter a stored schedule may have: an hour (``dbqueue_stored_schedule_jitter``).
MAX_JITTER = 3600


def draw_revision() -> int:
    """A stored schedule's new revision: workers see a change when the rows' count or the sum of
    their revisions changes (a random number, unlike a time, is not fooled by skewed clocks)."""
    return secrets.randbits(31)


class StoredSchedule(QueueTable):
    """A periodic schedule made at runtime (admin, ``queue_schedules``), ticked as those declared in code.

    Where it stands (next tick, last run) is the ``ScheduleState`` row of the same name. Save it
    through ``schedules.save_stored``, which checks the job, its arguments, the cron expression and
    the time zone.
    """

    id = models.BigAutoField(primary_key=True)
    name = models.CharField(max_length=200, unique=True, help_text="The schedule's key; unique with those in code.")
    job_name = models.CharField(max_length=200, help_text="A registered job's name.")
    args = models.JSONField(default=list, blank=True, help_text='Positional arguments, a JSON list: ["eu", 3].')
    kwargs = models.JSONField(default=dict, blank=True, help_text='Keyword arguments, a JSON object: {"full": true}.')
    cron = models.CharField(
        max_length=100,
        help_text="5 fields (minute hour day month weekday), 6 with seconds first, or @daily, @hourly ...",
    )
    timezone = models.CharField(max_length=64, blank=True, default="", help_text="Blank: settings.TIME_ZONE.")
    queue = models.CharField(max_length=100, blank=True, default="", help_text="Blank: the job's own queue.")
    enabled = models.BooleanField(default=True)
    jitter = models.PositiveIntegerField(
        default=0,
        validators=[MaxValueValidator(MAX_JITTER)],
        help_text=f"Tick up to so many seconds after the expression's time (0 to {MAX_JITTER}): a fixed "
        "offset of this schedule's own, the same at every tick.",
    )
    tick_argument = models.CharField(
        max_length=100,
        blank=True,
        default="",
        help_text="Pass the tick (an aware datetime) as this keyword; blank: not.",
    )
    revision = models.PositiveIntegerField(default=0, editable=False)
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        db_table = "dbqueue_stored_schedule"
        verbose_name = "stored schedule"
        ordering = ["name"]
        constraints = [
            models.CheckConstraint(condition=Q(jitter__lte=MAX_JITTER), name="dbqueue_stored_schedule_jitter")
        ]

    def __str__(self) -> str:
        return self.name

    def save(self, *args: Any, **kwargs: Any) -> None:
        self.revision = draw_revision()
        if kwargs.get("update_fields") is not None:
            kwargs["update_fields"] = {*kwargs["update_fields"], "revision", "updated_at"}
        super().save(*args, **kwargs)


class FlowLimitManager(QueueDatabaseManager):
    def lock(self, keys: Iterable[str]) -> dict[str, FlowLimit]:
        """Lock the rows of ``keys`` in key order (no circle of waits), creating the missing ones;
        return them by key, with the database's clock in ``db_now``."""
        keys = sorted(set(keys))
        queryset = self.get_queryset()
        found = {row.key: row for row in _locked(queryset.filter(key__in=keys))}
        # Twice: a row ``prune`` deleted between the insert and the lock is made again.
        for _ in range(2):
            missing = [key for key in keys if key not in found]
            if not missing:
                break
            queryset.bulk_create([FlowLimit(key=key) for key in missing], ignore_conflicts=True)
            found.update({row.key: row for row in _locked(queryset.filter(key__in=missing))})
        return found

    def prune(self, *, older_than: timedelta, concurrency_prefix: str) -> int:
        """Delete the rows no claim needs (made again when one does); return how many.

        A rate bucket not refilled for ``older_than`` and holding no job back would be
        full again; a concurrency key's row that no job names holds no slot.
        """
        queryset = self.get_queryset()
        using = queryset.db
        now = queryset.annotate(**DB_NOW).values_list("db_now", flat=True).first()
        if now is None:
            return 0
        unused_bucket = Q(updated_at__lt=now - older_than) & (Q(held_until__isnull=True) | Q(held_until__lt=now))
        jobs = Job.objects.db_manager(using).get_queryset()
        named = jobs.filter(concurrency_key=Substr(OuterRef("key"), len(concurrency_prefix) + 1))
        unused_key = Q(updated_at__isnull=True, key__startswith=concurrency_prefix) & ~Exists(named)
        with transaction.atomic(using=using):
            candidates = queryset.filter(unused_bucket | unused_key).order_by("key")
            if connections[using].features.has_select_for_update_skip_locked:
                candidates = candidates.select_for_update(skip_locked=True)
            ids = list(candidates.values_list("pk", flat=True)[:PRUNE_CHUNK])
            if ids:
                queryset.filter(pk__in=ids).delete()
        return len(ids)


# FlowLimit rows one prune deletes at most (the next prune takes the rest).
PRUNE_CHUNK = 10_000


def _locked(queryset: models.QuerySet[Any]) -> list[Any]:
    return list(queryset.order_by("key").select_for_update().annotate(**DB_NOW))


class FlowLimit(models.Model):
    """A row per concurrency key and per rate-limit bucket, locked by the claims that use it.

    The lock serialises the claims of one key across workers and hosts.
    """

    key = models.CharField(max_length=255, unique=True)
    tokens = models.FloatField(default=0)
    updated_at = models.DateTimeField(null=True, blank=True)
    # A rate bucket: when the next job held back is due, so successive ones are spaced at its rate.
    held_until = models.DateTimeField(null=True, blank=True)

    objects = FlowLimitManager()

    db_now: datetime

    class Meta:
        db_table = "dbqueue_limit"
        verbose_name = "flow limit"

    def __str__(self) -> str:
        return self.key


class UniqueWindow(QueueTable):
    """A unique key taken for a time (``@job(unique_for=...)``), whatever became of its job."""

    key = models.CharField(max_length=255, unique=True)
    job_id = models.BigIntegerField(null=True, blank=True)
    expires_at = models.DateTimeField()

    class Meta:
        db_table = "dbqueue_unique_window"
        verbose_name = "unique window"
        indexes = [models.Index(fields=["expires_at"], name="dbqueue_unique_window_expires")]

    def __str__(self) -> str:
        return self.key


class PausedQueue(QueueTable):
    """A paused queue: workers claim none of its jobs until it is resumed (the row deleted)."""

    queue = models.CharField(max_length=100, unique=True)
    paused_at = models.DateTimeField()

    class Meta:
        db_table = "dbqueue_paused_queue"
        verbose_name = "paused queue"
        permissions = [("pause_queue", "Can pause and resume queues")]

    def __str__(self) -> str:
        return self.queue


# Each BatchState in SQL, as ``JobBatch.state`` reads it on a row.
BATCH_STATES = {
    BatchState.RUNNING: Q(cancelled_at__isnull=True, finished_at__isnull=True),
    BatchState.FINISHED: Q(cancelled_at__isnull=True, finished_at__isnull=False, failed=0),
    BatchState.FAILED: Q(cancelled_at__isnull=True, finished_at__isnull=False, failed__gt=0),
    BatchState.CANCELLING: Q(cancelled_at__isnull=False, finished_at__isnull=True),
    BatchState.CANCELLED: Q(cancelled_at__isnull=False, finished_at__isnull=False),
}


class JobBatchQuerySet(models.QuerySet["JobBatch"]):
    def in_state(self, *states: str) -> JobBatchQuerySet:
        """The batches in any of ``states`` (``BatchState`` values)."""
        condition = Q(pk__in=[])
        for state in dict.fromkeys(states):
            condition |= BATCH_STATES[BatchState(state)]
        return self.filter(condition)


class JobBatch(models.Model):
    """A batch of jobs (batches.py): its counters move in the transactions that end its members.

    ``total = pending + succeeded + failed + cancelled`` at every commit; a failed member retried is pending again.
    """

    id = models.BigAutoField(primary_key=True)
    name = models.CharField(max_length=200, blank=True, default="")
    total = models.PositiveIntegerField(default=0)
    pending = models.PositiveIntegerField(default=0)
    failed = models.PositiveIntegerField(default=0)
    # Members that were still waiting when the batch was cancelled: deleted, never run.
    cancelled = models.PositiveIntegerField(default=0)
    allow_failures = models.BooleanField(default=False)
    # {"then": [step, ...], "on_failure": [...], "on_finish": [...]}, JSON steps as a chain's.
    callbacks = models.TextField(blank=True, default="")
    created_at = models.DateTimeField()
    # Set when ``pending`` reaches 0; cleared when a retry brings members back.
    finished_at = models.DateTimeField(null=True, blank=True)
    cancelled_at = models.DateTimeField(null=True, blank=True)

    objects = QueueDatabaseManager.from_queryset(JobBatchQuerySet)()

    class Meta:
        db_table = "dbqueue_batch"
        verbose_name = "batch"
        verbose_name_plural = "batches"
        ordering = ["-created_at", "-id"]
        indexes = [models.Index(fields=["finished_at"], name="dbqueue_batch_finished")]
        permissions = [("cancel_batch", "Can cancel batches")]
        constraints = [
            models.CheckConstraint(
                condition=Q(pending__lte=F("total")) & Q(failed__lte=F("total")), name="dbqueue_batch_counts"
            )
        ]

    def __str__(self) -> str:
        return f"{self.name or 'batch'} #{self.pk}"

    @property
    def succeeded(self) -> int:
        return self.total - self.pending - self.failed - self.cancelled

    @property
    def done(self) -> int:
        """Members that ended, one way or another."""
        return self.total - self.pending

    @property
    def percent(self) -> float:
        """Members ended, as a percent of all (100 for an empty batch)."""
        return round(100.0 * self.done / self.total, 2) if self.total else 100.0

    @property
    def state(self) -> BatchState:
        if self.cancelled_at is not None:
            return BatchState.CANCELLED if self.finished_at is not None else BatchState.CANCELLING
        if self.finished_at is None:
            return BatchState.RUNNING
        return BatchState.FAILED if self.failed else BatchState.FINISHED


class JobHistory(QueueTable):
    """Counts of job runs per minute, queue and job name, added by each heartbeat (history.py).

    ``run_time`` totals the seconds of the runs that ended; ``h0``..``h12`` count them
    by run time in the buckets of ``history.BOUNDS`` (the last: longer than all).
    """

    id = models.BigAutoField(primary_key=True)
    bucket = models.DateTimeField(help_text="The minute the counts belong to (the worker's clock).")
    queue = models.CharField(max_length=100)
    name = models.CharField(max_length=200)
    started = models.PositiveBigIntegerField(default=0)
    succeeded = models.PositiveBigIntegerField(default=0)
    failed = models.PositiveBigIntegerField(default=0)
    retried = models.PositiveBigIntegerField(default=0)
    run_time = models.FloatField(default=0)

    class Meta:
        db_table = "dbqueue_history"
        verbose_name = "job history bucket"
        verbose_name_plural = "job history"
        constraints = [models.UniqueConstraint(fields=["bucket", "queue", "name"], name="dbqueue_history_key")]

    def __str__(self) -> str:
        return f"{self.bucket:%Y-%m-%d %H:%M} {self.queue} {self.name}"


class JobReference(QueueTable):
    """One object that a job's arguments hold (``about``): written with the job's row, in its
    transaction (``insert``); found by ``ref``; pruned once the job is in no table."""

    id = models.BigAutoField(primary_key=True)
    job_id = models.BigIntegerField(help_text="The job, queued, failed or finished.")
    ref = models.CharField(max_length=REFERENCE_LENGTH, help_text="Its model's label and pk: demo.order:42.")

    class Meta:
        db_table = "dbqueue_job_reference"
        # The lookup: one object's jobs, newest first. The unique key serves a job's references too.
        indexes = [models.Index(fields=["ref", "job_id"], name="dbqueue_reference_ref")]
        constraints = [models.UniqueConstraint(fields=["job_id", "ref"], name="dbqueue_reference_job")]

    def __str__(self) -> str:
        return f"job {self.job_id}: {self.ref}"


# h0..h12: the runs by run time, in the buckets of ``history.BOUNDS`` (added as the migrations made them).
for _bin in range(13):
    JobHistory.add_to_class(f"h{_bin}", models.PositiveBigIntegerField(default=0))
