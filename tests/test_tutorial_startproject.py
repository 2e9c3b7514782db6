"""The startproject tutorial works as written: from an empty directory, its commands build the wheel
of a fresh clone, install it into a fresh venv, start a project and follow every step, on SQLite.

Everything comes from docs/tutorial-project.md, in the page's order, so the page and this test
cannot drift:

- each ```console block's ``$ `` lines are commands, run with ``bash -c`` in the project
  directory; the lines after a command are its output as the page shows it, and each must appear
  in what it printed, with the parts that change from run to run (dates, times, process and
  worker ids, durations, the wheel's version) matched by pattern, and ``...`` lines left out.
  Blocks marked ``<!-- illustrative -->`` (``runserver``) are not run;
- each ``{code-block}`` with a ``:caption:`` naming a file is what the reader writes there: the
  whole file, or, with ``, at the end`` after the name, lines added at its end.

What differs from a reader's terminal: ``/path/to/django-dbqueue`` is a ``git clone`` of this
checkout's HEAD (commit first); ``python3`` in the venv command is this test's Python (>= 3.12,
where the machine's ``python3`` may be older); ``source .venv/bin/activate`` is applied to the
commands after it; ``PIP_CONSTRAINT`` pins what pip installs (the build backend, Django, cronsim)
to the versions the suite runs with, as scripts/test and scripts/check_release do. pip fetches
them from the package index (or its cache).
"""

from __future__ import annotations

import dataclasses
import os
import re
import shlex
import shutil
import subprocess
from pathlib import Path

import django
import pytest

from tests.page_commands import Shell, normal

pytestmark = [pytest.mark.one_django, pytest.mark.example_project]

ROOT = Path(__file__).resolve().parent.parent
PAGE = ROOT / "docs" / "tutorial-project.md"
CHECKOUT = "/path/to/django-dbqueue"
ILLUSTRATIVE = "<!-- illustrative -->"
# The parts of an output line that change from run to run, each matched by its own pattern.
VARIABLE = {
    "date": r"\d{4}-\d\d-\d\d",
    "time": r"\d\d:\d\d(?::\d\d(?:,\d+)?)?",
    "process": r"\[\d+\]",  # the process id in the worker's log lines
    "worker": r"worker_id=\S+",
    "duration": r"\b\d+(?:\.\d+)?m?s\b",  # 0s, 0.004s, 12.5ms
    "wheel": r"django_dbqueue-[\w.]+-py3-none-any\.whl",
}
ANY_VARIABLE = re.compile("|".join(f"(?P<{name}>{pattern})" for name, pattern in VARIABLE.items()))


@dataclasses.dataclass
class Command:
    line: int
    text: str
    output: list[str]


@dataclasses.dataclass
class File:
    line: int
    path: str
    append: bool
    content: str


def steps(page: Path = PAGE) -> list[Command | File]:
    """The page's commands and files, in its order."""
    lines = page.read_text().splitlines()
    found: list[Command | File] = []
    index = 0
    while index < len(lines):
        opening = lines[index].strip()
        if opening not in ("```console", "```{code-block} python"):
            index += 1
            continue
        previous = next((line.strip() for line in reversed(lines[:index]) if line.strip()), "")
        start = index + 1
        index += 1
        body: list[str] = []
        while lines[index].strip() != "```":
            body.append(lines[index])
            index += 1
        index += 1
        if opening == "```console":
            if previous != ILLUSTRATIVE:
                found.extend(_commands(start, body))
            continue
        options = {}
        while body and (option := re.match(r"^:(\w+):\s*(.*)$", body[0])):
            options[option[1]] = option[2]
            body.pop(0)
        caption = options.get("caption", "")
        path, _, where = caption.partition(", ")
        assert path and where in ("", "at the end"), (
            f"{page.name}:{start}: a code block's caption names a file, then ', at the end' or nothing"
        )
        found.append(File(start, path, where == "at the end", "\n".join(body).strip("\n") + "\n"))
    return found


def _commands(start: int, body: list[str]) -> list[Command]:
    commands: list[Command] = []
    for offset, line in enumerate(body, start + 1):
        if line.startswith("$ "):
            commands.append(Command(offset, line[2:], []))
        elif commands:
            commands[-1].output.append(line)
    return commands


def output_pattern(line: str) -> re.Pattern[str]:
    """A pattern for an output line as the page shows it: its variable parts match any such part."""
    text, parts, position = normal(line), [], 0
    for match in ANY_VARIABLE.finditer(text):
        parts += [re.escape(text[position : match.start()]), VARIABLE[str(match.lastgroup)]]
        position = match.end()
    parts.append(re.escape(text[position:]))
    return re.compile("".join(parts))


def test_output_patterns_match_what_changes_and_nothing_else() -> None:
    shown = "2026-12-02 07:10:00,000 INFO [4242] job=shop.jobs.send_receipt id=1 attempt=1 duration=0.004s"
    printed = "2027-01-31 23:59:59,999 INFO [17] job=shop.jobs.send_receipt id=1 attempt=1 duration=12.5ms"
    assert output_pattern(shown).search(printed)
    assert not output_pattern(shown).search(printed.replace("id=1", "id=2"))
    assert output_pattern("Successfully built django_dbqueue-0.1.0-py3-none-any.whl").search(
        "Successfully built django_dbqueue-1.2.3-py3-none-any.whl"
    )


def _constraints() -> Path:
    """The pins scripts/test installs with: this Django's series if it pins this version, else dev.txt."""
    series = ROOT / "constraints" / f"django-{django.VERSION[0]}.{django.VERSION[1]}.txt"
    if series.exists() and f"Django=={django.__version__}" in series.read_text().splitlines():
        return series
    return ROOT / "constraints" / "dev.txt"


def test_the_startproject_tutorial_runs_as_written(tmp_path: Path) -> None:
    if shutil.which("git") is None:
        pytest.skip("git is not installed")
    checkout = tmp_path / "django-dbqueue"
    subprocess.run(["git", "clone", "--quiet", str(ROOT), str(checkout)], check=True)
    project = tmp_path / "project"
    project.mkdir()
    env = {
        key: value
        for key, value in os.environ.items()
        if key not in ("DJANGO_SETTINGS_MODULE", "PYTHONPATH", "VIRTUAL_ENV", "DATABASE_URL", "EXAMPLE_SQLITE_PATH")
        and not key.startswith("DBQUEUE_")
    }
    env.update(PYTHONUNBUFFERED="1", PIP_DISABLE_PIP_VERSION_CHECK="1", PIP_CONSTRAINT=str(_constraints()))

    found = steps()
    commands = [step for step in found if isinstance(step, Command)]
    assert len(commands) >= 15 and len(found) - len(commands) >= 5, found
    assert any(CHECKOUT in command.text for command in commands), f"no command of the page uses {CHECKOUT}"
    shell = Shell(project, env)
    for step in found:
        if isinstance(step, File):
            target = project / step.path
            assert target.parent.is_dir(), f"{PAGE.name}:{step.line}: {step.path}: no such directory (yet)"
            if step.append:
                with target.open("a") as file:
                    file.write("\n" + step.content)
            else:
                target.write_text(step.content)
            continue
        command = step.text.replace(CHECKOUT, shlex.quote(str(checkout)))
        output = shell.run(command, f"{PAGE.name}:{step.line}")
        if output is None:
            continue
        for wanted in step.output:
            if not wanted.strip() or wanted.strip() == "...":
                continue
            assert output_pattern(wanted).search(normal(output)), (
                f"{PAGE.name}:{step.line}: `{step.text}` did not print {wanted!r}; it printed:\n{output}"
            )
    # The wheel was installed, not the checkout: the project imports the package from its venv.
    imported = subprocess.run(
        [str(project / ".venv" / "bin" / "python"), "-c", "import django_dbqueue; print(django_dbqueue.__file__)"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    assert Path(imported).is_relative_to(project / ".venv"), imported
