"""Jobs of the workflow tests (tests/test_workflows.py): each run leaves a ``Run`` row, so a node
run twice cannot insert."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

from django_dbqueue import JobContext, get_workflow, job

from .models import Run


@job(tries=1)
def node(key: str, value: Any = None, fail: bool = False, results: dict[str, Any] | None = None) -> Any:
    """Record one run under ``key`` (with the results passed, as JSON), then return ``value`` or raise."""
    Run.objects.create(key=key, note=json.dumps(results, sort_keys=True, default=str), pid=os.getpid())
    if fail:
        raise RuntimeError(f"node {key} fails on purpose")
    return value


@job(tries=1)
def add_up(key: str, results: dict[str, Any]) -> int:
    """Sum the parents' results, record the sum."""
    total = sum(value for value in results.values())
    Run.objects.create(key=key, note=str(total), pid=os.getpid())
    return total


def _record(key: str, results: dict[str, Any] | None) -> None:
    Run.objects.create(key=key, note=json.dumps(results, sort_keys=True, default=str), pid=os.getpid())


@job(takes_context=True, tries=5, timeout=2, retry_after=3)
def sturdy(context: JobContext, key: str, value: Any = None, results: dict[str, Any] | None = None) -> Any:
    """``node`` with tries to spare and a short lease: a killed worker's claim comes back within seconds.

    Its run is recorded in a durable step: a worker killed after the job's write committed and before
    its outcome did would otherwise run it again (at-least-once); the step makes the write once."""
    context.step("run", _record, key, results)
    return value


@job(tries=5, timeout=2, retry_after=3)
def slow_node(key: str, marker: str, seconds: float = 0.5) -> str:
    """Touch ``marker``, sleep (a worker may be killed meanwhile), then record one run under ``key``."""
    Path(marker).touch()
    time.sleep(seconds)
    Run.objects.create(key=key, pid=os.getpid())
    return key


@job(tries=1)
def wait_for_workflow(workflow_id: int) -> None:
    """Wait for a workflow without a timeout (refused inside a job: its nodes may need this slot)."""
    get_workflow(workflow_id).wait()
