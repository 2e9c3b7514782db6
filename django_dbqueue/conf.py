"""The ``DBQUEUE`` settings dict: defaults, and the only reader of settings."""

from __future__ import annotations

from functools import cache
from typing import Any

from django.conf import settings
from django.core.signals import setting_changed
from django.dispatch import receiver

DEFAULTS: dict[str, Any] = {
    # Database alias that holds the queue tables. Only the default alias joins
    # the caller's transaction; any other alias makes enqueueing independent.
    "DATABASE": "default",
    # Queue used by jobs that name none.
    "QUEUE": "default",
    # Reservations a job gets before it moves to FailedJob.
    "TRIES": 3,
    # Seconds after which a reservation is presumed dead and reclaimed.
    "RETRY_AFTER": 60,
    # Seconds a single run may take; None for no limit.
    "TIMEOUT": 45,
    # Seconds a job stopped at its timeout gets before its process is ended.
    "TIMEOUT_GRACE": 5,
    # Seconds to wait before a failed job runs again: a number, one per attempt, "exponential"
    # (1, 2, 4 ... s up to 600, with jitter) or a registry.Exponential.
    "BACKOFF": 0,
    # Seconds an idle worker waits before it polls again.
    "SLEEP": 1.0,
    # Import each installed app's ``jobs`` module when Django starts.
    "AUTODISCOVER": True,
    # Hours after which idle workers delete progress rows; None keeps them
    # (prune with ``queue_prune_progress``).
    "PROGRESS_MAX_AGE": None,
    # Hours after which idle workers delete kept results (of jobs and of django.tasks
    # tasks) that finished that long ago; None keeps them (prune with ``queue_prune_results``).
    "RESULT_MAX_AGE": None,
    # Keep every job's return value and errors in the result store (a job's
    # ``@job(results=...)`` overrides it); pruned after RESULT_MAX_AGE hours.
    "RESULTS": False,
    # Hours after which idle workers delete the stored results of durable steps
    # (``context.step``) whose job is gone, neither queued nor failed; None keeps them.
    "STEP_MAX_AGE": 168,
    # Hours after its last node ended that idle workers delete a workflow, its nodes and edges
    # (its jobs' results and failed jobs go by their own settings); None keeps them.
    "WORKFLOW_MAX_AGE": 168,
    # Seconds a progress token (``progress.progress_token``) stays valid: an
    # hour, as long as a page polls one job; a page loaded again gets a new one.
    "PROGRESS_TOKEN_MAX_AGE": 3600,
    # Serve the last line of a failed job's error in the progress view. Off:
    # error text often carries personal data or secrets.
    "PROGRESS_SHOW_ERROR": False,
    # Characters of error text (tracebacks) stored per failure: the head and the
    # tail are kept, with a marker between them. None: no limit.
    "ERROR_MAX_LENGTH": 20000,
    # A callable (or its dotted path) that takes error text and returns it with
    # secrets removed, applied before it is stored or logged; None: stored as is.
    "ERROR_SCRUBBER": "django_dbqueue.errors.scrub_secrets",
    # Largest encoded payload (bytes) a job may be enqueued with; None: no limit.
    "MAX_PAYLOAD_SIZE": 1024 * 1024,
    # The queue names jobs may use; None: any valid name.
    "QUEUES": None,
    # Alias the read-only counts (admin overview, queue_monitor) may read, such as
    # a replica; None: DATABASE. Claims and state changes always use DATABASE.
    "READ_DATABASE": None,
    # Idle workers on PostgreSQL LISTEN for new jobs; False: they only poll (for
    # a transaction pooler such as PgBouncer, when no LISTEN_DATABASE is set).
    "LISTEN": True,
    # Alias with a direct (not transaction-pooled) connection to the queue's
    # PostgreSQL server, used only for LISTEN; None: DATABASE.
    "LISTEN_DATABASE": None,
    # Seconds a silent network may stall a worker's database call before its
    # connection counts as broken (TCP keepalives and user timeout on PostgreSQL,
    # read/write timeouts on MariaDB/MySQL); None: the driver's defaults.
    "NETWORK_TIMEOUT": 30,
    # Middleware wrapped around every run of every job, outermost first: callables
    # ``middleware(context, call_next)`` or their dotted paths (see middleware.py).
    "MIDDLEWARE": [],
    # Rate limits per queue: {"emails": "100/m"} or {"emails": {"rate": "100/m", "burst": 10}};
    # a claim of such a queue takes no more jobs than its bucket has tokens (rates.py).
    "RATE_LIMITS": {},
    # Seconds between two refreshes of a worker's row (workers.py); a worker silent
    # for three of them counts as dead, and idle workers reclaim its jobs.
    "WORKER_BEAT": 10,
    # Count runs per minute, queue and job name (history.py), written with the heartbeat.
    "HISTORY": True,
    # Hours after which idle workers fold history rows into one total per queue and
    # job name (history.prune); None keeps them.
    "HISTORY_MAX_AGE": 48,
    # Hours to keep a row per finished job (succeeded, failed or cancelled: its arguments,
    # outcome, times, worker and error), searchable in the admin (finished.py); None: none kept.
    # Pruned by idle workers: on PostgreSQL whole days go, so a row stays up to a day longer.
    "KEEP_FINISHED": None,
    # A secret that opens the metrics and health views (metrics_urls.py) to a client
    # that sends it as "Authorization: Bearer <token>" or ?token=; None: logged-in
    # users with the django_dbqueue.view_job permission only.
    "METRICS_TOKEN": None,
    # Back off the database (pressure.py): None, or {"CLAIM_MS": 25, "LOCK_WAITS": None, "MAX_PAUSE": 2.0}:
    # while a worker's claims take longer than CLAIM_MS (moving average) or, on PostgreSQL, that many
    # sessions wait on a lock, it pauses before each claim, up to MAX_PAUSE seconds.
    "PRESSURE": None,
    # Tests only: run each job as soon as its enqueue commits, in the enqueuing process, as
    # ``django_dbqueue.testing.run_jobs`` runs it (docs/howto/testing.md); never in production.
    "IMMEDIATE": False,
}


@cache
def get_settings() -> dict[str, Any]:
    """Return the defaults merged with the project's ``DBQUEUE`` dict."""
    return {**DEFAULTS, **(user_settings() or {})}


def get(key: str) -> Any:
    """Return one setting."""
    return get_settings()[key]


def task_backend_queues() -> set[str] | None:
    """The queues of the project's ``TASKS`` backends that are this package's; None if there are none."""
    backends = getattr(settings, "TASKS", None) or {}
    ours = [params for params in backends.values() if str(params.get("BACKEND", "")).startswith("django_dbqueue.")]
    if not ours:
        return None
    # Django's BaseTaskBackend: QUEUES, else the one queue "default".
    return {queue for params in ours for queue in params.get("QUEUES", ["default"])}


def user_settings() -> Any:
    """Return the project's ``DBQUEUE`` value as written, for the system checks."""
    return getattr(settings, "DBQUEUE", None)


@receiver(setting_changed)
def _clear_cache(*, setting: str, **kwargs: Any) -> None:
    if setting == "DBQUEUE":
        get_settings.cache_clear()
