"""Every ```python block of README.md and docs/**/*.md runs, against the test database.

A block is skipped only when the line before its opening fence is ``<!-- illustrative -->`` (MyST
renders nothing for the comment). The blocks of one file run in order in one namespace, as a
reader would paste them, after the file's setup below (``SETUP``: the names a page takes for
granted, such as an ``order`` or a ``resize`` job). Job functions are registered under the module
name ``docs_snippets.<file>``, so they never clash with the test app's jobs. Then a worker drains
what the blocks enqueued, and every job must have succeeded. A block that defines ``DBQUEUE``
must pass the system checks.
"""

from __future__ import annotations

import re
import sys
import textwrap
import types
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import pytest
from django.test import override_settings

from django_dbqueue import registry, schedules
from django_dbqueue.checks import check_settings
from django_dbqueue.models import FailedJob, Job
from tests.conftest import run_worker

pytestmark = [pytest.mark.one_django, pytest.mark.django_db(transaction=True)]

ROOT = Path(__file__).resolve().parent.parent
ILLUSTRATIVE = "<!-- illustrative -->"
FENCE = re.compile(r"^(?P<indent>\s*)(?P<fence>`{3,}|~{3,})(?P<info>.*)$")

# What each page takes for granted, run before its first block.
COMMON_SETUP = """
import os

from django.urls import include, path

from django_dbqueue import job
from tests.testapp.models import Order

order = Order.objects.create(number="A-1")
pks = [order.pk]


@job
def send_receipt(order_id): ...


@job
def update_crm(order_id): ...


@job
def resize(pk): ...


@job
def watermark(pk): ...


@job
def publish(pk): ...


@job
def notify_owner(pk): ...


@job
def report_broken_photo(pk): ...


@job
def email_owner(album_id): ...


@job
def alert_ops(album_id): ...


@job
def unlock_album(album_id): ...


class Photo:
    pk = 7


photo = Photo()
photo_ids = [1, 2, 3]
"""
SETUP: dict[str, str] = {
    "docs/batches.md": "album = photo",
    "docs/howto/retries.md": (
        "from datetime import timedelta\n"
        "from django.utils import timezone\n"
        "order.pickup_deadline = timezone.now() + timedelta(hours=2)"
    ),
    "docs/pausing.md": "@job(queue='emails')\ndef send_newsletter(issue): ...",
    "docs/observability.md": "from django.urls import include, path",
    "docs/howto/progress.md": (
        "from django_dbqueue import chain\n"
        "def read_rows(url): return [1, 2, 3]\n"
        "pipeline = chain(resize.bind(1), publish.bind(1))\n"
        "pipeline.enqueue()"
    ),
}


def _files() -> list[Path]:
    pages = sorted(path for path in (ROOT / "docs").rglob("*.md") if "_build" not in path.parts)
    return [ROOT / "README.md", *pages]


def python_blocks(path: Path) -> Iterator[tuple[int, str, bool]]:
    """Yield (line, code, illustrative) for each ```python block of a Markdown file."""
    lines = path.read_text().splitlines()
    index = 0
    while index < len(lines):
        match = FENCE.match(lines[index])
        if not match:
            index += 1
            continue
        fence, info, start = match["fence"], match["info"].strip(), index
        previous = next((line.strip() for line in reversed(lines[:start]) if line.strip()), "")
        index += 1
        body = []
        while index < len(lines) and lines[index].strip() != fence:
            body.append(lines[index])
            index += 1
        index += 1
        if info.split(" ")[0] in ("python", "py"):
            yield start + 1, textwrap.dedent("\n".join(body)), previous == ILLUSTRATIVE


def _id(path: Path) -> str:
    return str(path.relative_to(ROOT))


@pytest.fixture
def clean_registry() -> Iterator[None]:
    """Forget the jobs and periodic schedules a page declared once its test is over."""
    jobs, declared = set(registry.all_definitions()), set(schedules.all_schedules())
    yield
    for name in set(registry.all_definitions()) - jobs:
        registry.unregister(name)
    for name in set(schedules.all_schedules()) - declared:
        schedules.unschedule(name)


RUNNABLE = [path for path in _files() if any(not marked for _, _, marked in python_blocks(path))]


@pytest.mark.parametrize("path", RUNNABLE, ids=_id)
def test_the_python_examples_of_the_page_run(path: Path, clean_registry: None, monkeypatch: pytest.MonkeyPatch) -> None:
    name = _id(path)
    module = "docs_snippets." + re.sub(r"\W", "_", name.removesuffix(".md"))
    namespace: dict[str, Any] = {"__name__": module}
    # Pages write "# myproject/scrub.py" above a function and name it "myproject.scrub.scrub" in
    # DBQUEUE: every myproject.<module>.<name> is that page's <name>.
    monkeypatch.setenv("DBQUEUE_METRICS_TOKEN", "docs-example-token-0123456789")  # observability.md
    monkeypatch.setitem(sys.modules, "myproject", _PageModule("myproject", namespace))
    for submodule in ("jobs_middleware", "scrub"):
        monkeypatch.setitem(sys.modules, f"myproject.{submodule}", _PageModule(f"myproject.{submodule}", namespace))
    exec(compile(COMMON_SETUP + SETUP.get(name, ""), f"<setup of {name}>", "exec"), namespace)
    settings = ExitStack()
    with settings:
        ran = _run_blocks(path, name, namespace, settings)
        queues = sorted(set(Job.objects.values_list("queue", flat=True)))
        if queues:
            run_worker(queues)
    assert ran, f"{name}: every block is illustrative; the test should not have been generated for it"
    # A page may cancel a job on purpose; any other failure is the example's fault.
    failed = list(FailedJob.objects.exclude(exception_class__endswith="JobCancelled").values_list("name", "error"))
    assert not failed, f"jobs of {name} failed: {failed}"


def _run_blocks(path: Path, name: str, namespace: dict[str, Any], settings: ExitStack) -> int:
    """Run the page's blocks in order; a block's TASKS setting applies to the blocks after it."""
    ran = 0
    dbqueues: list[tuple[int, Any]] = []
    for line, code, illustrative in python_blocks(path):
        if illustrative:
            continue
        try:
            exec(compile(code, f"{name}:{line}", "exec"), namespace)
        except Exception as exc:
            raise AssertionError(f"the block at {name}:{line} raised {type(exc).__name__}: {exc}") from exc
        ran += 1
        if "DBQUEUE" in namespace:
            dbqueues.append((line, namespace.pop("DBQUEUE")))
        if "TASKS" in namespace:
            settings.enter_context(override_settings(TASKS=namespace.pop("TASKS")))
    # Checked once every block ran: a DBQUEUE may name a function the page defines further down.
    for line, dbqueue in dbqueues:
        with override_settings(DBQUEUE=dbqueue):
            errors = check_settings()
        assert not errors, f"the DBQUEUE of {name}:{line} fails the checks: {errors}"
    return ran


class _PageModule(types.ModuleType):
    """A module whose attributes are the names a page's blocks defined."""

    def __init__(self, name: str, namespace: dict[str, Any]) -> None:
        super().__init__(name)
        self._namespace = namespace

    def __getattr__(self, attribute: str) -> Any:
        try:
            return self._namespace[attribute]
        except KeyError:
            raise AttributeError(attribute) from None


def test_illustrative_blocks_are_few_and_each_says_why() -> None:
    """The marker is for what cannot run here (another project's code, a real server); the text says why."""
    marked = [(_id(path), line) for path in _files() for line, _, illustrative in python_blocks(path) if illustrative]
    assert len(marked) <= 12, f"{len(marked)} illustrative blocks: make some of them run: {marked}"
