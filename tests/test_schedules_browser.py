"""The schedules admin page in a real headless Chromium: list, run now, disable.

Set DBQUEUE_SCREENSHOTS=1 to refresh docs/schedules.png.
"""

from __future__ import annotations

import pytest
from django.contrib.auth.models import User
from django.urls import reverse

from django_dbqueue import schedules
from django_dbqueue.models import Job, ScheduleState
from django_dbqueue.schedules import periodic
from django_dbqueue.ticker import Ticker
from tests.test_browser import live_url, page, screenshot_path  # noqa: F401  (fixtures)
from tests.testapp import jobs

# Threads, loops and processes behave alike on every Django: run with one (scripts/test).
pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.acceptance, pytest.mark.one_django]


@pytest.fixture
def declared_schedules():
    declared = {
        "nightly-report": periodic(jobs.record_tick, "30 2 * * *", name="nightly-report", tick_argument="tick"),
        "sync-crm": periodic(
            jobs.record_tick, "*/15 * * * *", name="sync-crm", tz="America/New_York", tick_argument="tick"
        ),
        "heartbeat": periodic(jobs.record_tick, every=60, name="heartbeat", tick_argument="tick"),
    }
    schedules.sync(declared)
    Ticker("browser").look(declared)
    yield declared
    for name in declared:
        schedules.unschedule(name)


def test_an_operator_runs_a_schedule_now_and_disables_another(live_url, page, tmp_path, declared_schedules):  # noqa: F811
    ScheduleState.objects.create(
        name="old-cleanup",
        job_name=jobs.record.name,
        expression="0 4 * * *",
        timezone="UTC",
        created_at=ScheduleState.objects.get(name="heartbeat").created_at,
        updated_at=ScheduleState.objects.get(name="heartbeat").updated_at,
    )
    User.objects.create_superuser("ops", "ops@example.com", "s3cret-pass")
    url = reverse("admin:django_dbqueue_schedulestate_changelist")
    page.goto(f"{live_url}{reverse('admin:login')}?next={url}")
    page.fill("#id_username", "ops")
    page.fill("#id_password", "s3cret-pass")
    page.click("input[type=submit]")
    page.wait_for_selector("#result_list")
    page.set_viewport_size({"width": 1900, "height": 700})
    assert page.locator("#result_list tbody tr").count() == 4

    nightly = ScheduleState.objects.get(name="nightly-report")
    page.check(f"input[name=_selected_action][value='{nightly.pk}']")
    page.select_option("select[name=action]", "run_selected_now")
    page.click("button[name=index]")
    page.wait_for_selector(".messagelist")
    job = Job.objects.get()
    assert f"Enqueued now: nightly-report (job {job.pk})." in page.inner_text(".messagelist")
    row = page.locator("#result_list tbody tr", has_text="nightly-report")
    assert row.locator("td.field-last_outcome").inner_text() == "waiting"

    sync = ScheduleState.objects.get(name="sync-crm")
    page.check(f"input[name=_selected_action][value='{sync.pk}']")
    page.select_option("select[name=action]", "disable_selected")
    page.click("button[name=index]")
    page.wait_for_selector(".messagelist")
    assert "1 schedule was disabled." in page.inner_text(".messagelist")
    assert not ScheduleState.objects.get(name="sync-crm").enabled
    stale = page.locator("#result_list tbody tr", has_text="old-cleanup")
    assert stale.locator("td.field-in_code img").get_attribute("alt") == "False"
    page.screenshot(path=str(screenshot_path("schedules.png", tmp_path)), full_page=True)
