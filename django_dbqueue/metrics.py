"""Prometheus / OpenMetrics figures of the queue, served by ``metrics_view`` (docs/observability.md).

Gauges are read from the tables at each scrape; counters and the run-time histogram are the sums of
the ``JobHistory`` rows, labelled with the name their runs were counted under (a django.tasks task's
own path: ``history.shown_name``). Each request builds its own ``CollectorRegistry`` over one read, so every
web process serves the same figures. Job names come from rows any code may have written: at most
``MAX_NAMES`` get series of their own, the others' runs are summed under ``OTHER_NAME``.
"""

from __future__ import annotations

import dataclasses
import hmac
import importlib.util
import itertools
import logging
from collections.abc import Iterable, Iterator, Sequence
from datetime import datetime
from typing import TYPE_CHECKING, Any, TypeVar

from django.db import DatabaseError
from django.db.models import BooleanField, Case, Sum, Value, When
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.views.decorators.http import require_safe

from . import conf, history, operations, registry, workers
from .db import error_text
from .models import JobHistory, QueueWorker
from .operations import QueueStats

if TYPE_CHECKING:
    from prometheus_client.metrics_core import Metric

logger = logging.getLogger("django_dbqueue")
Response = TypeVar("Response", bound=HttpResponse)

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


def no_store(response: Response) -> Response:
    """``response``, kept by no cache: the figures (and progress) change every moment and may be private."""
    response["Cache-Control"] = "no-store"
    return response


def _text(body: str, status: int) -> HttpResponse:
    return no_store(HttpResponse(body, status=status, content_type="text/plain; charset=utf-8"))


def sent_token(request: HttpRequest) -> str | None:
    """The token of an ``Authorization: Bearer`` header, else of ``?token=`` (which access logs keep)."""
    authorization = request.headers.get("Authorization", "")
    scheme, _, credentials = authorization.partition(" ")
    if scheme.lower() == "bearer" and credentials.strip():
        return credentials.strip()
    return request.GET.get("token")


def refusal(request: HttpRequest, permissions: Sequence[str] = PERMISSIONS) -> tuple[int, str] | None:
    """Return ``(status, reason)`` refusing ``request`` a view for users with ``permissions``, or None.
    A token is checked before the session: a wrong one is refused even for a logged-in user, so a
    typo in a scrape config shows at once instead of working only in a browser."""
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


def refused(reason: tuple[int, str], *, json: bool = False) -> HttpResponse:
    """The response of a ``refusal``: its reason as text, or as JSON's ``detail`` with ``json``."""
    status, detail = reason
    response = no_store(JsonResponse({"detail": detail}, status=status)) if json else _text(detail + "\n", status)
    if status == 401:
        response["WWW-Authenticate"] = 'Bearer realm="dbqueue"'
    return response


@dataclasses.dataclass(frozen=True)
class WorkerCounts:
    live: int = 0
    dead: int = 0
    # Jobs the live workers run now, as their last beat said.
    running: int = 0
    # The queues live workers serve.
    served: frozenset[str] = frozenset()


@dataclasses.dataclass(frozen=True)
class Snapshot:
    """Everything one scrape shows, read in five queries."""

    queues: list[QueueStats]
    workers: WorkerCounts
    # The sums of every history row per (queue, job name), sorted.
    history: dict[tuple[str, str], history.Totals]


def read_workers(using: str) -> WorkerCounts:
    """Count the live and dead worker rows (dead: ``workers.dead_after()`` without a beat, by the database's clock)."""
    dead = Case(When(workers.dead_rows(), then=Value(True)), default=Value(False), output_field=BooleanField())
    rows = QueueWorker.objects.using(using).annotate(dead=dead).values_list("dead", "running", "queues")
    live = dead_count = running = 0
    served: set[str] = set()
    for is_dead, worker_running, queues in rows:
        if is_dead:
            dead_count += 1
            continue
        live += 1
        running += worker_running
        served.update(queue for queue in queues.split(",") if queue)
    return WorkerCounts(live, dead_count, running, frozenset(served))


def history_sums(
    by: Sequence[str], columns: Sequence[str], *, since: datetime | None = None, queue: str | None = None
) -> list[dict[str, Any]]:
    """The sums of ``columns`` of the history rows (since ``since``, of ``queue``) grouped by ``by``."""
    rows = JobHistory.objects.using(operations.read_alias())
    if since is not None:
        rows = rows.filter(bucket__gte=since)
    if queue is not None:
        rows = rows.filter(queue=queue)
    grouped: Iterable[dict[str, Any]] = rows.order_by().values(*by).annotate(**{name: Sum(name) for name in columns})
    # SUM gives a Decimal on some databases, and None for no row.
    return [
        {**row, **{name: (float if name == "run_time" else int)(row[name] or 0) for name in columns}} for row in grouped
    ]


def totals_of(row: dict[str, Any]) -> history.Totals:
    """The ``history.Totals`` of a row of ``history_sums`` over ``history.ADDED``."""
    counts = {name: row[name] for name in (*history.COUNTS, "run_time")}
    return history.Totals(**counts, bins=[row[name] for name in history.BINS])


def read_history() -> dict[tuple[str, str], history.Totals]:
    """The sums of every history row per queue and job name, past ``MAX_NAMES`` job names (registered
    names first, then by name; every registered name even past the limit) summed under ``OTHER_NAME``."""
    rows = history_sums(["queue", "name"], history.ADDED)
    names = sorted({row["name"] for row in rows}, key=lambda name: (registry.find(name) is None, name))
    kept = {name for index, name in enumerate(names) if index < MAX_NAMES or registry.find(name) is not None}
    totals: dict[tuple[str, str], history.Totals] = {}
    for row in rows:
        name = row["name"] if row["name"] in kept else OTHER_NAME
        totals.setdefault((row["queue"], name), history.Totals()).add(totals_of(row))
    return dict(sorted(totals.items()))


def snapshot() -> Snapshot:
    """Read the figures from ``operations.read_alias()`` (the replica, if one is set)."""
    using = operations.read_alias()
    counts = read_workers(using)
    stats = {item.queue: item for item in operations.queue_overview()}
    # Queues a project declares or a live worker serves get a series of zeros, so
    # an alert on them sees 0, not a series that comes and goes with the jobs.
    for queue in (set(conf.get("QUEUES") or ()) | counts.served) - set(stats):
        stats[queue] = QueueStats(queue)
    return Snapshot(sorted(stats.values(), key=lambda item: item.queue), counts, read_history())


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
        for key, totals in figures.history.items():
            for count, family in counters.items():
                family.add_metric(list(key), getattr(totals, count))
            run_time.add_metric(list(key), _buckets(totals.bins), totals.run_time)
        yield from counters.values()
        yield run_time


def _buckets(bins: Sequence[int]) -> list[tuple[str, int]]:
    """Cumulative ``le`` buckets from the history's bins; the last bin is ``+Inf``."""
    bounds = [*(repr(float(bound)) for bound in history.BOUNDS), "+Inf"]
    return list(zip(bounds, itertools.accumulate(bins), strict=True))


def render(figures: Snapshot, accept: str = "") -> tuple[bytes, str]:
    """Return the exposition text of ``figures`` in the format ``accept`` asks for, and its content type."""
    from prometheus_client import CollectorRegistry
    from prometheus_client.exposition import choose_encoder

    registry = CollectorRegistry(auto_describe=False)
    registry.register(QueueCollector(figures))
    encoder, content_type = choose_encoder(accept)
    return encoder(registry), content_type


def prometheus_installed() -> bool:
    """Whether prometheus_client can be imported: found, not imported (the check that asks runs at
    every worker's start, which would pay its 20 ms import for nothing)."""
    return importlib.util.find_spec("prometheus_client") is not None


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
    return no_store(HttpResponse(body, content_type=content_type))
