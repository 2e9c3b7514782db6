"""System checks for the mistakes a project can make configuring the queue."""

from __future__ import annotations

import difflib
from collections.abc import Sequence
from typing import Any

import django
from django.conf import settings
from django.core.checks import CheckMessage, Error, Tags, Warning, register
from django.core.exceptions import ImproperlyConfigured
from django.db import DatabaseError, connections
from django.urls import NoReverseMatch, reverse

from . import conf, middleware, pauses, pressure, rates, registry, schedules, schema, validation
from .db import CLAIM_VENDORS, pool_size
from .metrics import prometheus_installed
from .pool import connections_per_process
from .validation import MAX_SECONDS, MAX_TRIES

# Characters a METRICS_TOKEN needs at least: a short one can be guessed.
MIN_TOKEN_LENGTH = 16
# Seconds SQLite's busy timeout should give a writer (Python's default is 5): a worker's
# claim waits this long for another process's write instead of failing at once.
SQLITE_BUSY_TIMEOUT = 20

# What each check id means, for the reference page (docs/_ext/dbqueue_reference.py reads it and
# warns about an id reported somewhere in the package but missing here, or listed here but
# reported nowhere). Documentation only: no check reads it.
CHECK_IDS: dict[str, str] = {
    "dbqueue.E001": "``DBQUEUE`` is not a dict.",
    "dbqueue.E002": "``DBQUEUE`` has an unknown key; the hint names the closest known key.",
    "dbqueue.E003": "A ``DBQUEUE`` value has the wrong type or is out of range (the message says what it must be), "
    "or a ``MIDDLEWARE`` path does not import.",
    "dbqueue.E004": "``DATABASE``, ``READ_DATABASE`` or ``LISTEN_DATABASE`` is not an alias of ``DATABASES``.",
    "dbqueue.E005": "The queue's database cannot claim jobs safely: it is not PostgreSQL, MariaDB/MySQL or SQLite.",
    "dbqueue.E006": "MariaDB older than 10.6 or MySQL older than 8: no ``SKIP LOCKED``.",
    "dbqueue.E007": "A ``TASKS`` backend is ``django_dbqueue.tasks.DatabaseBackend``, but the app is not installed.",
    "dbqueue.E008": "The Tasks backend's ``OPTIONS`` has an unknown key.",
    "dbqueue.E009": "``TASKS`` uses the backend on Django older than 6.0, which has no ``django.tasks``.",
    "dbqueue.E010": "The Tasks backend's database cannot claim jobs safely (not PostgreSQL, MariaDB/MySQL or SQLite).",
    "dbqueue.E011": "A periodic schedule's cron expression cannot be read.",
    "dbqueue.E012": "A periodic schedule's time zone is unknown.",
    "dbqueue.E013": "A periodic schedule names a job that is not registered.",
    "dbqueue.W001": "``RETRY_AFTER`` is not longer than ``TIMEOUT``: a running job could be reclaimed and run twice.",
    "dbqueue.W002": "A job's ``retry_after`` is not longer than its ``timeout``.",
    "dbqueue.W003": "``queue_work --concurrency`` above 1 on SQLite: allowed, but writers wait on each other.",
    "dbqueue.W004": "``queue_work --timeout`` is not shorter than ``RETRY_AFTER``.",
    "dbqueue.W005": "With ``QUEUES`` set: ``QUEUE``, or a job's ``@job(queue=...)``, is not in it.",
    "dbqueue.W006": "``queue_work --queue`` serves a queue that is not in ``QUEUES`` (the worker still runs).",
    "dbqueue.W007": "A ``queue_work`` may open half the ``max_connections`` or more: processes x (threads + 5), "
    "or processes x the size of Django's connection pool.",
    "dbqueue.W008": "``metrics_urls`` is mounted without ``prometheus_client``: the metrics view answers 501.",
    "dbqueue.W009": "The queue's database lacks the app's tables or its latest migration: run "
    "``manage.py migrate django_dbqueue`` (a warning, so that ``migrate`` itself still runs; ``queue_work`` "
    "refuses to start and ``queue_health`` is unhealthy).",
    "dbqueue.W010": "``queue_work --queue`` serves a queue that no registered job, schedule, row or worker uses "
    "(without ``QUEUES``; the worker still runs).",
    "dbqueue.W011": "The queue's database is SQLite without the settings a worker needs: WAL journal mode, "
    "a busy timeout, ``transaction_mode`` ``IMMEDIATE``.",
}


def _number(value: Any, *, minimum: float, integer: bool = False) -> bool:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    return (isinstance(value, int) or not integer) and value >= minimum


def _optional_int(value: Any, minimum: int) -> bool:
    return value is None or _number(value, minimum=minimum, integer=True)


def _whole(value: Any, minimum: int, maximum: int) -> bool:
    return _number(value, minimum=minimum, integer=True) and value <= maximum


def _dotted(value: Any) -> bool:
    return isinstance(value, str) and "." in value and all(part.isidentifier() for part in value.split("."))


def _queue_names(value: Any) -> bool:
    return (
        isinstance(value, (list, tuple))
        and bool(value)
        and all(validation.queue_name_error(name) is None for name in value)
    )


def _rate_limits(value: Any) -> bool:
    if not isinstance(value, dict):
        return False
    for queue, limit in value.items():
        if validation.queue_name_error(queue) is not None:
            return False
        try:
            rates.queue_setting(limit)
        except ValueError:
            return False
    return True


VALIDATORS: dict[str, tuple[str, Any]] = {
    "DATABASE": ("a database alias (str)", lambda v: isinstance(v, str) and bool(v)),
    "QUEUE": ("a valid queue name", lambda v: validation.queue_name_error(v) is None),
    "TRIES": (f"an int from 1 to {MAX_TRIES}", lambda v: _whole(v, 1, MAX_TRIES)),
    "RETRY_AFTER": (f"an int from 1 to {MAX_SECONDS} (seconds)", lambda v: _whole(v, 1, MAX_SECONDS)),
    "TIMEOUT": (f"an int from 1 to {MAX_SECONDS} (seconds) or None", lambda v: v is None or _whole(v, 1, MAX_SECONDS)),
    "TIMEOUT_GRACE": ("a number > 0 (seconds)", lambda v: _number(v, minimum=0.001)),
    "BACKOFF": (
        f"seconds from 0 to {MAX_SECONDS}, a list of them, 'exponential' or an Exponential",
        registry.valid_backoff,
    ),
    "SLEEP": ("a number >= 0 (seconds)", lambda v: _number(v, minimum=0)),
    "AUTODISCOVER": ("a bool", lambda v: isinstance(v, bool)),
    "PROGRESS_MAX_AGE": ("a number of hours > 0, or None", lambda v: v is None or _number(v, minimum=0.001)),
    "RESULT_MAX_AGE": ("a number of hours > 0, or None", lambda v: v is None or _number(v, minimum=0.001)),
    "RESULTS": ("a bool", lambda v: isinstance(v, bool)),
    "STEP_MAX_AGE": ("a number of hours > 0, or None", lambda v: v is None or _number(v, minimum=0.001)),
    "WORKFLOW_MAX_AGE": ("a number of hours > 0, or None", lambda v: v is None or _number(v, minimum=0.001)),
    "PROGRESS_TOKEN_MAX_AGE": ("an int >= 1 (seconds)", lambda v: _number(v, minimum=1, integer=True)),
    "PROGRESS_SHOW_ERROR": ("a bool", lambda v: isinstance(v, bool)),
    "ERROR_MAX_LENGTH": ("an int >= 200 (characters) or None", lambda v: _optional_int(v, 200)),
    "ERROR_SCRUBBER": ("a callable, its dotted path, or None", lambda v: v is None or callable(v) or _dotted(v)),
    "MAX_PAYLOAD_SIZE": ("an int >= 1024 (bytes) or None", lambda v: _optional_int(v, 1024)),
    "QUEUES": ("None, or a non-empty list of valid queue names", lambda v: v is None or _queue_names(v)),
    "READ_DATABASE": ("a database alias (str) or None", lambda v: v is None or (isinstance(v, str) and bool(v))),
    "LISTEN": ("a bool", lambda v: isinstance(v, bool)),
    "LISTEN_DATABASE": ("a database alias (str) or None", lambda v: v is None or (isinstance(v, str) and bool(v))),
    "NETWORK_TIMEOUT": ("a number >= 1 (seconds) or None", lambda v: v is None or _number(v, minimum=1)),
    "MIDDLEWARE": ("a list of middleware: callables, or dotted paths that import to callables", middleware.valid_list),
    "RATE_LIMITS": (
        "a dict of queue name to a rate limit: 'N/unit' (unit s, m, h or d, such as '100/m') "
        "or {'rate': 'N/unit', 'burst': n}",
        _rate_limits,
    ),
    "WORKER_BEAT": ("a number >= 0.1 (seconds)", lambda v: _number(v, minimum=0.1)),
    "HISTORY": ("a bool", lambda v: isinstance(v, bool)),
    "HISTORY_MAX_AGE": ("a number of hours > 0, or None", lambda v: v is None or _number(v, minimum=0.001)),
    "KEEP_FINISHED": ("a number of hours > 0, or None", lambda v: v is None or _number(v, minimum=0.001)),
    "METRICS_TOKEN": (
        f"a string of at least {MIN_TOKEN_LENGTH} characters that neither starts nor ends with a space "
        "(such as secrets.token_urlsafe()), or None",
        lambda v: v is None or (isinstance(v, str) and len(v) >= MIN_TOKEN_LENGTH and v == v.strip()),
    ),
    "PRESSURE": (
        "None, or a dict of 'CLAIM_MS' (milliseconds > 0), 'LOCK_WAITS' (an int >= 1 or None) and "
        "'MAX_PAUSE' (seconds > 0), each optional",
        pressure.valid,
    ),
    "IMMEDIATE": ("a bool", lambda v: isinstance(v, bool)),
}
assert set(VALIDATORS) == set(conf.DEFAULTS)


@register()
def check_settings(app_configs: Sequence[Any] | None = None, **kwargs: Any) -> list[CheckMessage]:
    user = conf.user_settings()
    if user is None:
        return []
    if not isinstance(user, dict):
        return [Error("DBQUEUE must be a dict.", hint=f"It is a {type(user).__name__}.", id="dbqueue.E001")]
    messages: list[CheckMessage] = []
    for key, value in user.items():
        if key not in conf.DEFAULTS:
            close = difflib.get_close_matches(str(key), list(conf.DEFAULTS), n=1)
            messages.append(
                Error(
                    f"DBQUEUE has an unknown key {key!r}.",
                    hint=f"Did you mean {close[0]!r}?" if close else f"Known keys: {', '.join(conf.DEFAULTS)}.",
                    id="dbqueue.E002",
                )
            )
            continue
        expected, valid = VALIDATORS[key]
        if not valid(value):
            messages.append(Error(f"DBQUEUE[{key!r}] must be {expected}, not {value!r}.", id="dbqueue.E003"))
    if messages:
        return messages
    for key in ("DATABASE", "READ_DATABASE", "LISTEN_DATABASE"):
        value = conf.get(key)
        if value is not None and value not in settings.DATABASES:
            messages.append(
                Error(
                    f"DBQUEUE[{key!r}] is {value!r}, which is not in DATABASES.",
                    hint=f"Use one of: {', '.join(settings.DATABASES)}.",
                    id="dbqueue.E004",
                )
            )
    return messages


@register()
def check_timeouts(app_configs: Sequence[Any] | None = None, **kwargs: Any) -> list[CheckMessage]:
    """A reservation should outlive a run: the heartbeat keeps a live worker's, but not a
    worker stuck in C code that holds the GIL, whose job is reclaimed and runs twice."""
    try:
        retry_after, timeout = int(conf.get("RETRY_AFTER")), conf.get("TIMEOUT")
    except (TypeError, ValueError):
        return []  # check_settings reports it
    messages: list[CheckMessage] = []
    if isinstance(timeout, int) and retry_after <= timeout:
        messages.append(
            Warning(
                f"DBQUEUE['RETRY_AFTER'] ({retry_after} s) is not longer than DBQUEUE['TIMEOUT'] ({timeout} s).",
                hint="A worker's heartbeat keeps its reservations while it runs Python code, but a job "
                "stuck in C code that holds the GIL stops the heartbeat too: its reservation expires and "
                "the job runs a second time in parallel before the worker's hard stop (TIMEOUT plus "
                "TIMEOUT_GRACE) ends it. Make RETRY_AFTER longer than TIMEOUT by a margin.",
                id="dbqueue.W001",
            )
        )
    for definition in registry.all_definitions().values():
        job_retry_after = definition.retry_after or retry_after
        job_timeout = definition.timeout or timeout
        if (definition.retry_after or definition.timeout) and job_timeout and job_retry_after <= job_timeout:
            messages.append(
                Warning(
                    f"Job {definition.name!r} has retry_after {job_retry_after} s, not longer than its "
                    f"timeout {job_timeout} s.",
                    hint="Give it a retry_after longer than its timeout: @job(timeout=..., retry_after=...).",
                    obj=definition.func,
                    id="dbqueue.W002",
                )
            )
    return messages


@register()
def check_queues(app_configs: Sequence[Any] | None = None, **kwargs: Any) -> list[CheckMessage]:
    """With ``QUEUES`` set, the default queue and every job definition's queue should be in it."""
    known = conf.get("QUEUES")
    if not isinstance(known, (list, tuple)) or not known:
        return []  # None, or check_settings reports it
    listed = ", ".join(map(repr, known))
    messages: list[CheckMessage] = []
    default = conf.get("QUEUE")
    if default not in known:
        messages.append(
            Warning(
                f"DBQUEUE['QUEUE'] is {default!r}, which is not in DBQUEUE['QUEUES'] ({listed}).",
                hint="Jobs that name no queue go to QUEUE, and enqueueing them would fail: add it to QUEUES, "
                "or set QUEUE to one of them.",
                id="dbqueue.W005",
            )
        )
    for definition in registry.all_definitions().values():
        if definition.queue is not None and definition.queue not in known:
            messages.append(
                Warning(
                    f"Job {definition.name!r} uses the queue {definition.queue!r}, which is not in "
                    f"DBQUEUE['QUEUES'] ({listed}).",
                    hint="Enqueueing it would fail: add the queue to QUEUES, or fix the name in @job(queue=...).",
                    obj=definition.func,
                    id="dbqueue.W005",
                )
            )
    return messages


@register(Tags.database)
def check_database(
    app_configs: Sequence[Any] | None = None, databases: Sequence[str] | None = None, **kwargs: Any
) -> list[CheckMessage]:
    """The queue's database must be able to claim a row for exactly one worker."""
    alias = conf.get("DATABASE")
    if not databases or alias not in databases or alias not in connections:
        return []
    connection = connections[alias]
    if connection.vendor not in CLAIM_VENDORS:
        return [
            Error(
                f"The queue's database {alias!r} uses {connection.vendor}, where django-dbqueue cannot "
                "claim jobs safely.",
                hint="Use PostgreSQL, MariaDB >= 10.6, MySQL >= 8 or SQLite.",
                id="dbqueue.E005",
            )
        ]
    if connection.vendor == "mysql":
        try:
            skip_locked = connection.features.has_select_for_update_skip_locked
        except DatabaseError:
            return []
        if not skip_locked:
            return [
                Error(
                    f"The queue's database {alias!r} does not support SELECT ... FOR UPDATE SKIP LOCKED.",
                    hint="Upgrade to MariaDB >= 10.6 or MySQL >= 8.0.1.",
                    id="dbqueue.E006",
                )
            ]
    return []


@register(Tags.database)
def check_migrations(
    app_configs: Sequence[Any] | None = None, databases: Sequence[str] | None = None, **kwargs: Any
) -> list[CheckMessage]:
    """The queue's database needs the app's tables and latest migration; a warning, not an
    error, since ``migrate`` runs these checks before it migrates."""
    alias = conf.get("DATABASE")
    if not databases or alias not in databases or alias not in connections:
        return []
    found = schema.problem(alias)
    if found is None:
        return []
    return [
        Warning(
            found,
            hint="Until then no worker can claim a job: queue_work refuses to start and queue_health is "
            "unhealthy. (Shown by migrate too, before it migrates.)",
            id="dbqueue.W009",
        )
    ]


@register(Tags.database)
def check_sqlite(
    app_configs: Sequence[Any] | None = None, databases: Sequence[str] | None = None, **kwargs: Any
) -> list[CheckMessage]:
    """On SQLite a worker and the web process write to one file: without WAL a writer blocks
    the readers, without a busy timeout a write fails at once, and a deferred transaction that
    reads then writes fails with "database is locked" whatever the timeout."""
    alias = conf.get("DATABASE")
    if not databases or alias not in databases or alias not in connections:
        return []
    connection = connections[alias]
    if connection.vendor != "sqlite":
        return []
    try:
        with connection.cursor() as cursor:
            cursor.execute("PRAGMA journal_mode")
            row = cursor.fetchone()
    except DatabaseError:
        return []
    journal = str(row[0]).lower() if row else ""
    if journal == "memory":
        return []  # an in-memory database: no other process can reach it
    options = connection.settings_dict.get("OPTIONS") or {}
    missing: dict[str, Any] = {}
    why = []
    if journal != "wal":
        # WAL stays set in the file once set; init_command sets it on every connection.
        before = str(options.get("init_command") or "").strip().rstrip(";")
        missing["init_command"] = f"{before}; PRAGMA journal_mode=WAL;" if before else "PRAGMA journal_mode=WAL;"
        why.append(f"journal mode {journal!r}, not WAL (a writer blocks every reader)")
    timeout = options.get("timeout", 5)
    if not isinstance(timeout, (int, float)) or timeout < SQLITE_BUSY_TIMEOUT:
        missing["timeout"] = SQLITE_BUSY_TIMEOUT
        why.append(f"a busy timeout of {timeout!r} s (a write waits that long for another's)")
    if django.VERSION >= (5, 1) and str(options.get("transaction_mode", "")).upper() != "IMMEDIATE":
        missing["transaction_mode"] = "IMMEDIATE"
        why.append("deferred transactions (one that reads then writes fails with 'database is locked')")
    if not missing:
        return []
    return [
        Warning(
            f"The queue's database {alias!r} is SQLite with {'; '.join(why)}.",
            hint=f"Add to DATABASES[{alias!r}]['OPTIONS']: {missing!r}.",
            id="dbqueue.W011",
        )
    ]


@register()
def check_tasks_backend(app_configs: Sequence[Any] | None = None, **kwargs: Any) -> list[CheckMessage]:
    """The django.tasks backend needs django.tasks, which Django 6.0 added."""
    if django.VERSION < (6, 0) and conf.task_backend_queues() is not None:
        return [
            Error(
                "TASKS uses django_dbqueue's backend, but django.tasks needs Django 6.0 or newer "
                f"(this is Django {django.get_version()}).",
                hint="Upgrade Django, or enqueue with django-dbqueue's own @job API, which works on Django 5.2.",
                id="dbqueue.E009",
            )
        ]
    return []


def check_worker_queues(queues: Sequence[str]) -> list[CheckMessage]:
    """Check the queues ``queue_work`` serves against ``QUEUES``, run by the command itself."""
    known = conf.get("QUEUES")
    unknown = [queue for queue in queues if queue not in known] if known is not None else []
    if not unknown:
        return []
    return [
        Warning(
            f"This worker serves {', '.join(map(repr, unknown))}, not in DBQUEUE['QUEUES'] "
            f"({', '.join(map(repr, known))}): "
            "no job can be enqueued there.",
            hint="Is it a typo? Serve one of the QUEUES, or add the queue to QUEUES.",
            id="dbqueue.W006",
        )
    ]


def check_worker_queues_used(queues: Sequence[str]) -> list[CheckMessage]:
    """Without ``QUEUES``, warn about a served queue nothing uses (as ``queue_pause`` refuses it):
    a typo serves nothing. Run by ``queue_work`` itself; reads the database."""
    if conf.get("QUEUES") is not None:
        return []  # check_worker_queues
    try:
        unused = [queue for queue in queues if not pauses.is_known(queue)]
        known = sorted(pauses.known_queues()) if unused else []
    except DatabaseError:
        return []
    messages: list[CheckMessage] = []
    for queue in unused:
        close = difflib.get_close_matches(queue, known, n=1)
        messages.append(
            Warning(
                f"This worker serves the queue {queue!r}, which no registered job, schedule, job row or "
                "other worker uses: it has nothing to run there.",
                hint=(f"Did you mean {close[0]!r}? " if close else "")
                + f"Known queues: {', '.join(map(repr, known))}. The worker runs anyway: a job may be "
                "enqueued there later.",
                id="dbqueue.W010",
            )
        )
    return messages


def check_worker(concurrency: int | None, timeout: int | None) -> list[CheckMessage]:
    """Checks of ``queue_work`` options, run by the command itself."""
    messages: list[CheckMessage] = []
    alias = conf.get("DATABASE")
    if concurrency and concurrency > 1 and connections[alias].vendor == "sqlite":
        messages.append(
            Warning(
                f"--concurrency {concurrency} on SQLite: SQLite serialises writers, so workers wait on "
                "each other and may see 'database is locked'.",
                hint="Claims stay safe, but use PostgreSQL or MariaDB for parallel workers, or set "
                "OPTIONS={'timeout': 20, 'transaction_mode': 'IMMEDIATE'} and WAL mode.",
                id="dbqueue.W003",
            )
        )
    retry_after = int(conf.get("RETRY_AFTER"))
    if timeout and timeout >= retry_after:
        messages.append(
            Warning(
                f"--timeout {timeout} is not shorter than DBQUEUE['RETRY_AFTER'] ({retry_after} s).",
                hint="A job stuck in C code that holds the GIL stops the worker's heartbeat: it is "
                "reclaimed after RETRY_AFTER and runs twice before --timeout ends it.",
                id="dbqueue.W004",
            )
        )
    return messages


def check_worker_connections(processes: int, threads: int, async_slots: int) -> list[CheckMessage]:
    """Warn when the connections one ``queue_work`` command may open (see
    ``pool.connections_per_process``, or Django's pool that bounds them) take half the server's
    ``max_connections`` or more."""
    connection = connections[conf.get("DATABASE")]
    bound = pool_size(connection)
    per_process = connections_per_process(threads, async_slots)
    if bound is not None and bound < per_process:
        what = f"Django's connection pool of {bound} for every thread of the process"
        per_process = bound
    else:
        what = (
            f"{threads} job thread(s) while their jobs use the ORM, the worker's own, its heartbeat's, the listener's, "
            f"progress, the ticker{', the async ORM thread' if async_slots else ''}"
        )
    needed = processes * per_process
    query = {"postgresql": "SHOW max_connections", "mysql": "SELECT @@max_connections"}.get(connection.vendor)
    # No server is configured for fewer than 20 connections: no need to ask.
    if query is None or needed < 10:
        return []
    try:
        with connection.cursor() as cursor:
            cursor.execute(query)
            row = cursor.fetchone()
        limit = int(row[0]) if row else 0
    except (DatabaseError, TypeError, ValueError):
        return []
    if not limit or needed * 2 < limit:
        return []
    return [
        Warning(
            f"This command may open {needed} database connections ({processes} process(es) x {per_process}: "
            f"{what}); the server allows {limit} (max_connections) for every client together.",
            hint="Run fewer threads or processes, bound each process with Django's connection pool "
            "(DATABASES OPTIONS 'pool' on PostgreSQL), put PgBouncer in front, or raise max_connections "
            "(docs/howto/deploy.md: the connection bill).",
            id="dbqueue.W007",
        )
    ]


@register()
def check_schedules(app_configs: Sequence[Any] | None = None, **kwargs: Any) -> list[CheckMessage]:
    """Every periodic schedule needs a cron expression cronsim reads, a known time zone and a registered job."""
    messages: list[CheckMessage] = []
    for schedule in schedules.all_schedules().values():
        error = schedule.expression_error()
        if error is not None:
            messages.append(
                Error(
                    f"Schedule {schedule.name!r} has a bad cron expression: {error}.",
                    hint="Use 5 fields (minute hour day-of-month month day-of-week), 6 with seconds first, "
                    f"or one of {', '.join(schedules.SHORTHANDS)}; or every=seconds for a plain interval.",
                    id="dbqueue.E011",
                )
            )
        error = schedule.timezone_error()
        if error is not None:
            messages.append(
                Error(
                    f"Schedule {schedule.name!r} has an unknown time zone: {error}.",
                    hint="Use an IANA name such as 'Europe/Berlin' or 'UTC' (on Windows, pip install tzdata).",
                    id="dbqueue.E012",
                )
            )
        if registry.find(schedule.job_name) is None:
            messages.append(
                Error(
                    f"Schedule {schedule.name!r} names the job {schedule.job_name!r}, which is not registered.",
                    hint="Check the name, or pass the @job function itself to periodic(); the module that "
                    "defines it must be imported at startup (an installed app's jobs.py is).",
                    id="dbqueue.E013",
                )
            )
    return messages


@register(Tags.urls)
def check_metrics_extra(app_configs: Sequence[Any] | None = None, **kwargs: Any) -> list[CheckMessage]:
    """The metrics view, once mounted, needs the ``prometheus`` extra."""
    # Settings without ROOT_URLCONF (a worker-only settings module) mount no view.
    if prometheus_installed() or not getattr(settings, "ROOT_URLCONF", None):
        return []
    try:
        reverse("dbqueue_metrics:metrics")
    except (NoReverseMatch, ImproperlyConfigured):
        return []
    return [
        Warning(
            "django_dbqueue.metrics_urls is mounted, but prometheus_client is not installed: "
            "the metrics view answers 501.",
            hint="pip install 'django-dbqueue[prometheus]'.",
            id="dbqueue.W008",
        )
    ]
