"""The dashboard and the admin as a new user meets them (issue 28): breadcrumbs in the running
Django's markup, the dashboard linked from the admin index, runs that failed apart from runs that
were retried, a django.tasks task under its own path, and, in Chromium, a dashboard that fits a
1,400 px and a 390 px screen and a failed-jobs list whose error column stays inside the table.

Set DBQUEUE_SCREENSHOTS=1 to refresh docs/dashboard.png and docs/dashboard-390.png (with Django
older than 6.1: docs/dashboard-django52.png and docs/dashboard-390-django52.png, and so on).
"""

from __future__ import annotations

import logging
import re
from pathlib import Path

import django
import pytest
from django.contrib import admin
from django.contrib.auth.models import User
from django.contrib.staticfiles import finders
from django.test import RequestFactory
from django.urls import reverse
from django.utils import timezone

from django_dbqueue import history, metrics
from django_dbqueue.admin import dashboard
from django_dbqueue.admin.dashboard import HOUR
from django_dbqueue.handles import TASKS_JOB
from django_dbqueue.models import FailedJob, Job, JobHistory
from tests.conftest import run_worker
from tests.test_admin import make_failed
from tests.test_browser import live_url, page, screenshot_path  # noqa: F401  (fixtures)
from tests.test_dashboard import URL, add_history, busy_day

OVERVIEW = reverse("admin:django_dbqueue_overview")
FAILED_LIST = reverse("admin:django_dbqueue_failedjob_changelist")
# Screenshots of Djangos before 6.1 get the series in their names.
SUFFIX = "" if django.VERSION[:2] >= (6, 1) else f"-django{django.VERSION[0]}{django.VERSION[1]}"


def breadcrumbs_tag(html: str) -> str:
    """The element the page's breadcrumbs are marked up with (``ol`` or ``div``)."""
    found = re.findall(r'<(\w+) class="breadcrumbs">', html)
    assert len(found) == 1, found
    return str(found[0])


# -- breadcrumbs -----------------------------------------------------------------------


@pytest.mark.django_db
def test_the_dashboard_and_the_overview_mark_up_breadcrumbs_as_this_django_does_and_styles(admin_client):
    make_failed("x")
    # Django's own page: its change list template draws the breadcrumbs.
    own = breadcrumbs_tag(admin_client.get(FAILED_LIST).content.decode())
    css = Path(str(finders.find("admin/css/base.css"))).read_text()
    assert f"{own}.breadcrumbs {{" in css, f"this Django's CSS styles no {own}.breadcrumbs"
    for url, title in ((URL, "Queue dashboard"), (OVERVIEW, "Queue overview")):
        html = admin_client.get(url).content.decode()
        assert breadcrumbs_tag(html) == own, url
        app = reverse("admin:app_list", kwargs={"app_label": "django_dbqueue"})
        if own == "ol":
            assert f'<li aria-current="page">{title}</li>' in html and f'<li><a href="{app}">Job queue</a></li>' in html
        else:
            assert f"&rsaquo; {title}" in html and f'<a href="{app}">Job queue</a>' in html


# -- the link from the admin index -------------------------------------------------------


@pytest.mark.django_db
def test_the_admin_index_and_the_job_list_link_to_the_dashboard_for_users_who_may_view_jobs(staff):
    viewer = staff("view_job")
    index = viewer.get(reverse("admin:index")).content.decode()
    # The app's section lists the dashboard as the job history it charts: one click from the index.
    assert f'<a href="{URL}">Job history</a>' in index
    assert viewer.get(URL).status_code == 200
    assert f'href="{URL}"' in viewer.get(reverse("admin:django_dbqueue_job_changelist")).content.decode()
    # The app index and the sidebar of the app's pages list it too.
    assert f'href="{URL}"' in viewer.get(reverse("admin:app_list", args=["django_dbqueue"])).content.decode()
    # Nobody else sees the link, or the page; nothing in it can be added, changed or deleted.
    assert URL not in staff("view_failedjob").get(reverse("admin:index")).content.decode()
    assert staff("view_failedjob", "view_jobhistory").get(URL).status_code == 403
    request = RequestFactory().get(URL)
    request.user = User(is_superuser=True, is_active=True)
    model_admin = admin.site.get_model_admin(JobHistory)
    assert isinstance(model_admin, dashboard.DashboardAdmin)
    assert model_admin.get_model_perms(request) == {"add": False, "change": False, "delete": False, "view": True}


# -- failed apart from retried -----------------------------------------------------------


@pytest.mark.django_db
def test_a_job_that_succeeded_after_retries_shows_no_failure_and_its_retries_apart(staff):
    now = timezone.now()
    add_history(now, queue="emails", name="app.flaky", succeeded=4, retried=2, h3=6, run_time=0.3)
    client = staff("view_job", "view_failedjob")
    html = client.get(URL).content.decode()
    assert '<div class="dbq-card" id="dbq-card-failed"><span class="dbq-value">0</span>' in html
    assert '<div class="dbq-card" id="dbq-card-retried"><span class="dbq-value">2</span>' in html
    # Nothing is red: not the cards, the queue's row or the job name's.
    assert "dbq-alert" not in html.split("</style>")[1]
    names = client.get(URL).context["data"].names
    assert [(row.name, row.hour.failed, row.hour.retried, row.hour.runs) for row in names] == [("app.flaky", 0, 2, 6)]
    # The retries have a chart of their own; the failed runs' chart is empty.
    hour = next(row for row in client.get(URL).context["charts"] if row.window == HOUR)
    failed, retried = (figure.svg for figure in hour.figures[1:])
    assert [figure.caption.split()[0] for figure in hour.figures] == ["Succeeded", "Failed", "Retried"]
    assert 'class="dbq-failed"' not in failed and "No failures" in failed
    assert 'class="dbq-retried"' in retried and "No retries" not in retried

    # A run that failed for good is red, on the card, the queue's row and the job name's.
    JobHistory.objects.filter(name="app.flaky").update(failed=1, h3=7)
    html = client.get(URL).content.decode()
    assert '<div class="dbq-card dbq-alert" id="dbq-card-failed"><span class="dbq-value">1</span>' in html
    assert html.split('<table id="dbq-queues">')[1].split("</table>")[0].count("dbq-alert") == 1
    assert html.split('<table id="dbq-names">')[1].split("</table>")[0].count("dbq-alert") == 2  # the hour, the day


@pytest.mark.django_db
def test_the_three_charts_are_only_the_succeeded_one_for_users_who_may_not_view_failed_jobs(staff):
    add_history(timezone.now(), succeeded=3, failed=1, retried=1)
    html = staff("view_job").get(URL).content.decode()
    assert html.count('class="dbq-chart"') == 2 and "retried, last hour" not in html and "Retried</th>" not in html
    html = staff("view_job", "view_failedjob").get(URL).content.decode()
    assert html.count('class="dbq-chart"') == 6 and "retried, last hour" in html and "Retried</th>" in html


# -- a task under its own path -------------------------------------------------------------


def test_a_tasks_job_is_shown_under_the_path_its_envelope_carries():
    def row(name: str, payload: str) -> Job:
        return Job(name=name, payload=payload)

    assert history.shown_name(row(TASKS_JOB, '{"args": ["abc"], "kwargs": {"task_path": "shop.tasks.send"}}')) == (
        "shop.tasks.send"
    )
    # Enqueued before tasks carried their path, unreadable, or too long for the history: the job's name.
    for payload in ('{"args": ["abc"], "kwargs": {}}', "not json", '{"args": [], "kwargs": {"task_path": 3}}'):
        assert history.shown_name(row(TASKS_JOB, payload)) == TASKS_JOB
    long = "shop." + "x" * 300
    assert history.shown_name(row(TASKS_JOB, f'{{"args": [], "kwargs": {{"task_path": "{long}"}}}}')) == TASKS_JOB
    # Any other job: its name, its payload never read.
    assert history.shown_name(row("app.send", "not json")) == "app.send"


@pytest.mark.django_db(transaction=True)
def test_a_task_is_counted_logged_and_shown_under_its_own_path(caplog, admin_client):
    pytest.importorskip("django.tasks", reason="django.tasks needs Django 6")
    from tests.testapp import tasks

    path = tasks.add_numbers.module_path
    tasks.add_numbers.enqueue(1, 2)
    tasks.always_fails.enqueue("no")
    assert {history.shown_name(job) for job in Job.objects.all()} == {path, tasks.always_fails.module_path}
    with caplog.at_level(logging.INFO, logger="django_dbqueue"):
        run_worker()
    assert FailedJob.objects.get().name == TASKS_JOB  # the row still runs through the internal job
    assert set(JobHistory.objects.values_list("name", flat=True)) == {path, tasks.always_fails.module_path}
    assert f"job={path} " in caplog.text and f"job={TASKS_JOB} " not in caplog.text
    names = {row.name: row.hour for row in dashboard.gather().names}
    assert (names[path].runs, names[tasks.always_fails.module_path].failed) == (1, 1)
    assert f"<td>{path}</td>" in admin_client.get(URL).content.decode()
    # The metrics' name label: the task's path.
    assert ("default", path) in metrics.read_history()


# -- Chromium --------------------------------------------------------------------------


def log_in(page, live_url, next_url: str) -> None:  # noqa: F811
    User.objects.create_superuser("ops", "ops@example.com", "s3cret-pass")
    page.goto(f"{live_url}{reverse('admin:login')}?next={next_url}")
    page.fill("#id_username", "ops")
    page.fill("#id_password", "s3cret-pass")
    page.click("input[type=submit]")


@pytest.mark.django_db(transaction=True)
@pytest.mark.acceptance
def test_the_dashboard_is_one_click_from_the_index_and_fits_a_wide_and_a_phone_screen(
    live_url,  # noqa: F811
    page,  # noqa: F811
    tmp_path,
):
    busy_day()
    page.set_viewport_size({"width": 1400, "height": 900})
    log_in(page, live_url, reverse("admin:index"))
    page.click(f"#content-main a[href='{URL}']")
    page.wait_for_selector(".dbq-dashboard")
    assert page.locator("svg.dbq-chart").count() == 6
    # The breadcrumbs are styled by this Django's CSS: a coloured bar, not bare links.
    background = page.eval_on_selector(".breadcrumbs", "el => getComputedStyle(el).backgroundColor")
    assert background not in ("rgba(0, 0, 0, 0)", "transparent"), background
    for width, name in ((1400, f"dashboard{SUFFIX}.png"), (390, f"dashboard-390{SUFFIX}.png")):
        page.set_viewport_size({"width": width, "height": 900})
        page.reload()
        page.wait_for_selector(".dbq-dashboard")
        # Nothing scrolls the page sideways: wide tables scroll inside their own box.
        assert page.evaluate("document.documentElement.scrollWidth") <= width
        for chart in page.locator("svg.dbq-chart").all():
            box = chart.bounding_box()
            assert box is not None and box["x"] >= 0 and box["x"] + box["width"] <= width
        page.screenshot(path=str(screenshot_path(name, tmp_path)), full_page=True)
    queues = "document.querySelector('#dbq-queues').parentElement"
    assert page.evaluate(f"{queues}.scrollWidth > {queues}.clientWidth")  # at 390 px, the table scrolls in its box


@pytest.mark.django_db(transaction=True)
@pytest.mark.acceptance
def test_the_failed_jobs_error_column_stays_inside_the_table_at_1400_px(live_url, page):  # noqa: F811
    error = (
        "requests.exceptions.ConnectionError: HTTPSConnectionPool(host='payments.internal.example.com',"
        "port=443):_Max_retries_exceeded_with_url:/v1/charges/ch_3PqRsTuVwXyZ0123456789abcdef/capture?expand=balance"
    )
    for key in ("resize", "upload"):
        failed = make_failed(key)
        FailedJob.objects.filter(pk=failed.pk).update(
            error=f"Traceback (most recent call last):\n  ...\n{error}",
            exception_class="requests.exceptions.ConnectionErrorWithAVeryLongNameFromAThirdPartyClientLibrary",
        )
    page.set_viewport_size({"width": 1400, "height": 800})
    log_in(page, live_url, FAILED_LIST)
    page.wait_for_selector("#result_list")
    results = "document.querySelector('#changelist-form .results')"
    assert page.evaluate(f"{results}.scrollWidth <= {results}.clientWidth")
    cell = page.locator("#result_list td.field-short_error").first
    box, frame = cell.bounding_box(), page.locator("#changelist-form .results").bounding_box()
    assert box is not None and frame is not None and box["x"] + box["width"] <= frame["x"] + frame["width"]
    # Cut at 120 characters; the whole line in the tooltip.
    assert cell.inner_text().endswith("…") and cell.locator("span").get_attribute("title") == error
