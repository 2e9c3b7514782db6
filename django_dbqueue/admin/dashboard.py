"""The queue pages of the admin: the overview (each queue's counts a user may see, Pause and Resume)
and the dashboard (throughput and failures as charts, queue depth, run times per job name, workers).

The figures come from ``JobHistory`` and ``QueueWorker`` on ``operations.read_alias()``, in a handful
of grouped queries. History buckets are minutes of the workers' clocks, so the charts' windows are
read on this process's clock; a worker's age is read on the database's, as ``workers.dead_rows``.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterable, Sequence
from datetime import UTC, datetime, timedelta
from typing import Any

from django.contrib import messages
from django.core.exceptions import PermissionDenied
from django.http import HttpRequest, HttpResponse
from django.urls import path
from django.utils import timezone
from django.utils.safestring import SafeString

from .. import history, pauses, workers
from ..db import DbNow
from ..metrics import history_sums, totals_of
from ..models import FailedJob, Job, QueueWorker
from ..operations import QueueStats, queue_overview, read_alias
from .base import ReadOnlyAdmin
from .charts import Series, bar_chart, sparkline

View = Callable[[HttpRequest], HttpResponse]
# Written where there is no figure.
NOTHING = "\N{EN DASH}"
_COUNTS = ("succeeded", "failed", "retried")
_QUEUE_COUNTS = ("waiting", "delayed", "reserved", "failed", "blocked")


@dataclasses.dataclass(frozen=True)
class Window:
    """A chart's period: ``span`` cut into bars of ``step``, the last bar holding ``now``."""

    name: str
    title: str
    span: timedelta
    step: timedelta

    def starts(self, now: datetime) -> list[datetime]:
        """The start of each bar, oldest first, aligned on ``step`` (UTC)."""
        step = self.step.total_seconds()
        last = now.timestamp() - now.timestamp() % step
        count = int(self.span / self.step)
        return [datetime.fromtimestamp(last - (count - 1 - index) * step, tz=UTC) for index in range(count)]


HOUR = Window("hour", "Last hour, per minute", timedelta(hours=1), timedelta(minutes=1))
DAY = Window("day", "Last 24 hours, per 10 minutes", timedelta(days=1), timedelta(minutes=10))


@dataclasses.dataclass(frozen=True)
class Point:
    """Runs that ended in one bar of a chart."""

    start: datetime
    succeeded: int = 0
    failed: int = 0
    retried: int = 0

    @property
    def failures(self) -> int:
        """Runs that raised: failed for good, or released to run again."""
        return self.failed + self.retried


def sum_points(points: Iterable[Point]) -> Point:
    """One point with the counts of ``points``, starting at the first one's start."""
    points = list(points)
    start = points[0].start if points else datetime.fromtimestamp(0, tz=UTC)
    return Point(start, *(sum(getattr(point, name) for point in points) for name in _COUNTS))


@dataclasses.dataclass(frozen=True)
class RunTimes:
    """How long a job name's runs took over a period, read from the history's run-time buckets."""

    runs: int = 0
    # Runs that ended the job in the failed jobs; runs that raised and were retried.
    failed: int = 0
    retried: int = 0
    # Seconds; math.inf: longer than the last bound of ``history.BOUNDS``; None: no run.
    p50: float | None = None
    p95: float | None = None
    mean: float | None = None

    @property
    def failures(self) -> int:
        """Runs that raised: failed for good, or retried."""
        return self.failed + self.retried

    @property
    def p50_label(self) -> str:
        return duration(self.p50, bound=True)

    @property
    def p95_label(self) -> str:
        return duration(self.p95, bound=True)

    @property
    def mean_label(self) -> str:
        return duration(self.mean)

    @classmethod
    def of(cls, totals: history.Totals) -> RunTimes:
        def percentile(q: float) -> float | None:
            value = totals.percentile(q)
            # ``percentile`` gives the last bound for the runs longer than it, too.
            if value == history.BOUNDS[-1] and sum(totals.bins[:-1]) < q * sum(totals.bins):
                return math.inf
            return value

        runs = totals.ended
        mean = totals.run_time / runs if runs else None
        return cls(runs, totals.failed, totals.retried, percentile(0.5), percentile(0.95), mean)


@dataclasses.dataclass(frozen=True)
class NameRunTimes:
    name: str
    hour: RunTimes
    day: RunTimes


@dataclasses.dataclass(frozen=True)
class WorkerRow:
    """A worker's row with its ages on the database's clock."""

    worker: QueueWorker
    seen_ago: float
    up_for: float

    @property
    def dead(self) -> bool:
        """The worker missed its last three beats (``workers.dead_after``)."""
        return self.seen_ago > workers.dead_after()

    @property
    def seen_label(self) -> str:
        return age(self.seen_ago)

    @property
    def up_label(self) -> str:
        return age(self.up_for)


@dataclasses.dataclass(frozen=True)
class QueueRow:
    """A queue's counts now and its runs over the last hour (per minute) and day."""

    stats: QueueStats
    hour: list[Point]
    day: Point

    @property
    def hour_total(self) -> Point:
        return sum_points(self.hour)

    @property
    def oldest_label(self) -> str:
        return age(self.stats.oldest_waiting_seconds)


@dataclasses.dataclass(frozen=True)
class Dashboard:
    """Everything the dashboard page shows, for one queue or for all (``queue`` None)."""

    now: datetime
    queue: str | None
    hour: list[Point]
    day: list[Point]
    queues: list[QueueRow]
    names: list[NameRunTimes]
    workers: list[WorkerRow]

    @property
    def stats(self) -> QueueStats:
        """The counts of the queue shown, or of all queues summed (the oldest waiting age: the largest)."""
        rows = [row.stats for row in self.queues if self.queue is None or row.stats.queue == self.queue]
        ages = [stats.oldest_waiting_seconds for stats in rows if stats.oldest_waiting_seconds is not None]
        counts = {name: sum(getattr(stats, name) for stats in rows) for name in _QUEUE_COUNTS}
        return QueueStats(self.queue or "", oldest_waiting_seconds=max(ages, default=None), **counts)

    @property
    def paused(self) -> list[QueueStats]:
        return [row.stats for row in self.queues if row.stats.paused]

    @property
    def live_workers(self) -> int:
        return sum(1 for row in self.workers if not row.dead)

    @property
    def hour_total(self) -> Point:
        return sum_points(self.hour)

    @property
    def day_total(self) -> Point:
        return sum_points(self.day)


# -- gathering -----------------------------------------------------------------


def _binned(starts: Sequence[datetime], step: timedelta, rows: Iterable[dict[str, Any]]) -> list[Point]:
    """Add the minute rows to the bar they fall in; a minute after the last bar (a clock ahead) counts in it."""
    counts = [[0, 0, 0] for _ in starts]
    for row in rows:
        bar = counts[min(max(int((row["bucket"] - starts[0]) / step), 0), len(starts) - 1)]
        for column, name in enumerate(_COUNTS):
            bar[column] += row[name]
    return [Point(start, *count) for start, count in zip(starts, counts, strict=True)]


def series(window: Window, now: datetime, *, queue: str | None = None) -> list[Point]:
    """Runs that ended per bar of ``window`` up to ``now``, of ``queue`` or of all queues."""
    starts = window.starts(now)
    return _binned(starts, window.step, history_sums(["bucket"], _COUNTS, since=starts[0], queue=queue))


def _totals_by_name(since: datetime, queue: str | None) -> dict[str, history.Totals]:
    return {row["name"]: totals_of(row) for row in history_sums(["name"], history.ADDED, since=since, queue=queue)}


def run_times(now: datetime, *, queue: str | None = None) -> list[NameRunTimes]:
    """Run times (p50, p95, mean) per job name over the last hour and day, by name."""
    hour = _totals_by_name(now - HOUR.span, queue)
    day = _totals_by_name(now - DAY.span, queue)
    return [
        NameRunTimes(name, RunTimes.of(hour.get(name, history.Totals())), RunTimes.of(totals))
        for name, totals in sorted(day.items())
    ]


def worker_rows(*, queue: str | None = None) -> list[WorkerRow]:
    """Every worker's row (dead ones too, until pruned), by host and pid; only those serving ``queue`` if given."""
    rows = QueueWorker.objects.using(read_alias()).annotate(db_now=DbNow()).order_by("hostname", "pid", "worker_id")
    return [
        WorkerRow(
            row,
            max((row.db_now - row.last_seen_at).total_seconds(), 0.0),
            max((row.db_now - row.started_at).total_seconds(), 0.0),
        )
        for row in rows
        if queue is None or queue in row.queue_list
    ]


def queue_rows(now: datetime, live: Iterable[WorkerRow] = ()) -> list[QueueRow]:
    """Every queue that holds or failed jobs, is paused, ran jobs in the last day or is served by
    a live worker in ``live``, by name."""
    stats = {item.queue: item for item in queue_overview()}
    starts = HOUR.starts(now)
    minutes: dict[str, list[dict[str, Any]]] = {}
    for row in history_sums(["queue", "bucket"], _COUNTS, since=starts[0]):
        minutes.setdefault(row["queue"], []).append(row)
    since = now - DAY.span
    day = {
        row["queue"]: Point(since, *(row[name] for name in _COUNTS))
        for row in history_sums(["queue"], _COUNTS, since=since)
    }
    served = {queue for row in live if not row.dead for queue in row.worker.queue_list}
    return [
        QueueRow(
            stats.get(queue, QueueStats(queue)),
            _binned(starts, HOUR.step, minutes.get(queue, [])),
            day.get(queue, Point(now)),
        )
        for queue in sorted({*stats, *minutes, *day, *served})
    ]


def gather(now: datetime | None = None, *, queue: str | None = None) -> Dashboard:
    """Read every figure of the dashboard; ``now`` (default: this process's clock) ends the charts."""
    now = now or timezone.now()
    worker_list = worker_rows()
    return Dashboard(
        now=now,
        queue=queue,
        hour=series(HOUR, now, queue=queue),
        day=series(DAY, now, queue=queue),
        queues=queue_rows(now, worker_list),
        names=run_times(now, queue=queue),
        workers=[row for row in worker_list if queue is None or queue in row.worker.queue_list],
    )


# -- drawing -------------------------------------------------------------------


def duration(seconds: float | None, *, bound: bool = False) -> str:
    """``12 ms``, ``1.5 s``, ``3 min``; with ``bound``, as a bucket's upper bound (``≤ 250 ms``)."""
    if seconds is None:
        return NOTHING
    if math.isinf(seconds):
        return f"> {duration(history.BOUNDS[-1])}"
    if seconds < 1:
        text = f"{seconds * 1000:.3g} ms"
    elif seconds < 120:
        text = f"{seconds:.3g} s"
    elif seconds < 7200:
        text = f"{seconds / 60:.0f} min"
    else:
        text = f"{seconds / 3600:.1f} h"
    return f"≤ {text}" if bound else text


def age(seconds: float | None) -> str:
    """``42 s``, ``7 min``, ``3.5 h``: how long ago, or how long for, to the second."""
    if seconds is None:
        return NOTHING
    if seconds < 1:
        return "< 1 s"
    return f"{seconds:.0f} s" if seconds < 120 else duration(seconds)


@dataclasses.dataclass(frozen=True)
class Figure:
    """One chart of a window, with its caption."""

    caption: str
    svg: SafeString


@dataclasses.dataclass(frozen=True)
class ChartRow:
    """A window's charts: succeeded, and (for users who may see failures) failed and retried, each on its own scale."""

    window: Window
    figures: list[Figure]
    total: Point
    failures: bool


# A chart's size in its own units: three fit side by side on a wide screen, one on a phone.
CHART_WIDTH, CHART_HEIGHT = 420, 160
# Each count's chart: its caption, and what it shows when no run counted.
_CHARTS = {
    "succeeded": ("Succeeded", "No runs recorded"),
    "failed": ("Failed (moved to the failed jobs)", "No failures"),
    "retried": ("Retried (raised, put back to run again)", "No retries"),
}


def _layers(points: Sequence[Point], *names: str) -> list[Series]:
    """A chart layer per count ``names``; the successes are drawn with the class ``ok``."""
    return [Series(name, "ok" if name == "succeeded" else name, [getattr(p, name) for p in points]) for name in names]


def charts(window: Window, points: Sequence[Point], *, failures: bool = True) -> ChartRow:
    """The succeeded chart of ``points`` and, with ``failures``, the failed and the retried ones: apart,
    so that retries (which may succeed later) neither hide nor look like the runs that failed for good."""
    # Each bar's tooltip label and the x axis ticks, in the current time zone.
    local = [timezone.localtime(point.start) for point in points]
    if window.step < timedelta(minutes=5):
        labels = [moment.strftime("%H:%M") for moment in local]
        ticks = [(index, labels[index]) for index, moment in enumerate(local) if moment.minute % 15 == 0]
    else:
        labels = [f"{moment:%a %H:%M}\N{EN DASH}{moment + window.step:%H:%M}" for moment in local]
        ticks = [(i, f"{time:%H:%M}") for i, time in enumerate(local) if time.minute == 0 and time.hour % 6 == 0]
    unit = "minute" if window.step == timedelta(minutes=1) else f"{window.step.total_seconds() / 60:.0f} minutes"
    period = window.title.split(",")[0].lower()
    figures = []
    for name in ("succeeded", "failed", "retried") if failures else ("succeeded",):
        caption, empty = _CHARTS[name]
        svg = bar_chart(
            labels,
            _layers(points, name),
            title=f"{name.capitalize()} per {unit}, {period}",
            ticks=ticks,
            width=CHART_WIDTH,
            height=CHART_HEIGHT,
            empty=empty,
        )
        figures.append(Figure(caption, svg))
    return ChartRow(window, figures, sum_points(points), failures)


def view_for(model_admin: ReadOnlyAdmin) -> View:
    """The dashboard view of ``model_admin`` (``DashboardAdmin``): for users who may view jobs (as
    the overview's job counts); every count of failures only with view_failedjob, as on the overview."""

    def dashboard_view(request: HttpRequest) -> HttpResponse:
        if not model_admin.has_view_permission(request):
            raise PermissionDenied
        show_failed = model_admin.may_view(request, FailedJob)
        queue = request.GET.get("queue") or None
        data = gather(queue=queue)
        # A queue's sparkline stacks its failed and retried runs on the successes only with show_failed.
        layers = ("succeeded", "failed", "retried") if show_failed else ("succeeded",)
        title = f"Queue dashboard: {queue}" if queue else "Queue dashboard"
        return model_admin.page(
            request,
            "dashboard",
            title,
            data=data,
            stats=data.stats,
            charts=[charts(HOUR, data.hour, failures=show_failed), charts(DAY, data.day, failures=show_failed)],
            queues=[
                (row, sparkline(_layers(row.hour, *layers), title=f"Queue {row.stats.queue}, last hour per minute"))
                for row in data.queues
            ],
            queue_names=[row.stats.queue for row in data.queues],
            show_failed=show_failed,
            history_on=history.enabled(),
            dead_after=workers.dead_after(),
            oldest_waiting=age(data.stats.oldest_waiting_seconds),
            bounds=f"{duration(history.BOUNDS[0])} to {duration(history.BOUNDS[-1])}",
            overview_url=model_admin.url("overview"),
            jobs_url=model_admin.url("job_changelist"),
            failed_url=model_admin.url("failedjob_changelist") if show_failed else "",
        )

    return dashboard_view


class DashboardAdmin(ReadOnlyAdmin):
    """The dashboard as the admin index's entry of ``JobHistory`` (the rows it charts), so the index
    and the sidebar link to it: its change list is the dashboard, for users who may view jobs."""

    def has_view_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        # The dashboard's rule (the overview's job counts), not a permission of its own.
        return self.may_view(request, Job)

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def get_urls(self) -> list[Any]:
        view = self.admin_site.admin_view(view_for(self))
        # The change list's name for the index, and the dashboard's for everything else.
        return [
            path("", view, name="django_dbqueue_jobhistory_changelist"),
            path("", view, name="django_dbqueue_dashboard"),
        ]


# -- the overview -----------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class OverviewRow:
    """One queue's counts as a user may see them: None where a count is hidden from that user."""

    queue: str
    waiting: int | None
    delayed: int | None
    reserved: int | None
    failed: int | None
    oldest_waiting_seconds: float | None
    # When the queue was paused; None: it is not paused.
    paused_at: datetime | None = None
    blocked: int | None = None

    @classmethod
    def of(cls, stats: QueueStats, *, jobs: bool, failed: bool) -> OverviewRow:
        shown: dict[str, Any] = {field.name: getattr(stats, field.name) for field in dataclasses.fields(cls)}
        if not jobs:
            shown.update(dict.fromkeys(["waiting", "delayed", "reserved", "blocked", "oldest_waiting_seconds"]))
        if not failed:
            shown["failed"] = None
        return cls(**shown)

    @property
    def paused(self) -> bool:
        return self.paused_at is not None


def may_pause(request: HttpRequest) -> bool:
    return request.user.has_perm("django_dbqueue.pause_queue")


def overview_for(jobs: ReadOnlyAdmin) -> View:
    """The overview of the job admin ``jobs``: job counts with view_job, failed counts with view_failedjob;
    whether each queue is paused, with Pause and Resume buttons for users with pause_queue."""

    def overview_view(request: HttpRequest) -> HttpResponse:
        show_jobs = jobs.has_view_permission(request)
        show_failed = jobs.may_view(request, FailedJob)
        pause = may_pause(request)
        if not (show_jobs or show_failed or pause):
            raise PermissionDenied
        rows = [
            OverviewRow.of(stats, jobs=show_jobs, failed=show_failed)
            for stats in queue_overview()
            # A queue is listed only for a count the user may see, or for a user who may pause
            # it, so its name alone tells nothing more.
            if ((show_jobs or pause) and (stats.size or stats.paused)) or (show_failed and stats.failed)
        ]
        return jobs.page(
            request,
            "overview",
            "Queue overview",
            rows=rows,
            show_jobs=show_jobs,
            show_failed=show_failed,
            may_pause=pause,
            jobs_url=jobs.url("job_changelist") if show_jobs else "",
            failed_url=jobs.url("failedjob_changelist") if show_failed else "",
        )

    return overview_view


def pause_for(jobs: ReadOnlyAdmin, *, pause: bool) -> View:
    """Pause (or resume) the queue named in the POST; only a queue something uses (``pauses.is_known``)."""

    def pause_view(request: HttpRequest) -> HttpResponse:
        if not may_pause(request):
            raise PermissionDenied
        queue = request.POST.get("queue", "")
        try:
            changed = pauses.pause(queue) if pause else pauses.resume(queue)
        except ValueError as exc:
            messages.error(request, f"Nothing was {'paused' if pause else 'resumed'}: {exc}.")
        else:
            if changed and pause:
                messages.success(
                    request, f"Paused queue '{queue}': workers claim none of its jobs until it is resumed."
                )
            elif changed:
                messages.success(request, f"Resumed queue '{queue}'.")
            else:
                messages.warning(request, f"Queue '{queue}' was {'already' if pause else 'not'} paused.")
        return jobs.redirect("overview")

    return pause_view
