"""The example project's settings: its published SECRET_KEY and DEBUG come from the environment,
and the published key is refused once DEBUG is off."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT

pytestmark = pytest.mark.example_project

MANAGE = ROOT / "example_project" / "manage.py"
A_KEY = "k" * 60


def check(tmp_path: Path, **environ: str) -> subprocess.CompletedProcess[str]:
    """``manage.py check`` of the example project with ``environ`` over a clean environment."""
    env = {key: value for key, value in os.environ.items() if not key.startswith(("DJANGO_", "DATABASE_URL"))}
    env.update(EXAMPLE_SQLITE_PATH=str(tmp_path / "example.sqlite3"), **environ)
    return subprocess.run(
        [sys.executable, str(MANAGE), "check"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120
    )


def test_the_published_secret_key_is_refused_once_debug_is_off(tmp_path):
    result = check(tmp_path, DJANGO_DEBUG="0")
    assert result.returncode == 1 and "demo.E001" in result.stderr and "DJANGO_SECRET_KEY" in result.stderr


def test_a_key_from_the_environment_passes_with_debug_off(tmp_path):
    result = check(tmp_path, DJANGO_DEBUG="0", DJANGO_SECRET_KEY=A_KEY, DJANGO_ALLOWED_HOSTS="queue.example.com")
    assert result.returncode == 0, result.stderr


def test_the_laptop_defaults_pass_with_debug_on(tmp_path):
    result = check(tmp_path)
    assert result.returncode == 0 and "demo.E001" not in result.stderr, result.stderr


def test_the_example_projects_own_tests_pass_with_the_testing_helpers(tmp_path):
    """``manage.py test demo``: the project's tests use django_dbqueue.testing (run_jobs, assertions)."""
    env = {key: value for key, value in os.environ.items() if not key.startswith(("DJANGO_", "DATABASE_URL"))}
    env.update(EXAMPLE_SQLITE_PATH=str(tmp_path / "example.sqlite3"), DJANGO_SECRET_KEY=A_KEY)
    result = subprocess.run(
        [sys.executable, str(MANAGE), "test", "demo", "--noinput"],
        cwd=ROOT / "example_project",
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "\nOK" in result.stderr and "Ran 0 tests" not in result.stderr, result.stderr
