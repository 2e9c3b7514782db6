"""Prometheus / OpenMetrics figures of the queue, served by ``metrics_view``
(mount ``django_dbqueue.metrics_urls``; see docs/observability.md for the table).

Gauges are read from the tables at each scrape: jobs per queue and state, the
oldest waiting job's age, failed jobs, paused queues, live and dead workers and
the jobs they run. Counters and the run-time histogram are the sums of the
``JobHistory`` rows (history.py), so they count since the oldest row kept
(``HISTORY_MAX_AGE``) and stop growing with ``DBQUEUE["HISTORY"] = False``.

``prometheus_client`` is an optional extra (``pip install
"django-dbqueue[prometheus]"``): without it the view answers 501. Each request
builds its own ``CollectorRegistry`` with one collector over one read of the
database; nothing is kept between scrapes, so every web process serves the same
figures and none registers anything in ``prometheus_client.REGISTRY``.

Who may read them: a user with ``PERMISSIONS`` (the figures count failed jobs,
which the admin shows only with ``view_failedjob``), or a client that sends
``DBQUEUE["METRICS_TOKEN"]`` (``Authorization: Bearer <token>``, or ``?token=``,
which access logs keep). The health view (health.py) uses the same rule with
``view_job`` alone: it counts no failures.

Job names come from the history's rows, which any code (or raw SQL) may have
written: at most ``MAX_NAMES`` of them get series of their own (the registered
ones first), and the runs of the others are summed under ``OTHER_NAME``, so the
series cannot grow without bound.
"""

from __future__ import annotations

import dataclasses
import hmac
import logging
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING

from django.db import DatabaseError
from django.db.models import BooleanField, Case, Sum, Value, When
from django.http import HttpRequest, HttpResponse
from django.views.decorators.http import require_safe

from . import conf, history, operations, registry, workers
from .db import error_text
from .models import JobHistory, QueueWorker
from .operations import QueueStats

if TYPE_CHECKING:
    from prometheus_client.metrics_core import Metric

logger = logging.getLogger("django_dbqueue")

# The permissions that open the metrics view to a logged-in user, and the health view's.
PERMISSIONS = ("django_dbqueue.view_job", "django_dbqueue.view_failedjob")
HEALTH_PERMISSIONS = ("django_dbqueue.view_job",)
# Job names with series of their own; the runs of the others are summed under OTHER_NAME.
MAX_NAMES = 200
OTHER_NAME = "__other__"
PREFIX = "dbqueue_"
# The job states of ``dbqueue_jobs``, as ``queue_overview`` counts them.
STATES = ("waiting", "delayed", "blocked", "reserved")
MISSING_PACKAGE = (
    "The metrics view needs prometheus_client: pip install 'django-dbqueue[prometheus]' (or prometheus-client>=0.17).\n"
)


# -- who may read -------------------------------------------------------------


def _text(body: str, status: int) -> HttpResponse:
    response = HttpResponse(body, status=status, content_type="text/plain; charset=utf-8")
    # The figures change every moment: no cache keeps a copy.
    response["Cache-Control"] = "no-store"
    return response


def sent_token(request: HttpRequest) -> str | None:
    """The token of an ``Authorization: Bearer`` header, else of ``?token=``; None if neither.

    The header is the way to prefer: a query string is written to access logs.
    """
    authorization = request.headers.get("Authorization", "")
    scheme, _, credentials = authorization.partition(" ")
    if scheme.lower() == "bearer" and credentials.strip():
        return credentials.strip()
    return request.GET.get("token")


def refusal(request: HttpRequest, permissions: Sequence[str] = PERMISSIONS) -> tuple[int, str] | None:
    """Return ``(status, reason)`` refusing ``request`` a monitoring view that a user with
    ``permissions`` may see, or None if it may see it.

    A token is checked before the session, so a scraper never needs a login; a
    wrong token is refused even for a logged-in user, so a typo in a scrape
    config shows at once instead of working only in a browser.
    """
    token = sent_token(request)
    if token is not None:
        expected = conf.get("METRICS_TOKEN")
        if expected and hmac.compare_digest(token.encode(), str(expected).encode()):
            return None
        return 403, "the token is not valid"
    user = getattr(request, "user", None)
    if user is not None and user.has_perms(permissions):
        return None
    if user is None or not user.is_authenticated:
        return 401, "log in, or send DBQUEUE['METRICS_TOKEN'] as 'Authorization: Bearer <token>'"
    needed = " and ".join(permissions)
    return 403, f"the {needed} permission{'s are' if len(permissions) > 1 else ' is'} required"


def refused(reason: tuple[int, str]) -> HttpResponse:
    status, detail = reason
    response = _text(detail + "\n", status)
    if status == 401:
        response["WWW-Authenticate"] = 'Bearer realm="dbqueue"'
    return response


# -- what is read -------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class WorkerCounts:
    live: int = 0
    dead: int = 0
    # Jobs the live workers run now, as their last beat said.
    running: int = 0
    # The queues live workers serve.
    served: frozenset[str] = frozenset()


@dataclasses.dataclass(frozen=True)
class HistoryTotals:
    """The sums of every history row of one queue and job name."""

    queue: str
    name: str
    started: int
    succeeded: int
    failed: int
    retried: int
    run_time: float
    # Runs per run-time bin (``history.BINS``), not cumulative.
    bins: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class Snapshot:
    """Everything one scrape shows, read in five queries."""

    queues: list[QueueStats]
    workers: WorkerCounts
    history: list[HistoryTotals]


def read_workers(using: str) -> WorkerCounts:
    """Count the live and dead worker rows (dead: ``workers.dead_after()`` without a beat, by the database's clock)."""
    rows = (
        QueueWorker.objects.using(using)
        .annotate(
            dead=Case(When(workers.dead_rows(), then=Value(True)), default=Value(False), output_field=BooleanField())
        )
        .values_list("dead", "running", "queues")
    )
    live = dead = running = 0
    served: set[str] = set()
    for is_dead, worker_running, queues in rows:
        if is_dead:
            dead += 1
            continue
        live += 1
        running += worker_running
        served.update(queue for queue in queues.split(",") if queue)
    return WorkerCounts(live, dead, running, frozenset(served))


def read_history(using: str) -> list[HistoryTotals]:
    """Sum the history rows per queue and job name, in the database (one grouped query)."""
    rows = (
        JobHistory.objects.using(using)
        .order_by()
        .values("queue", "name")
        .annotate(**{f"sum_{column}": Sum(column) for column in history.ADDED})
        .order_by("queue", "name")
    )
    return [
        HistoryTotals(
            row["queue"],
            row["name"],
            int(row["sum_started"] or 0),
            int(row["sum_succeeded"] or 0),
            int(row["sum_failed"] or 0),
            int(row["sum_retried"] or 0),
            float(row["sum_run_time"] or 0.0),
            tuple(int(row[f"sum_{name}"] or 0) for name in history.BINS),
        )
        for row in rows
    ]


def bounded_names(rows: list[HistoryTotals]) -> list[HistoryTotals]:
    """Keep the rows of at most ``MAX_NAMES`` job names (registered names first, then by name; every
    registered name even past the limit) and sum the others' per queue under ``OTHER_NAME``."""
    limit = MAX_NAMES
    names = sorted({row.name for row in rows}, key=lambda name: (registry.find(name) is None, name))
    kept = {name for index, name in enumerate(names) if index < limit or registry.find(name) is not None}
    if len(kept) == len(names):
        return rows
    others: dict[str, list[HistoryTotals]] = {}
    for row in rows:
        if row.name not in kept:
            others.setdefault(row.queue, []).append(row)
    folded = [
        HistoryTotals(
            queue,
            OTHER_NAME,
            sum(row.started for row in group),
            sum(row.succeeded for row in group),
            sum(row.failed for row in group),
            sum(row.retried for row in group),
            sum(row.run_time for row in group),
            tuple(sum(column) for column in zip(*(row.bins for row in group), strict=True)),
        )
        for queue, group in others.items()
    ]
    return sorted([row for row in rows if row.name in kept] + folded, key=lambda row: (row.queue, row.name))


def snapshot() -> Snapshot:
    """Read the figures from ``operations.read_alias()`` (the replica, if one is set)."""
    using = operations.read_alias()
    counts = read_workers(using)
    stats = {item.queue: item for item in operations.queue_overview()}
    # Queues a project declares or a live worker serves get a series of zeros, so
    # an alert on them sees 0, not a series that comes and goes with the jobs.
    known = set(conf.get("QUEUES") or ()) | counts.served
    for queue in known - set(stats):
        stats[queue] = QueueStats(queue)
    return Snapshot(sorted(stats.values(), key=lambda item: item.queue), counts, bounded_names(read_history(using)))


# -- how it is shown ----------------------------------------------------------


class QueueCollector:
    """A ``prometheus_client`` collector of one ``Snapshot``."""

    def __init__(self, figures: Snapshot) -> None:
        self.figures = figures

    def collect(self) -> Iterator[Metric]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

        figures = self.figures
        jobs = GaugeMetricFamily(
            PREFIX + "jobs",
            "Jobs in the queue table per queue and state: waiting (ready to run), delayed (available "
            "later), blocked (waiting for a concurrency slot), reserved (claimed by a worker).",
            labels=["queue", "state"],
        )
        oldest = GaugeMetricFamily(
            PREFIX + "oldest_waiting_seconds",
            "Seconds the oldest waiting job of the queue has been available to run; 0 when none waits.",
            labels=["queue"],
            unit="seconds",
        )
        failed = GaugeMetricFamily(
            PREFIX + "failed_jobs", "Jobs in the failed-jobs table (the dead letters) per queue.", labels=["queue"]
        )
        paused = GaugeMetricFamily(
            PREFIX + "queue_paused", "1 if the queue is paused (queue_pause), else 0.", labels=["queue"]
        )
        for item in figures.queues:
            for state in STATES:
                jobs.add_metric([item.queue, state], getattr(item, state))
            oldest.add_metric([item.queue], item.oldest_waiting_seconds or 0.0)
            failed.add_metric([item.queue], item.failed)
            paused.add_metric([item.queue], 1 if item.paused else 0)
        yield from (jobs, oldest, failed, paused)

        worker_rows = GaugeMetricFamily(
            PREFIX + "workers",
            "Worker rows: live (a beat within the last three WORKER_BEAT) or dead (silent longer; "
            "deleted after an hour).",
            labels=["state"],
        )
        worker_rows.add_metric(["live"], figures.workers.live)
        worker_rows.add_metric(["dead"], figures.workers.dead)
        yield worker_rows
        yield GaugeMetricFamily(
            PREFIX + "running_jobs",
            "Jobs the live workers are running, as of their last beat.",
            value=figures.workers.running,
        )

        labels = ["queue", "name"]
        counters = {
            count: CounterMetricFamily(PREFIX + f"jobs_{count}", help_text, labels=labels)
            for count, help_text in (
                ("started", "Runs started, from the history (since its oldest row kept)."),
                ("succeeded", "Runs that succeeded, from the history (since its oldest row kept)."),
                ("failed", "Runs that failed for good (moved to the failed jobs), from the history."),
                ("retried", "Runs that raised and were released to run again, from the history."),
            )
        }
        run_time = HistogramMetricFamily(
            PREFIX + "job_run_time_seconds",
            "Run time of the runs that ended (succeeded, failed or retried), from the history.",
            labels=labels,
            unit="seconds",
        )
        for totals in figures.history:
            key = [totals.queue, totals.name]
            for count, family in counters.items():
                family.add_metric(key, getattr(totals, count))
            run_time.add_metric(key, _buckets(totals.bins), totals.run_time)
        yield from counters.values()
        yield run_time


def _buckets(bins: tuple[int, ...]) -> list[tuple[str, float]]:
    """Cumulative ``le`` buckets from the history's bins; the last bin is ``+Inf``."""
    buckets: list[tuple[str, float]] = []
    seen = 0
    for bound, count in zip((*history.BOUNDS, float("inf")), bins, strict=True):
        seen += count
        buckets.append(("+Inf" if bound == float("inf") else repr(float(bound)), seen))
    return buckets


def render(figures: Snapshot, accept: str = "") -> tuple[bytes, str]:
    """Return the exposition text of ``figures`` in the format ``accept`` asks for, and its content type."""
    from prometheus_client import CollectorRegistry
    from prometheus_client.exposition import choose_encoder

    registry = CollectorRegistry(auto_describe=False)
    registry.register(QueueCollector(figures))
    encoder, content_type = choose_encoder(accept)
    return encoder(registry), content_type


def prometheus_installed() -> bool:
    try:
        import prometheus_client  # noqa: F401
    except ImportError:
        return False
    return True


@require_safe
def metrics_view(request: HttpRequest) -> HttpResponse:
    """Serve the queue's figures in the Prometheus text format, or OpenMetrics if the Accept header asks for it."""
    reason = refusal(request)
    if reason is not None:
        return refused(reason)
    if not prometheus_installed():
        return _text(MISSING_PACKAGE, 501)
    try:
        figures = snapshot()
    except DatabaseError as exc:
        logger.warning("metrics not read: %s", error_text(exc))
        return _text(f"the queue's database cannot be read: {type(exc).__name__}\n", 503)
    body, content_type = render(figures, request.headers.get("Accept", ""))
    response = HttpResponse(body, content_type=content_type)
    response["Cache-Control"] = "no-store"
    return response
