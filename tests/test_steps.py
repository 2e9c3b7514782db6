"""Durable steps inside a job (``context.step``, django_dbqueue/steps.py): each runs once and its
result is stored with its database writes; a retried or reclaimed job resumes at the first step
that did not finish.

The jobs are defined here and registered for each test only; the worker processes of the
acceptance tests import this module through ``LAUNCH`` and run ``queue_work`` as the command line does.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import os
import signal
import sys
import time
from collections.abc import Iterator
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest
from django.core.checks import Error
from django.db import connection
from django.test import override_settings
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from django_dbqueue import JobContext, chain, job, registry, steps
from django_dbqueue.checks import check_settings
from django_dbqueue.db import alias
from django_dbqueue.models import FailedJob, Job, JobStep
from django_dbqueue.testing import run_jobs
from tests.conftest import run_worker, wait_until
from tests.testapp import jobs as testapp_jobs
from tests.testapp.models import Attempt, Order

# Values the in-process jobs saw, by key: what a skipped step returned.
SEEN: dict[str, list[Any]] = {}


def _write(key: str, name: str) -> str:
    """A step's database write: one Attempt row per run of the step."""
    Attempt.objects.create(key=f"{key}:{name}", attempt=0)
    return f"{name} done"


def _ran(key: str) -> dict[str, int]:
    """How many times each step of ``key`` ran (committed)."""
    counts: dict[str, int] = {}
    for row in Attempt.objects.filter(key__startswith=f"{key}:").values_list("key", flat=True):
        name = row.split(":", 1)[1]
        counts[name] = counts.get(name, 0) + 1
    return counts


# -- the jobs ----------------------------------------------------------------------


@job(takes_context=True, tries=3)
def three_steps(context: JobContext, key: str) -> list[str]:
    """Three steps; the third raises on the job's first attempt."""

    def third() -> str:
        Attempt.objects.create(key=f"{key}:three", attempt=context.attempt)
        if context.attempt == 1:
            raise RuntimeError("the third step fails on the first try")
        return "three done"

    return [
        context.step("one", _write, key, "one"),
        context.step("two", _write, key, "two"),
        context.step("three", third),
    ]


@job(takes_context=True, tries=3, timeout=20, retry_after=30)
def pause_after_two(context: JobContext, key: str) -> None:
    """Two steps, then (first attempt) a wait long enough to be killed in, then the third step."""
    context.step("one", _write, key, "one")
    context.step("two", _write, key, "two")
    if context.attempt == 1:
        time.sleep(15)
    context.step("three", _write, key, "three")


@job(takes_context=True, tries=3, timeout=20, retry_after=30)
def pause_inside_two(context: JobContext, key: str, marker: str) -> None:
    """Step two writes, then (first attempt) touches ``marker`` and waits to be killed before it returns."""

    def two() -> str:
        Attempt.objects.create(key=f"{key}:two", attempt=context.attempt)
        if context.attempt == 1:
            Path(marker).touch()
            time.sleep(15)
        return "two done"

    context.step("one", _write, key, "one")
    context.step("two", two)
    context.step("three", _write, key, "three")


def _values(key: str) -> tuple[dt.date, Decimal, Order]:
    Attempt.objects.create(key=f"{key}:values", attempt=0)
    return dt.date(2024, 2, 29), Decimal("12.30"), Order.objects.get(number=key)


@job(takes_context=True, tries=2)
def typed_result(context: JobContext, key: str) -> None:
    """A step returning a date, a Decimal and a model instance; the job fails after it on its first try."""
    SEEN.setdefault(key, []).append(context.step("values", _values, key))
    if context.attempt == 1:
        raise RuntimeError("run again")


@job(takes_context=True, tries=1)
def same_name_twice(context: JobContext, key: str) -> None:
    context.step("charge", _write, key, "first")
    context.step("charge", _write, key, "second")


def _flaky(key: str, attempt: int) -> int:
    Attempt.objects.create(key=f"{key}:flaky", attempt=attempt)
    if attempt < 2:
        raise RuntimeError(f"attempt {attempt} fails")
    return attempt


@job(takes_context=True, tries=1)
def retry_in_run(context: JobContext, key: str) -> int:
    """Calls a step again after it raised, in the same run."""
    for attempt in range(3):
        try:
            return context.step("flaky", _flaky, key, attempt)
        except RuntimeError:
            continue
    raise AssertionError("unreachable")


@job(takes_context=True, tries=1)
def nested(context: JobContext, key: str) -> None:
    context.step("outer", lambda: context.step("inner", _write, key, "inner"))


@job(takes_context=True, tries=1)
def unstorable(context: JobContext, key: str) -> None:
    context.step("bad", lambda: {1, 2})


def _order_without_annotation(key: str):  # type: ignore[no-untyped-def]
    return Order.objects.get(number=key)


@job(takes_context=True, tries=1)
def undeclared_model(context: JobContext, key: str) -> None:
    context.step("order", _order_without_annotation, key)


@job(takes_context=True, tries=1)
def fail_at_two(context: JobContext, key: str) -> None:
    context.step("one", _write, key, "one")
    context.step("two", lambda: 1 / 0)


@job(takes_context=True)
def one_step(context: JobContext, key: str) -> str:
    return context.step("one", _write, key, "one")


async def _awrite(key: str, name: str) -> str:
    await Attempt.objects.acreate(key=f"{key}:{name}", attempt=0)
    return f"{name} done"


@job(takes_context=True, tries=3)
async def async_steps(context: JobContext, key: str) -> list[Any]:
    """Async steps (the second a plain function); the job fails after them on its first try."""
    first = await context.astep("one", _awrite, key, "one")
    second = await context.astep("two", _write, key, "two")
    if context.attempt == 1:
        raise RuntimeError("run again")
    return [first, second, await context.astep("three", _awrite, key, "three")]


@job(takes_context=True, tries=3)
async def parallel_async_steps(context: JobContext, key: str) -> None:
    """Two async steps at once (asyncio.gather), then a failure on the first try."""
    await asyncio.gather(context.astep("a", _awrite, key, "a"), context.astep("b", _awrite, key, "b"))
    if context.attempt == 1:
        raise RuntimeError("run again")
    await _awrite(key, "end")


@job(takes_context=True)
def chain_position(context: JobContext, key: str) -> None:
    Attempt.objects.create(key=f"{key}:{context.chain_step}/{context.chain_steps}", attempt=context.attempt)


DEFINITIONS = [
    three_steps,
    pause_after_two,
    pause_inside_two,
    typed_result,
    same_name_twice,
    retry_in_run,
    nested,
    unstorable,
    undeclared_model,
    fail_at_two,
    one_step,
    async_steps,
    parallel_async_steps,
    chain_position,
]
# Registered for each test only (``_step_jobs``), so the other tests' registry is left as it was.
for _definition in DEFINITIONS:
    registry.unregister(_definition.name)

# The worker processes: queue_work with this module's jobs registered.
LAUNCH = (
    "import sys, django; django.setup()\n"
    "from django_dbqueue import registry\n"
    "from tests import test_steps\n"
    "for definition in test_steps.DEFINITIONS: registry.register(definition)\n"
    "from django.core.management import execute_from_command_line\n"
    "execute_from_command_line(['manage.py', *sys.argv[sys.argv.index('queue_work'):]])\n"
)


@pytest.fixture(autouse=True)
def _step_jobs() -> Iterator[None]:
    for definition in DEFINITIONS:
        registry.register(definition)
    SEEN.clear()
    yield
    for definition in DEFINITIONS:
        registry.unregister(definition.name)


def _stored(job_id: int) -> list[str]:
    return sorted(JobStep.objects.filter(job_id=job_id).values_list("name", flat=True))


# -- in this process -----------------------------------------------------------------


@pytest.mark.django_db
def test_a_retried_job_skips_the_steps_that_succeeded_and_resumes_at_the_one_that_failed() -> None:
    handle = three_steps.enqueue("r")
    ran = run_jobs()
    assert [run.outcome for run in ran] == ["released", "succeeded"]
    assert "the third step fails" in ran[0].error
    # The first two ran once; the third's first write was rolled back with it.
    assert _ran("r") == {"one": 1, "two": 1, "three": 1}
    assert list(Attempt.objects.filter(key="r:three").values_list("attempt", flat=True)) == [2]
    # A skipped step returns its stored result.
    assert ran[1].result == ["one done", "two done", "three done"]
    assert not Job.objects.filter(pk=handle.id).exists()


@pytest.mark.django_db
def test_a_skipped_step_returns_its_stored_date_decimal_and_model_instance() -> None:
    order = Order.objects.create(number="t")
    typed_result.enqueue("t")
    ran = run_jobs()
    assert [run.outcome for run in ran] == ["released", "succeeded"]
    first, second = SEEN["t"]
    assert _ran("t") == {"values": 1}
    assert second == (dt.date(2024, 2, 29), Decimal("12.30"), order)
    assert isinstance(second[1], Decimal) and str(second[1]) == "12.30"
    assert isinstance(second[2], Order) and second[2].number == "t"
    assert first == second


@pytest.mark.django_db
def test_a_result_that_cannot_be_stored_fails_the_job_with_a_type_error_naming_the_step() -> None:
    unstorable.enqueue("u")
    run_jobs()
    failed = FailedJob.objects.get()
    assert failed.exception_class == "builtins.TypeError"
    assert "the result of step 'bad' is of type set" in failed.error


@pytest.mark.django_db
def test_a_model_instance_the_step_function_does_not_declare_is_refused_with_a_hint() -> None:
    Order.objects.create(number="m")
    undeclared_model.enqueue("m")
    run_jobs()
    failed = FailedJob.objects.get()
    assert "the result of step 'order' holds a testapp.order instance" in failed.error
    assert "annotate the step function's return" in failed.error
    assert not JobStep.objects.exists()


@pytest.mark.django_db
def test_a_second_step_of_the_same_name_in_one_run_is_refused() -> None:
    same_name_twice.enqueue("d")
    run_jobs()
    failed = FailedJob.objects.get()
    assert failed.exception_class == "builtins.ValueError"
    assert "step 'charge' was already run in this run of the job" in failed.error
    assert _ran("d") == {"first": 1}


@pytest.mark.django_db
def test_a_step_that_raised_may_be_called_again_in_the_same_run_and_its_failed_writes_are_gone() -> None:
    retry_in_run.enqueue("again")
    ran = run_jobs()
    ran.assert_succeeded()
    assert ran[0].result == 2
    assert list(Attempt.objects.filter(key="again:flaky").values_list("attempt", flat=True)) == [2]


@pytest.mark.django_db
def test_a_step_inside_a_step_is_refused_and_the_outer_steps_writes_roll_back() -> None:
    nested.enqueue("n")
    run_jobs()
    failed = FailedJob.objects.get()
    assert "step 'inner' was started inside step 'outer': steps do not nest" in failed.error
    assert _ran("n") == {}
    assert not JobStep.objects.exists()


@pytest.mark.django_db
def test_step_names_must_be_1_to_200_characters() -> None:
    runner = steps.Steps()
    with pytest.raises(ValueError, match="1 to 200 characters"):
        runner.run(1, "", _write, ("k", "x"), {})
    with pytest.raises(ValueError, match="1 to 200 characters"):
        runner.run(1, "x" * 201, _write, ("k", "x"), {})
    with pytest.raises(TypeError, match="must be a str"):
        runner.run(1, 7, _write, ("k", "x"), {})  # type: ignore[arg-type]
    assert not runner.used


@pytest.mark.django_db
def test_the_step_rows_of_a_job_that_succeeds_are_deleted_with_it() -> None:
    handle = three_steps.enqueue("s")
    with CaptureQueriesContext(connection) as queries:
        run_jobs()
    assert not Job.objects.filter(pk=handle.id).exists()
    assert _stored(handle.id) == []
    # Read once per run (two runs), whatever the number of steps.
    reads = [
        q["sql"] for q in queries.captured_queries if q["sql"].startswith("SELECT") and "dbqueue_job_step" in q["sql"]
    ]
    assert len(reads) == 2, reads


@pytest.mark.django_db
def test_the_step_rows_of_a_job_that_fails_for_good_are_kept_for_its_retry() -> None:
    handle = fail_at_two.enqueue("f")
    run_jobs()
    failed = FailedJob.objects.get()
    assert failed.job_id == handle.id and "ZeroDivisionError" in failed.error
    assert _stored(handle.id) == ["one"]
    assert JobStep.objects.get(job_id=handle.id).result == '"one done"'


@pytest.mark.django_db
def test_a_job_that_uses_no_steps_sends_no_query_about_steps() -> None:
    testapp_jobs.add.enqueue(1, 2)
    with CaptureQueriesContext(connection) as queries:
        ran = run_jobs()
    ran.assert_succeeded()
    assert not [q["sql"] for q in queries.captured_queries if "dbqueue_job_step" in q["sql"]]


@pytest.mark.django_db
def test_async_steps_resume_after_a_retry_and_a_plain_function_runs_as_a_step_in_them() -> None:
    async_steps.enqueue("a")
    ran = run_jobs()
    assert [run.outcome for run in ran] == ["released", "succeeded"]
    assert ran[1].result == ["one done", "two done", "three done"]
    assert _ran("a") == {"one": 1, "two": 1, "three": 1}


@pytest.mark.django_db(transaction=True)
def test_async_steps_run_at_once_on_the_workers_loop_and_resume_after_a_retry() -> None:
    handle = parallel_async_steps.enqueue("g")
    run_worker(async_concurrency=4)
    assert not Job.objects.exists() and not FailedJob.objects.exists()
    assert _ran("g") == {"a": 1, "b": 1, "end": 1}
    assert _stored(handle.id) == []


@pytest.mark.django_db
def test_move_gives_the_steps_of_old_job_ids_to_new_ones() -> None:
    now = timezone.now()
    for job_id, name in ((1, "a"), (1, "b"), (2, "a"), (3, "a")):
        JobStep.objects.create(job_id=job_id, name=name, finished_at=now)
    assert steps.move(alias(), [(1, 11), (2, 12)]) == 3
    assert sorted(JobStep.objects.values_list("job_id", "name")) == [(3, "a"), (11, "a"), (11, "b"), (12, "a")]
    assert steps.move(alias(), []) == 0


@pytest.mark.django_db
def test_prune_deletes_old_steps_of_jobs_gone_and_keeps_those_of_queued_and_failed_jobs() -> None:
    queued, now = one_step.enqueue("p"), timezone.now()
    failed = FailedJob.objects.create(
        job_id=987654, queue="default", name="x", payload="{}", attempts=1, created_at=now, failed_at=now
    )
    long_ago, recently = now - dt.timedelta(hours=200), now - dt.timedelta(hours=1)
    for job_id, finished_at in ((queued.id, long_ago), (failed.job_id, long_ago), (555, long_ago), (556, recently)):
        JobStep.objects.create(job_id=job_id, name="one", finished_at=finished_at)
    assert steps.prune(168) == 1
    assert sorted(JobStep.objects.values_list("job_id", flat=True)) == sorted([queued.id, failed.job_id, 556])


def test_step_max_age_is_checked() -> None:
    with override_settings(DBQUEUE={"STEP_MAX_AGE": 0}):
        errors = [e for e in check_settings(None) if isinstance(e, Error)]
    assert any("STEP_MAX_AGE" in e.msg for e in errors), errors
    with override_settings(DBQUEUE={"STEP_MAX_AGE": None}):
        assert not [e for e in check_settings(None) if "STEP_MAX_AGE" in e.msg]


@pytest.mark.django_db
def test_a_chain_job_reads_its_position_as_chain_step_and_chain_steps() -> None:
    chain(chain_position.bind("c"), chain_position.bind("c")).enqueue()
    run_jobs().assert_succeeded()
    assert sorted(Attempt.objects.values_list("key", flat=True)) == ["c:1/2", "c:2/2"]


# -- real worker processes, kill -9 ------------------------------------------------------


def _worker(worker_process: Any) -> Any:
    return worker_process("--sleep", "0.05", prefix=[sys.executable, "-c", LAUNCH])


@pytest.mark.acceptance
@pytest.mark.django_db(transaction=True)
def test_a_job_killed_between_its_second_and_third_step_resumes_at_the_third(worker_process: Any) -> None:
    handle = pause_after_two.using(retry_after=2).enqueue("k")
    first = _worker(worker_process)
    wait_until(lambda: _stored(handle.id) == ["one", "two"], 30, f"step two never finished:\n{first.output()}")
    first.signal(signal.SIGKILL)
    first.wait(timeout=10)
    assert _ran("k") == {"one": 1, "two": 1}

    second = _worker(worker_process)
    wait_until(lambda: not Job.objects.filter(pk=handle.id).exists(), 30, f"never resumed:\n{second.output()}")
    second.signal(signal.SIGTERM)
    assert second.wait(timeout=30) == 0, second.output()
    assert _ran("k") == {"one": 1, "two": 1, "three": 1}
    assert not FailedJob.objects.exists()
    assert _stored(handle.id) == []


@pytest.mark.acceptance
@pytest.mark.django_db(transaction=True)
def test_a_step_killed_after_its_write_and_before_it_returns_leaves_no_write_and_runs_again_once(
    worker_process: Any, tmp_path: Path
) -> None:
    marker = tmp_path / "inside-two"
    handle = pause_inside_two.using(retry_after=2).enqueue("w", str(marker))
    first = _worker(worker_process)
    wait_until(marker.exists, 30, f"step two never started:\n{first.output()}")
    first.signal(signal.SIGKILL)
    first.wait(timeout=10)
    # The write of the step that did not return was rolled back with it.
    wait_until(lambda: _ran("w") == {"one": 1}, 10, f"step two's write is there: {_ran('w')}")
    assert _stored(handle.id) == ["one"]

    second = _worker(worker_process)
    wait_until(lambda: not Job.objects.filter(pk=handle.id).exists(), 30, f"never resumed:\n{second.output()}")
    second.signal(signal.SIGTERM)
    assert second.wait(timeout=30) == 0, second.output()
    assert _ran("w") == {"one": 1, "two": 1, "three": 1}
    assert list(Attempt.objects.filter(key="w:two").values_list("attempt", flat=True)) == [2]
    assert os.path.exists(marker)
