"""The example project's batch page, end to end: a real runserver, a real worker, headless Chromium.

Like tests/test_example_progress.py (whose fixtures this module uses), the example
project runs in subprocesses on a temporary SQLite file; no test database is used.
"""

from __future__ import annotations

import json
import re
import time
import urllib.request
from typing import Any

import pytest

# The chain's page test's helpers and fixtures (example_env, manage, browser_page:
# pytest finds fixtures among a module's names).
from tests.test_example_progress import (  # noqa: F401
    browser_page,
    example_env,
    free_port,
    manage,
    status_of,
    wait_for,
)

pytestmark = [pytest.mark.acceptance, pytest.mark.example_project]

# example_project/demo/jobs.py: IMAGES members, BROKEN_IMAGES of them fail for good.
IMAGES = 40
BROKEN = 2


def test_the_batch_bar_counts_members_to_the_end_and_on_finish_runs_once(manage, browser_page):  # noqa: F811
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
    # The JSON view serves no one without a login or a token, for batches too.
    assert status_of(f"{base}/queue/progress/batch:1/") == 401

    page = browser_page
    page.goto(f"{base}/")
    page.click(f'button:has-text("Process {IMAGES} images")')
    page.wait_for_url("**/progress/batch:*/")
    key = page.url.rstrip("/").rsplit("/", 1)[1]
    assert re.fullmatch(r"batch:\d+", key), key

    def read() -> dict[str, Any]:
        return dict(
            page.evaluate("""() => {
            const box = document.getElementById("batch-progress");
            const number = (name) => Number(box.querySelector("." + name).textContent);
            return {state: box.dataset.state,
                    percent: Number(box.querySelector("[role=progressbar]").getAttribute("aria-valuenow")),
                    ok: box.querySelector(".fill.ok").style.width,
                    bad: box.querySelector(".fill.bad").style.width,
                    stage: box.querySelector(".stage").textContent,
                    shown: box.querySelector(".percent").textContent,
                    succeeded: number("succeeded"), failed: number("failed"),
                    pending: number("pending"), total: number("total")};
        }""")
        )

    # 40 members of about 0.1 s on one worker: some 4 s; allow for a slow machine.
    seen: list[dict[str, Any]] = []
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        state = read()
        seen.append(state)
        if state["state"] in ("finished", "failed", "cancelled", "refused"):
            break
        time.sleep(0.1)
    else:
        raise AssertionError(f"the page did not finish within 90 s; last state {seen[-1]}\nworker:\n{worker.output()}")

    # Finished with failed members: the batch's state is "failed", every member counted.
    final = seen[-1]
    assert final["state"] == "failed", f"{final}\nworker:\n{worker.output()}"
    assert final["percent"] == 100 and final["shown"] == "100%"
    assert final["stage"] == f"finished, {BROKEN} of {IMAGES} failed"
    assert (final["succeeded"], final["failed"], final["pending"], final["total"]) == (
        IMAGES - BROKEN,
        BROKEN,
        0,
        IMAGES,
    )
    assert final["ok"] == f"{100 * (IMAGES - BROKEN) / IMAGES:g}%" and final["bad"] == f"{100 * BROKEN / IMAGES:g}%"

    # The bar moved member by member, and a failed member did not stop it.
    running = [s for s in seen if s["state"] == "running"]
    assert len({s["percent"] for s in running if 0 < s["percent"] < 100}) >= 3, f"the bar did not move: {seen}"
    assert any(s["failed"] >= 1 for s in running), f"no failed member was shown while the batch ran: {seen}"
    assert all(s["stage"] == f"{s['total'] - s['pending']} of {IMAGES} done" for s in running if s["total"])
    percents = [s["percent"] for s in seen]
    assert percents == sorted(percents), f"the bar went backwards: {percents}"

    # on_finish ran once, after the last member, and read the batch's final counts.
    batch_id = key.split(":")[1]
    line = (
        f"album processed album=Lisbon photos batch={batch_id} total={IMAGES} "
        f"succeeded={IMAGES - BROKEN} failed={BROKEN}"
    )
    wait_for(lambda: line in worker.output(), 30, lambda: f"{line!r} not logged:\n{worker.output()}")
    time.sleep(0.5)  # a second run of the callback would be logged by now
    assert worker.output().count("album processed album=") == 1, worker.output()
    assert worker.output().count("job=demo.jobs.process_image ") == IMAGES

    # The page polled with a token for its batch; the JSON view agrees, and only with the token.
    # The token travels in the Authorization header, never in a URL the access log keeps.
    poll_url = page.get_attribute("#batch-progress", "data-url")
    token = page.get_attribute("#batch-progress", "data-token")
    assert poll_url == f"/queue/progress/{key}/" and token
    assert "?token=" not in page.content()
    request = urllib.request.Request(f"{base}{poll_url}", headers={"Authorization": f"Bearer {token}"})
    with urllib.request.urlopen(request, timeout=5) as response:
        data = json.loads(response.read())
    assert data["finished"] is True and data["state"] == "failed"
    assert (data["total"], data["done"], data["failed_members"]) == (IMAGES, IMAGES, BROKEN)
    assert status_of(f"{base}/queue/progress/{key}/") == 401
    # Another browser session, which did not start the batch, gets no page (and no token) for it.
    assert status_of(f"{base}/progress/{key}/") == 404
