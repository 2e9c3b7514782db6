"""The admin dashboard: its figures read from history and worker rows, its charts, who may see it,
and (in Chromium) how it looks with and without data.

Set DBQUEUE_SCREENSHOTS=1 to refresh docs/dashboard.png and docs/dashboard-dark.png.
"""

from __future__ import annotations

import math
import random
from datetime import UTC, datetime, timedelta

import pytest
from django.contrib.auth.models import User
from django.db import connections
from django.db.models import F
from django.test import Client
from django.test.utils import CaptureQueriesContext
from django.urls import reverse
from django.utils import timezone

from django_dbqueue import history, pauses, workers
from django_dbqueue.admin import charts, dashboard
from django_dbqueue.admin.dashboard import DAY, HOUR
from django_dbqueue.models import Job, JobHistory, QueueWorker
from django_dbqueue.operations import read_alias
from tests.conftest import run_worker
from tests.test_admin import make_failed
from tests.test_browser import live_url, page, screenshot_path  # noqa: F401  (fixtures)
from tests.testapp import jobs

URL = reverse("admin:django_dbqueue_dashboard")
# A fixed end for the charts: the history rows are placed around it.
NOW = datetime(2025, 3, 4, 12, 34, 56, tzinfo=UTC)
MINUTE = timedelta(minutes=1)


def add_history(bucket: datetime, queue: str = "default", name: str = "app.send", **counts: int) -> JobHistory:
    """A history row as workers write it; ``h<i>=n`` counts runs in a run-time bucket."""
    bucket = bucket.replace(second=0, microsecond=0)
    bins = {f"h{index}": counts.pop(f"h{index}", 0) for index in range(len(history.BINS))}
    row: JobHistory = JobHistory.objects.create(bucket=bucket, queue=queue, name=name, **counts, **bins)
    return row


def add_worker(worker_id: str, queues: str = "default", seen_ago: float = 0, **fields: object) -> QueueWorker:
    now = timezone.now()
    fields.setdefault("hostname", "web-1")
    fields.setdefault("pid", 100 + QueueWorker.objects.count())
    row: QueueWorker = QueueWorker.objects.create(
        worker_id=worker_id,
        queues=queues,
        started_at=now - timedelta(seconds=seen_ago + 600),
        last_seen_at=now - timedelta(seconds=seen_ago),
        **fields,
    )
    return row


# -- unit: windows and charts -----------------------------------------------------


def test_a_window_ends_with_the_bar_that_holds_now_and_is_aligned_on_its_step():
    hour = HOUR.starts(NOW)
    assert len(hour) == 60
    assert hour[-1] == datetime(2025, 3, 4, 12, 34, tzinfo=UTC)
    assert hour[0] == datetime(2025, 3, 4, 11, 35, tzinfo=UTC)
    day = DAY.starts(NOW)
    assert len(day) == 144
    assert day[-1] == datetime(2025, 3, 4, 12, 30, tzinfo=UTC)
    assert day[0] == datetime(2025, 3, 3, 12, 40, tzinfo=UTC)


def test_the_chart_scale_rounds_up_to_a_round_number():
    values = (0, 1, 3, 7, 20, 21, 480, 560, 801)
    assert [charts.nice_ceiling(value) for value in values] == [1, 1, 3, 8, 20, 30, 500, 600, 1000]


def test_a_bar_chart_draws_one_group_per_bar_with_its_values_in_the_tooltip_and_escapes_text():
    svg = charts.bar_chart(
        ["10:00", "10:01", "<b>"],
        [charts.Series("failed", "failed", [0, 3, 1]), charts.Series("retried", "retried", [2, 0, 0])],
        title="Failures & retries",
        ticks=[(0, "10:00")],
    )
    assert svg.count("<g>") == 3
    assert "<title>10:01: 0 failed, 3 retried</title>" not in svg
    assert "<title>10:01: 3 failed, 0 retried</title>" in svg
    assert "&lt;b&gt;" in svg and "<b>" not in svg
    assert 'aria-label="Failures &amp; retries: 4 failed, 2 retried"' in svg
    # Scale 0..3: the bar of 3 failed is the plot's height; no line at 1.5 jobs.
    plot = 150 - charts.TOP - charts.BOTTOM
    assert f'height="{plot:.2f}"' in svg
    assert ">1.5</text>" not in svg and ">3</text>" in svg
    assert "No runs recorded" not in svg


def test_an_empty_chart_says_so():
    svg = charts.bar_chart(["a", "b"], [charts.Series("succeeded", "ok", [0, 0])], title="t", empty="No failures")
    assert "No failures" in svg and 'class="dbq-ok"' not in svg


def test_durations_are_written_as_bounds_and_a_run_longer_than_the_last_bound_as_more():
    assert dashboard.duration(0.025, bound=True) == "≤ 25 ms"
    assert dashboard.duration(2.5, bound=True) == "≤ 2.5 s"
    assert dashboard.duration(math.inf, bound=True) == "> 60 s"
    assert dashboard.duration(None) == dashboard.NOTHING
    assert dashboard.duration(95) == "95 s"
    assert dashboard.duration(600) == "10 min"
    assert [dashboard.age(seconds) for seconds in (0.2, 95.2, 600)] == ["< 1 s", "95 s", "10 min"]


# -- integration: figures from real rows ----------------------------------------------


@pytest.mark.django_db
def test_each_minute_counts_in_its_bar_and_the_series_filters_by_queue():
    add_history(NOW, succeeded=5, failed=1)
    add_history(NOW - 3 * MINUTE, succeeded=2, retried=4)
    add_history(NOW - 3 * MINUTE, name="app.other", succeeded=1)
    add_history(NOW - 3 * MINUTE, queue="emails", succeeded=7)
    add_history(NOW - 61 * MINUTE, succeeded=100)  # before the hour
    add_history(NOW + MINUTE, succeeded=9)  # a worker whose clock is ahead: in the last bar
    hour = dashboard.series(HOUR, NOW)
    assert (hour[-1].succeeded, hour[-1].failed, hour[-1].retried) == (14, 1, 0)
    assert (hour[-4].succeeded, hour[-4].failed, hour[-4].retried) == (10, 0, 4)
    assert sum(point.succeeded for point in hour) == 24
    emails = dashboard.series(HOUR, NOW, queue="emails")
    assert [point.succeeded for point in emails if point.succeeded] == [7]
    assert dashboard.series(HOUR, NOW, queue="nothing") == [dashboard.Point(start) for start in HOUR.starts(NOW)]


@pytest.mark.django_db
def test_the_day_series_sums_ten_minutes_per_bar():
    for minute in range(20):
        add_history(NOW - minute * MINUTE, succeeded=1, failed=minute % 2)
    add_history(NOW - timedelta(hours=23, minutes=50), succeeded=3)  # 12:44, the first bar
    add_history(NOW - timedelta(hours=25), succeeded=1000)
    day = dashboard.series(DAY, NOW)
    # 12:34:56 back to 12:15: bars 12:30 (5 minutes), 12:20 (10), 12:10 (5).
    assert [(point.start.strftime("%H:%M"), point.succeeded) for point in day[-3:]] == [
        ("12:10", 5),
        ("12:20", 10),
        ("12:30", 5),
    ]
    assert sum(point.failed for point in day) == 10
    assert day[0].succeeded == 3


@pytest.mark.django_db
def test_run_times_give_p50_and_p95_per_job_name_over_the_hour_and_the_day():
    # The hour: 90 runs at most 25 ms (h2), 10 at most 2.5 s (h8); mean 40 s / 100.
    add_history(NOW, name="app.resize", succeeded=95, failed=5, run_time=40.0, h2=90, h8=10)
    # Earlier in the day: 100 slow runs, longer than the last bound.
    add_history(NOW - timedelta(hours=5), name="app.resize", succeeded=100, run_time=9000.0, h12=100)
    add_history(NOW - timedelta(hours=2), queue="emails", name="app.send", succeeded=4, run_time=0.02, h0=4)
    names = {row.name: row for row in dashboard.run_times(NOW)}
    assert set(names) == {"app.resize", "app.send"}
    resize = names["app.resize"]
    assert (resize.hour.runs, resize.hour.failures, resize.hour.p50, resize.hour.p95) == (100, 5, 0.025, 2.5)
    assert resize.hour.mean == pytest.approx(0.4)
    assert (resize.day.runs, resize.day.p50, resize.day.p95) == (200, 2.5, math.inf)
    assert resize.day.p95_label == "> 60 s"
    send = names["app.send"]
    assert (send.hour.runs, send.hour.p50, send.hour.p50_label) == (0, None, dashboard.NOTHING)
    assert (send.day.runs, send.day.p50_label) == (4, "≤ 5 ms")
    assert [row.name for row in dashboard.run_times(NOW, queue="emails")] == ["app.send"]


@pytest.mark.django_db
def test_a_worker_that_missed_three_beats_is_marked_dead_and_the_rows_filter_by_queue():
    add_worker("live", queues="default,emails", hostname="web-1", processed=12, running=1, current_job="app.x #3")
    add_worker("gone", queues="reports", hostname="web-2", seen_ago=workers.dead_after() + 60)
    rows = {row.worker.worker_id: row for row in dashboard.worker_rows()}
    assert not rows["live"].dead and rows["live"].seen_ago < workers.dead_after()
    assert rows["gone"].dead and rows["gone"].up_for > rows["gone"].seen_ago
    assert [row.worker.worker_id for row in dashboard.worker_rows(queue="emails")] == ["live"]


@pytest.mark.django_db
def test_the_queues_are_those_with_jobs_runs_live_workers_or_a_pause():
    jobs.add.enqueue(1, 1)
    Job.objects.update(available_at=F("available_at") - timedelta(seconds=90))
    make_failed("x", queue="broken")
    add_history(timezone.now(), queue="emails", succeeded=3, retried=1)
    add_history(timezone.now() - timedelta(hours=3), queue="emails", succeeded=10, failed=2)
    pauses.pause("bulk", force=True)
    add_worker("w", queues="reports")
    add_worker("dead", queues="ghosts", seen_ago=workers.dead_after() + 60)
    live = dashboard.worker_rows()
    rows = {row.stats.queue: row for row in dashboard.queue_rows(timezone.now(), live)}
    assert list(rows) == ["broken", "bulk", "default", "emails", "reports"]
    assert rows["default"].stats.waiting == 1 and rows["default"].stats.oldest_waiting_seconds >= 89
    assert rows["broken"].stats.failed == 1
    assert rows["bulk"].stats.paused
    emails = rows["emails"]
    assert (emails.hour_total.succeeded, emails.hour_total.retried) == (3, 1)
    assert (emails.day.succeeded, emails.day.failed, emails.day.retried) == (13, 2, 1)


@pytest.mark.django_db(transaction=True)
def test_runs_of_a_real_worker_show_once_it_stopped():
    for key in ("a", "b", "c"):
        jobs.record.enqueue(key)
    jobs.always_fail.enqueue("x")  # two tries: retried once, then failed
    run_worker()
    data = dashboard.gather()
    total = data.hour_total
    assert (total.succeeded, total.failed, total.retried) == (3, 1, 1)
    assert data.day_total == dashboard.sum_points(data.day) and data.day_total.succeeded == 3
    names = {row.name: row.hour for row in data.names}
    assert names[jobs.record.name].runs == 3 and names[jobs.record.name].p50 is not None
    assert names[jobs.always_fail.name].failures == 2
    assert data.workers == []  # the worker removed its row when it stopped


@pytest.mark.django_db
def test_the_figures_are_read_in_the_same_few_queries_whatever_the_rows():
    def queries() -> int:
        with CaptureQueriesContext(connections[read_alias()]) as captured:
            dashboard.gather(NOW)
        return len(captured)

    add_history(NOW, succeeded=1)
    add_worker("one")
    few = queries()
    for minute in range(1, 30):
        for queue in ("default", "emails", "reports"):
            add_history(NOW - minute * MINUTE, queue=queue, name=f"app.job{minute % 4}", succeeded=1)
    for index in range(5):
        add_worker(f"more-{index}", queues="emails")
        jobs.add.using(queue=f"q{index}").enqueue(1, 1)
    assert queries() == few <= 10


# -- the page ----------------------------------------------------------------------


@pytest.mark.django_db
def test_the_dashboard_needs_a_login_and_the_view_job_permission(staff):
    response = Client().get(URL)
    assert response.status_code == 302 and response["Location"].startswith(reverse("admin:login"))
    assert staff().get(URL).status_code == 403
    assert staff("view_failedjob").get(URL).status_code == 403
    assert staff("view_job").get(URL).status_code == 200


@pytest.mark.django_db
def test_the_empty_dashboard_renders_and_says_what_is_missing(admin_client):
    html = admin_client.get(URL).content.decode()
    assert html.count('class="dbq-chart"') == 6
    assert "No runs recorded" in html and "No failures" in html
    assert "No queue holds jobs" in html
    assert "No queue is paused." in html
    assert "No runs recorded in the last 24 hours." in html
    assert "No worker is running" in html


@pytest.mark.django_db
def test_the_dashboard_shows_queues_run_times_workers_and_pauses(staff):
    jobs.add.using(queue="emails").enqueue(1, 1)
    make_failed("x", queue="emails")
    now = timezone.now()
    add_history(now, queue="emails", name="app.<send>", succeeded=8, failed=1, h3=9, run_time=0.3)
    add_history(now, queue="default", name="app.build", succeeded=2, h9=2, run_time=8)
    add_worker("w-live", queues="emails", hostname="mail-host", options="threads=4", current_job="app.send #9")
    add_worker("w-dead", queues="default", hostname="gone-host", seen_ago=workers.dead_after() + 60)
    pauses.pause("default", force=True)

    html = staff("view_job").get(URL).content.decode()
    assert "app.&lt;send&gt;" in html and "app.<send>" not in html
    assert "≤ 50 ms" in html and "≤ 5 s" in html
    assert '<tr class="dbq-live"' in html and '<tr class="dbq-dead"' in html
    assert "mail-host" in html and "threads=4" in html and "app.send #9" in html
    assert '<ul id="dbq-paused">' in html and "<strong>default</strong>, since" in html
    assert "?queue=emails" in html
    # Failed jobs (kept) only with view_failedjob, as on the overview.
    assert "failed jobs kept" not in html and "Failed jobs</th>" not in html
    html = staff("view_job", "view_failedjob").get(URL).content.decode()
    assert "failed jobs kept" in html and "Failed jobs</th>" in html

    filtered = staff("view_job").get(URL, {"queue": "emails"})
    assert filtered.context["title"] == "Queue dashboard: emails"
    data = filtered.context["data"]
    assert data.hour_total.succeeded == 8 and [row.name for row in data.names] == ["app.<send>"]
    assert [row.worker.worker_id for row in data.workers] == ["w-live"]


@pytest.mark.django_db
def test_failures_are_counted_only_for_users_who_may_view_failed_jobs(staff):
    now = timezone.now()
    add_history(now, queue="emails", name="app.send", succeeded=8, failed=3, retried=2, h3=13, run_time=1.3)
    add_history(
        now - HOUR.span - DAY.step * 3, queue="emails", name="app.send", succeeded=1, failed=4, h3=5, run_time=0.5
    )
    add_worker("w-live", queues="emails", processed=20, failed=7)

    html = staff("view_job").get(URL).content.decode()
    assert html.count('class="dbq-chart"') == 2  # the succeeded charts only
    assert "dbq-failed" not in html.split("</style>")[1] and "dbq-retried" not in html.split("</style>")[1]
    for hidden in ("failed or retried", "Failed / retried", " failed,", "Failed</th>", "Runs</th>", "No failures"):
        assert hidden not in html, hidden
    assert 'id="dbq-no-failures"' in html and "8 succeeded" in html and "9 succeeded" in html

    html = staff("view_job", "view_failedjob").get(URL).content.decode()
    assert html.count('class="dbq-chart"') == 6 and 'id="dbq-no-failures"' not in html
    assert "failed, last hour" in html and "retried, last hour" in html and "Failed</th>" in html
    assert "7 failed" in html  # the day's failures: 3 + 4


@pytest.mark.django_db
def test_the_overview_links_to_the_dashboard_for_users_who_may_see_it(staff):
    jobs.add.enqueue(1, 1)
    assert URL in staff("view_job").get(reverse("admin:django_dbqueue_overview")).content.decode()
    make_failed("x")
    assert URL not in staff("view_failedjob").get(reverse("admin:django_dbqueue_overview")).content.decode()


# -- Chromium ------------------------------------------------------------------------


def busy_day() -> None:
    """A day of history for three queues, a failure burst two hours ago, workers, waiting jobs, a pause."""
    now = timezone.now()
    rng = random.Random(15)
    names = {"default": ["app.resize_image", "app.sync_crm"], "emails": ["app.send_email"], "reports": ["app.report"]}
    rows = []
    for minute in range(24 * 60):
        bucket = (now - minute * MINUTE).replace(second=0, microsecond=0)
        load = 1 + math.sin(minute / 1440 * 2 * math.pi * 2) * 0.6
        for queue, queue_names in names.items():
            for name in queue_names:
                if queue == "reports" and minute % 30:
                    continue
                runs = max(0, int(rng.gauss(12 * load, 3))) if queue != "reports" else 1
                failed = 1 if rng.random() < 0.02 else 0
                retried = rng.randint(3, 8) if 110 <= minute <= 125 and queue == "emails" else 0
                bins = [0] * len(history.BINS)
                slow = {"app.resize_image": 6, "app.sync_crm": 8, "app.send_email": 4, "app.report": 10}[name]
                for _ in range(runs + failed + retried):
                    bins[min(max(0, int(rng.gauss(slow, 1))), len(bins) - 1)] += 1
                rows.append(
                    JobHistory(
                        bucket=bucket,
                        queue=queue,
                        name=name,
                        started=runs + failed + retried,
                        succeeded=runs,
                        failed=failed,
                        retried=retried,
                        run_time=sum(count * history.BOUNDS[min(i, 11)] / 2 for i, count in enumerate(bins)),
                        **{f"h{i}": count for i, count in enumerate(bins)},
                    )
                )
    JobHistory.objects.bulk_create(rows, batch_size=500)
    add_worker(
        "web-1:4121",
        queues="default,emails",
        hostname="web-1",
        pid=4121,
        options="threads=4 batch=10",
        processed=18234,
        failed=41,
        running=3,
        current_job="app.resize_image #88123",
    )
    add_worker("web-2:977", queues="emails", hostname="web-2", pid=977, options="batch=10", processed=9120, failed=12)
    add_worker(
        "batch-1:31",
        queues="reports",
        hostname="batch-1",
        pid=31,
        seen_ago=400,
        processed=14,
        running=1,
        current_job="app.report #88001",
    )
    for index in range(25):
        jobs.record.enqueue(f"waiting-{index}")
    Job.objects.update(available_at=F("available_at") - timedelta(seconds=95))
    for index in range(3):
        make_failed(f"broken-{index}", queue="emails")
    pauses.pause("reports", force=True)


@pytest.mark.django_db(transaction=True)
@pytest.mark.acceptance
@pytest.mark.one_django
def test_the_dashboard_in_chromium_without_and_with_data(live_url, page, tmp_path):  # noqa: F811
    User.objects.create_superuser("ops", "ops@example.com", "s3cret-pass")
    page.goto(f"{live_url}{reverse('admin:login')}?next={reverse('admin:django_dbqueue_overview')}")
    page.fill("#id_username", "ops")
    page.fill("#id_password", "s3cret-pass")
    page.click("input[type=submit]")
    page.click("text=Dashboard")
    page.wait_for_selector(".dbq-dashboard")
    assert page.locator("svg.dbq-chart").count() == 6
    assert page.locator("text=No worker is running").count() == 1

    busy_day()
    page.set_viewport_size({"width": 1400, "height": 900})
    page.reload()
    assert page.locator("svg.dbq-chart").count() == 6
    # The hour: 60 bars in each chart; the day: 144.
    assert page.locator("#dbq-hour ~ .dbq-charts svg").first.locator("g").count() == 60
    assert page.locator("#dbq-workers tbody tr").count() == 3
    assert page.locator("#dbq-workers tr.dbq-dead td.dbq-state").inner_text() == "dead"
    assert page.locator("#dbq-paused").inner_text().startswith("reports, since")
    assert page.locator("#dbq-names tbody tr").count() == 4
    # Bars are drawn in the theme's colours (the admin's variables), light and dark.
    light = page.eval_on_selector("rect.dbq-ok", "el => getComputedStyle(el).fill")
    page.screenshot(path=str(screenshot_path("dashboard.png", tmp_path)), full_page=True)
    page.emulate_media(color_scheme="dark")
    dark = page.eval_on_selector("rect.dbq-ok", "el => getComputedStyle(el).fill")
    assert light != dark
    page.screenshot(path=str(screenshot_path("dashboard-dark.png", tmp_path)), full_page=True)

    page.click("#dbq-queues >> text=emails")
    page.wait_for_selector("text=Queue dashboard: emails")
    assert page.locator("#dbq-workers tbody tr").count() == 2
