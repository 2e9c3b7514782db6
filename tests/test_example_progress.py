"""The example project's progress page, end to end: a real runserver, a real worker, headless Chromium.

The example project has its own settings (pytest runs with tests.settings), so it
runs in subprocesses on a temporary SQLite file (EXAMPLE_SQLITE_PATH). No test
database is used. Set DBQUEUE_SCREENSHOTS=1 to refresh docs/chain-progress.png.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import ROOT

CHROMIUM = os.environ.get("DBQUEUE_CHROMIUM", "/usr/bin/chromium")
MANAGE = ROOT / "example_project" / "manage.py"

pytestmark = [pytest.mark.acceptance, pytest.mark.example_project]


PR_SET_PDEATHSIG = 1
# Looked up here, not in the forked child, where only a plain call is safe.
PRCTL = ctypes.CDLL(None, use_errno=True).prctl if sys.platform == "linux" else None


def die_with_pytest() -> None:
    """Run in the child before exec: get SIGKILL if pytest dies before its teardown could run (Linux)."""
    if PRCTL is not None:
        PRCTL(PR_SET_PDEATHSIG, signal.SIGKILL)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.fixture
def example_env(tmp_path: Path) -> dict[str, str]:
    """The environment of the example project's processes, with a migrated temporary SQLite database."""
    env = {
        **os.environ,
        # pytest-django exported tests.settings; the example project has its own.
        "DJANGO_SETTINGS_MODULE": "config.settings",
        "EXAMPLE_SQLITE_PATH": str(tmp_path / "example.sqlite3"),
        "PYTHONUNBUFFERED": "1",
    }
    for name in ("DATABASE_URL", "DBQUEUE_TEST_USE_TEST_DB"):
        env.pop(name, None)
    result = subprocess.run(
        [sys.executable, str(MANAGE), "migrate", "--no-input"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, f"migrate failed:\n{result.stdout}\n{result.stderr}"
    return env


class Process:
    """A ``manage.py`` subprocess whose output goes to a file."""

    def __init__(self, log_path: Path, args: list[str], env: dict[str, str]) -> None:
        self.log_path = log_path
        self._log = open(log_path, "wb")
        self.process = subprocess.Popen(
            [sys.executable, str(MANAGE), *args],
            cwd=ROOT,
            env=env,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            preexec_fn=die_with_pytest,
        )

    def output(self) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")

    def alive(self) -> bool:
        return self.process.poll() is None

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait(timeout=10)
        self._log.close()


@pytest.fixture
def manage(example_env: dict[str, str], tmp_path: Path) -> Iterator[Callable[..., Process]]:
    """Start ``manage.py`` subprocesses; every one is killed at teardown."""
    started: list[Process] = []

    def start(*args: str) -> Process:
        process = Process(tmp_path / f"{args[0]}-{len(started)}.log", list(args), example_env)
        started.append(process)
        return process

    try:
        yield start
    finally:
        for process in started:
            process.kill()


def wait_for(predicate: Callable[[], bool], timeout: float, message: Callable[[], str]) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.1)
    raise AssertionError(message())


def status_of(url: str) -> int | None:
    """The HTTP status of GET ``url``, or None if the server does not answer."""
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return int(response.status)
    except urllib.error.HTTPError as exc:
        exc.close()
        return exc.code
    except OSError:
        return None


@pytest.fixture
def browser_page() -> Iterator[Any]:
    if shutil.which(CHROMIUM) is None:
        pytest.fail(f"Chromium is not installed at {CHROMIUM}: apt-get install chromium (scripts/test does)")
    from playwright.sync_api import sync_playwright

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
        try:
            context = browser.new_context(viewport={"width": 900, "height": 480})
            context.set_default_timeout(15_000)
            yield context.new_page()
        finally:
            browser.close()


def screenshot_path(name: str, tmp_path: Path) -> Path:
    if os.environ.get("DBQUEUE_SCREENSHOTS") == "1":
        return ROOT / "docs" / name
    return tmp_path / name


def test_the_progress_bar_follows_a_long_chain_to_the_end(manage, browser_page, tmp_path):
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    server = manage("runserver", "--noreload", f"127.0.0.1:{port}")
    worker = manage("queue_work", "--sleep", "0.1")

    wait_for(
        lambda: status_of(f"{base}/") == 200 or not server.alive(),
        60,
        lambda: f"runserver did not answer within 60 s:\n{server.output()}",
    )
    assert server.alive(), f"runserver exited:\n{server.output()}"
    wait_for(
        lambda: "worker started" in worker.output() or not worker.alive(),
        60,
        lambda: f"queue_work did not start within 60 s:\n{worker.output()}",
    )
    assert worker.alive(), f"queue_work exited:\n{worker.output()}"
    assert status_of(f"{base}/admin/login/") == 200
    # The JSON view serves no one without a login or a token, known key or not.
    assert status_of(f"{base}/queue/progress/chain:unknown/") == 401

    page = browser_page
    page.goto(f"{base}/")
    page.click("text=Start a long chain")
    page.wait_for_url("**/progress/chain:*/")
    key = page.url.rstrip("/").rsplit("/", 1)[1]

    def read() -> dict[str, Any]:
        return dict(
            page.evaluate("""() => {
            const box = document.getElementById("chain-progress");
            return {state: box.dataset.state,
                    percent: Number(box.querySelector("[role=progressbar]").getAttribute("aria-valuenow")),
                    width: box.querySelector(".fill").style.width,
                    stage: box.querySelector(".stage").textContent,
                    shown: box.querySelector(".percent").textContent};
        }""")
        )

    # Four steps of about 1.6 s: the chain takes some 7 s; allow for a slow machine.
    seen: list[dict[str, Any]] = []
    shot = screenshot_path("chain-progress.png", tmp_path)
    screenshot_taken = False
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        state = read()
        seen.append(state)
        if state["state"] in ("finished", "failed"):
            break
        if not screenshot_taken and 30 <= state["percent"] <= 70:
            page.screenshot(path=str(shot), full_page=True)
            screenshot_taken = True
        time.sleep(0.1)
    else:
        raise AssertionError(
            f"the page did not reach finished within 90 s; last state {seen[-1]}\nworker:\n{worker.output()}"
        )

    final = seen[-1]
    assert final["state"] == "finished", f"{final}\nworker:\n{worker.output()}"
    assert final["percent"] == 100 and final["width"] == "100%" and final["shown"] == "100%"
    assert final["stage"] == "finished"

    intermediate = [s for s in seen if 0 < s["percent"] < 100]
    assert intermediate, f"no percent strictly between 0 and 100 was shown: {seen}"
    assert len({s["percent"] for s in intermediate}) >= 3, "the bar did not move step by step"
    percents = [s["percent"] for s in seen]
    assert percents == sorted(percents), f"the bar went backwards: {percents}"
    assert any(s["state"] == "running" and "%" in s["stage"] and "step" in s["stage"] for s in intermediate)
    assert screenshot_taken and shot.stat().st_size > 0

    # The page polled with a token for its chain; the JSON view agrees, and only with the token.
    # The token travels in the Authorization header, never in a URL the access log keeps.
    poll_url = page.get_attribute("#chain-progress", "data-url")
    token = page.get_attribute("#chain-progress", "data-token")
    assert poll_url == f"/queue/progress/{key}/" and token
    assert "?token=" not in page.content()
    request = urllib.request.Request(f"{base}{poll_url}", headers={"Authorization": f"Bearer {token}"})
    with urllib.request.urlopen(request, timeout=5) as response:
        assert b'"finished": true' in response.read()
    assert status_of(f"{base}/queue/progress/{key}/") == 401
    # Another browser session, which did not start the chain, gets no page (and no token) for it.
    assert status_of(f"{base}/progress/{key}/") == 404
