"""The failed-job retry flow in a real headless Chromium (Debian's, driven by Playwright).

Set DBQUEUE_SCREENSHOTS=1 to refresh the screenshots in docs/.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from django.contrib.auth.models import User
from django.db import connections
from django.urls import reverse

from django_dbqueue.models import Job
from tests.conftest import ROOT
from tests.test_admin import make_failed

CHROMIUM = os.environ.get("DBQUEUE_CHROMIUM", "/usr/bin/chromium")

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.acceptance]


@pytest.fixture
def page(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    if shutil.which(CHROMIUM) is None:
        pytest.fail(f"Chromium is not installed at {CHROMIUM}: apt-get install chromium (scripts/test does)")
    from playwright.sync_api import sync_playwright

    # Playwright's sync API keeps an event loop in this thread; the ORM calls
    # the test makes between page actions are still plain synchronous calls.
    monkeypatch.setenv("DJANGO_ALLOW_ASYNC_UNSAFE", "true")
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(
            executable_path=CHROMIUM,
            args=[
                "--headless",
                "--no-sandbox",
                "--disable-gpu",
                "--disable-quic",
                "--no-first-run",
                "--disable-background-networking",
                "--disable-component-update",
                "--disable-sync",
            ],
        )
        context = browser.new_context(viewport={"width": 1600, "height": 800})
        context.set_default_timeout(15_000)
        yield context.new_page()
        # ORM calls made while Playwright's loop runs get their own connection
        # (Django keeps connections per context); close it here, in that context.
        connections.close_all()
        browser.close()


@pytest.fixture
def live_url() -> Iterator[str]:
    """A live server for this test only, stopped (and its connections closed) at teardown."""
    from django.contrib.staticfiles.handlers import StaticFilesHandler
    from django.test.testcases import LiveServerThread

    thread = LiveServerThread("localhost", StaticFilesHandler, connections_override={}, port=0)
    thread.daemon = True
    thread.start()
    thread.is_ready.wait()
    if thread.error:
        raise thread.error
    yield f"http://localhost:{thread.port}"
    thread.terminate()


def screenshot_path(name: str, tmp_path: Path) -> Path:
    if os.environ.get("DBQUEUE_SCREENSHOTS"):
        return ROOT / "docs" / name
    return tmp_path / name


def test_an_operator_retries_two_failed_jobs_from_the_admin(live_url, page, tmp_path):
    User.objects.create_superuser("ops", "ops@example.com", "s3cret-pass")
    first, second, untouched = make_failed("resize"), make_failed("upload"), make_failed("notify", queue="emails")
    jobs_before = Job.objects.count()

    page.goto(f"{live_url}{reverse('admin:login')}?next={reverse('admin:django_dbqueue_failedjob_changelist')}")
    page.fill("#id_username", "ops")
    page.fill("#id_password", "s3cret-pass")
    page.click("input[type=submit]")
    page.wait_for_selector("#result_list")
    assert page.locator("#result_list tbody tr").count() == 3
    page.screenshot(path=str(screenshot_path("failed-jobs.png", tmp_path)), full_page=True)

    page.check(f"input[name=_selected_action][value='{first.pk}']")
    page.check(f"input[name=_selected_action][value='{second.pk}']")
    page.select_option("select[name=action]", "retry_selected")
    page.click("button[name=index]")
    page.wait_for_selector(".messagelist")
    assert "2 jobs were put back on the queue." in page.inner_text(".messagelist")
    assert page.locator("#result_list tbody tr").count() == 1

    page.goto(f"{live_url}{reverse('admin:django_dbqueue_job_changelist')}?state=waiting")
    rows = page.locator("#result_list tbody tr")
    assert rows.count() == 2
    assert all(rows.nth(i).locator("td.field-state").inner_text() == "waiting" for i in range(2))
    assert Job.objects.count() == jobs_before + 2
    assert {job.payload for job in Job.objects.waiting()} == {first.payload, second.payload}

    page.goto(f"{live_url}{reverse('admin:django_dbqueue_overview')}")
    page.wait_for_selector("#queue-overview")
    assert "emails" in page.inner_text("#queue-overview")
    page.screenshot(path=str(screenshot_path("queue-overview.png", tmp_path)), full_page=True)
    assert untouched.pk is not None
