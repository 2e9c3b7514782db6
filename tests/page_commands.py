"""Running a docs page's console commands as a reader types them (the tutorials' tests)."""

from __future__ import annotations

import shlex
import subprocess
import sys
from pathlib import Path


class Shell:
    """One reader's terminal: ``python3`` is this test's Python (>= 3.12, where the machine's
    ``python3`` may be older), and a ``source ...`` line applies to every command after it."""

    def __init__(self, cwd: Path, env: dict[str, str]) -> None:
        self.cwd = cwd
        self.env = env
        self.prefix = ""

    def run(self, command: str, where: str) -> str | None:
        """Run ``command`` (shown at ``where``, ``page:line``) and return what it printed; None for
        a ``source`` line. A command that exits non-zero fails the test with its output."""
        if command.startswith("python3 "):
            command = shlex.quote(sys.executable) + command[len("python3") :]
        if command.startswith("source "):
            self.prefix = command + " && "
            return None
        result = subprocess.run(
            ["bash", "-c", self.prefix + command],
            cwd=self.cwd,
            env=self.env,
            capture_output=True,
            text=True,
            timeout=180,
        )
        output = result.stdout + result.stderr
        assert result.returncode == 0, f"{where}: `{command}` exited {result.returncode}:\n{output}"
        return output


def normal(text: str) -> str:
    """``text`` with every run of whitespace as one space (a terminal's wrapping is not the page's)."""
    return " ".join(text.split())
