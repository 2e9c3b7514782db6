"""The tutorial works as written: its commands run in order in a fresh clone, on SQLite.

The commands are read from docs/tutorial.md's ```console blocks (lines starting with ``$ ``), so
the page and this test cannot drift. Each command's output shown on the page must appear in what
it printed, except lines that hold times, dates or worker ids, and ``...`` lines. Blocks marked
``<!-- illustrative -->`` (``runserver``) are not run.

What differs from a reader's terminal: the clone is made with ``git clone`` of this checkout's
HEAD (commit first); ``python3`` in the venv command is this test's Python (>= 3.12, where the
machine's ``python3`` may be older); ``source .venv/bin/activate`` is applied to the commands
after it. ``pip install -e .`` fetches Django and cronsim from the package index (or pip's cache).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.page_commands import Shell, normal

pytestmark = [pytest.mark.one_django, pytest.mark.example_project]

ROOT = Path(__file__).resolve().parent.parent
TUTORIAL = ROOT / "docs" / "tutorial.md"
ILLUSTRATIVE = "<!-- illustrative -->"
# Output lines that change from run to run.
VARIABLE = re.compile(r"\d\d:\d\d:\d\d|\d{4}-\d\d-\d\d|worker_id=|^\.\.\.$")
# An age in whole seconds (queue_monitor's "oldest waiting"): 0s in the page, 1s on a loaded machine.
AGE = re.compile(r"\b\d+s\b")


def tutorial_commands() -> Iterator[tuple[int, str, list[str]]]:
    """Yield (line, command, expected output lines) for each command of the tutorial."""
    lines = TUTORIAL.read_text().splitlines()
    index = 0
    while index < len(lines):
        if lines[index].strip() not in ("```console", "```bash"):
            index += 1
            continue
        previous = next((line.strip() for line in reversed(lines[:index]) if line.strip()), "")
        index += 1
        block: list[tuple[int, str]] = []
        while lines[index].strip() != "```":
            block.append((index + 1, lines[index]))
            index += 1
        index += 1
        if previous == ILLUSTRATIVE:
            continue
        current: tuple[int, str, list[str]] | None = None
        for number, line in block:
            if line.startswith("$ "):
                if current:
                    yield current
                current = (number, line[2:], [])
            elif current is not None:
                current[2].append(line)
        if current:
            yield current


def test_the_tutorial_commands_run_in_order_in_a_fresh_clone(tmp_path: Path) -> None:
    if shutil.which("git") is None:
        pytest.skip("git is not installed")
    clone = tmp_path / "django-dbqueue"
    subprocess.run(["git", "clone", "--quiet", str(ROOT), str(clone)], check=True)
    env = {
        key: value
        for key, value in os.environ.items()
        if key not in ("DJANGO_SETTINGS_MODULE", "PYTHONPATH", "VIRTUAL_ENV", "DATABASE_URL", "EXAMPLE_SQLITE_PATH")
    }
    env["PYTHONUNBUFFERED"] = "1"
    shell = Shell(clone, env)
    commands = list(tutorial_commands())
    assert len(commands) >= 10, commands
    for line, command, expected in commands:
        output = shell.run(command, f"docs/tutorial.md:{line}")
        if output is None:
            continue
        for wanted in expected:
            if VARIABLE.search(wanted) or not wanted.strip():
                continue
            assert AGE.sub("Ns", normal(wanted)) in AGE.sub("Ns", normal(output)), (
                f"docs/tutorial.md:{line}: `{command}` did not print {wanted!r}; it printed:\n{output}"
            )
