"""queue_work --autoscale MIN,MAX: the decision (unit, no database), the pool's threads that
follow it (no database), the command's options, and a real worker process under a step load."""

from __future__ import annotations

import argparse
import os
import re
import signal
import threading
import time

import pytest
from django.core.management import call_command, load_command_class
from django.core.management.base import CommandError

from django_dbqueue import enqueue_many, pool
from django_dbqueue.autoscale import GROW_INTERVAL, IDLE_SECONDS, Autoscaler, Bounds, Resize
from django_dbqueue.execution import Defaults, Outcome
from django_dbqueue.management.options import whole_number_range
from django_dbqueue.models import FailedJob, Job, QueueWorker
from django_dbqueue.worker import MAX_THREADS
from tests.conftest import wait_until
from tests.testapp import jobs
from tests.testapp.models import Run

SLOTS_CHANGED = re.compile(r"slots changed worker_id=\S+ from=(\d+) to=(\d+) busy=(\d+) reason=(\w+)")


def grown(scaler: Autoscaler, now: float, busy: int | None = None) -> Resize | None:
    """A claim that got all it asked for, every slot busy (or ``busy``), then a look at ``now``."""
    scaler.claimed(4, 4)
    return scaler.decide(scaler.slots if busy is None else busy, now)


# -- the decision ----------------------------------------------------------------------------


def test_it_starts_at_min_and_doubles_while_every_slot_is_busy_and_claims_come_back_full():
    scaler = Autoscaler(Bounds(2, 16), now=0.0)
    assert scaler.slots == 2
    assert grown(scaler, 1.0) == Resize(2, 4, "backlog")
    assert grown(scaler, 2.0) == Resize(4, 8, "backlog")
    assert grown(scaler, 3.0) == Resize(8, 16, "backlog")
    assert scaler.slots == 16


def test_it_grows_at_most_once_per_interval_and_never_past_max():
    scaler = Autoscaler(Bounds(3, 10), now=0.0)
    assert grown(scaler, GROW_INTERVAL / 2) is None, "too soon after the start"
    assert grown(scaler, GROW_INTERVAL) == Resize(3, 6, "backlog")
    assert grown(scaler, GROW_INTERVAL * 1.5) is None, "too soon after the last growth"
    assert grown(scaler, GROW_INTERVAL * 2) == Resize(6, 10, "backlog")
    assert grown(scaler, GROW_INTERVAL * 10) is None
    assert scaler.slots == 10


def test_it_does_not_grow_when_claims_come_back_short_or_slots_are_free():
    scaler = Autoscaler(Bounds(2, 16), now=0.0)
    scaler.claimed(4, 3)  # the queue ran out: the slots it has are enough
    assert scaler.decide(2, 5.0) is None
    scaler.claimed(0, 0)
    assert scaler.decide(2, 6.0) is None
    assert grown(scaler, 7.0, busy=1) is None, "a slot is free"
    assert scaler.slots == 2


def test_a_growth_needs_a_full_claim_after_it():
    scaler = Autoscaler(Bounds(1, 8), now=0.0)
    assert grown(scaler, 1.0) == Resize(1, 2, "backlog")
    # No claim since: the slots added have not shown they are wanted.
    assert scaler.decide(2, 5.0) is None


def grown_to_16_and_full(scaler: Autoscaler) -> None:
    """2 -> 16 at t=1, 2, 3; at t=3.5 the claims fill the 16 slots."""
    for now in (1.0, 2.0, 3.0):
        grown(scaler, now)
    scaler.claimed(12, 12)
    assert scaler.decide(16, 3.5) is None and scaler.slots == 16


def test_it_shrinks_only_at_a_window_end_to_the_most_jobs_held_in_the_window():
    scaler = Autoscaler(Bounds(2, 16, idle=30.0), now=0.0)
    grown_to_16_and_full(scaler)
    # The load falls to 5 jobs held at once from t=4; the window from t=3 held 16.
    for now in range(4, 63):
        scaler.claimed(11, 0)
        assert scaler.decide(5, float(now)) is None, now
    # The window from t=33 held 5 at most.
    scaler.claimed(11, 0)
    assert scaler.decide(5, 63.0) == Resize(16, 5, "idle")
    # Idle from t=64, but the next window began with 5 held at t=63.
    for now in range(64, 123):
        scaler.claimed(5, 0)
        assert scaler.decide(0, float(now)) is None, now
    assert scaler.decide(0, 123.0) == Resize(5, 2, "idle")


def test_it_never_shrinks_below_min():
    scaler = Autoscaler(Bounds(3, 12, idle=5.0), now=0.0)
    grown(scaler, 1.0)
    assert scaler.slots == 6
    for now in range(2, 30):
        scaler.claimed(6, 0)
        scaler.decide(0, float(now))
    assert scaler.slots == 3
    assert scaler.decide(0, 100.0) is None


def test_a_level_held_between_two_looks_counts_as_held_until_the_second():
    # 16 long jobs ran for a minute with no claim (no slot was free): the look after them
    # must not read the minute as idle.
    scaler = Autoscaler(Bounds(2, 16, idle=30.0), now=0.0)
    grown_to_16_and_full(scaler)
    scaler.claimed(1, 0)
    assert scaler.decide(15, 63.5) is None
    assert scaler.slots == 16


def test_an_alternating_load_does_not_make_the_slots_flap():
    # Bursts every 10 s that fill 16 slots for 2 s, idle between: shorter pauses than the
    # window, so the slots grow once and stay.
    scaler = Autoscaler(Bounds(2, 16, idle=30.0), now=0.0)
    changes = []
    now = 0.0
    while now < 300.0:
        burst = now % 10.0 < 2.0
        scaler.claimed(4, 4 if burst else 0)
        change = scaler.decide(scaler.slots if burst else 0, now)
        if change is not None:
            changes.append(change)
        now += 0.25
    assert [change.reason for change in changes] == ["backlog"] * 3
    assert scaler.slots == 16


@pytest.mark.parametrize(
    ("minimum", "maximum", "idle"), [(0, 4, 30.0), (5, 4, 30.0), (2, 4, 0.0), (2, 4, float("nan"))]
)
def test_bounds_refuse_a_range_that_cannot_be(minimum, maximum, idle):
    with pytest.raises(ValueError):
        Bounds(minimum, maximum, idle=idle)


def test_bounds_read_as_the_option_is_written():
    assert str(Bounds(2, 16)) == "2,16" and Bounds(2, 16).idle == IDLE_SECONDS


# -- the pool's threads ----------------------------------------------------------------------


class Scripted:
    """An autoscaler that answers each look with the next of ``changes`` (None: no change)."""

    def __init__(self, *changes: Resize | None) -> None:
        self.changes = list(changes)

    def claimed(self, asked: int, got: int) -> None:
        pass

    def decide(self, busy: int, now: float) -> Resize | None:
        return self.changes.pop(0) if self.changes else None


def live_job_threads(workers: pool.Pool) -> int:
    return sum(thread.thread.is_alive() for thread in workers._pool_threads)


def test_the_pool_adds_threads_at_once_and_ends_threads_only_between_jobs(monkeypatch):
    release = threading.Event()
    running: list[int] = []

    def execute(self: pool._Thread, run: pool.Run) -> Outcome:
        running.append(run.job.pk)
        release.wait(10)
        return Outcome("succeeded", 0.0)

    monkeypatch.setattr(pool._Thread, "execute", execute)
    workers = pool.Pool(
        threads=1,
        async_slots=0,
        defaults=Defaults(tries=1, timeout=None, backoff=0),
        worker_id="t",
        cancel_level=lambda job: 0,
        wake=lambda: None,
        autoscale=Bounds(1, 4),
    )
    assert workers.capacity == 1
    workers._scaler = Scripted(Resize(1, 4, "backlog"), Resize(4, 1, "idle"))  # type: ignore[assignment]
    with workers:
        workers.claimed(4, 4)
        workers.submit([Job(pk=pk, name="held", attempts=1) for pk in range(1, 5)])
        assert workers.capacity == 4
        wait_until(lambda: len(running) == 4, 5, f"not 4 jobs at once: {running}")
        workers.claimed(4, 0)
        assert workers.capacity == 1
        time.sleep(0.2)
        assert live_job_threads(workers) == 4, "a thread ended while its job ran"
        release.set()
        wait_until(lambda: live_job_threads(workers) == 1, 5, "the threads too many did not end")
        assert sorted((job.pk, outcome and outcome.status) for job, outcome in workers.collect()) == [
            (pk, "succeeded") for pk in range(1, 5)
        ]


# -- the command -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("0,4", "'0,4': each number must be at least 1"),
        ("5,x", "'5,x' is not two whole numbers MIN,MAX such as 2,16"),
        ("3", "'3' is not two whole numbers MIN,MAX"),
        ("1,2,3", "'1,2,3' is not two whole numbers MIN,MAX"),
        ("4,2000", f"'4,2000': each number must be at most {MAX_THREADS}"),
        ("2.5,4", "is not two whole numbers"),
    ],
)
def test_a_bad_autoscale_is_refused_with_a_clear_message(value, message):
    with pytest.raises(CommandError, match=re.escape(message)):
        call_command("queue_work", "--autoscale", value)


def test_autoscale_takes_the_range_in_either_order():
    parse = whole_number_range(1, MAX_THREADS)
    assert parse("2,16") == parse("16,2") == parse(" 16, 2") == (2, 16)
    assert parse("3,3") == (3, 3)
    with pytest.raises(argparse.ArgumentTypeError):
        parse("2,")
    parser = load_command_class("django_dbqueue", "queue_work").create_parser("manage.py", "queue_work")
    assert parser.parse_args(["--autoscale", "10,3"]).autoscale == (3, 10)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--autoscale", "2,8", "--threads", "4"], "--autoscale and --threads cannot be combined"),
        (["--autoscale", "2,8", "--threads", "1"], "--autoscale and --threads cannot be combined"),
        (["--autoscale-idle", "5"], "--autoscale-idle needs --autoscale MIN,MAX"),
        (["--autoscale", "2,8", "--autoscale-idle", "0.5"], "'0.5' must be at least 1"),
    ],
)
def test_autoscale_refuses_options_it_cannot_go_with(args, message):
    with pytest.raises(CommandError, match=re.escape(message)):
        call_command("queue_work", *args)


def test_help_shows_the_idle_default():
    parser = load_command_class("django_dbqueue", "queue_work").create_parser("manage.py", "queue_work")
    text = " ".join(parser.format_help().split())
    assert "--autoscale MIN,MAX" in text and f"(default: {IDLE_SECONDS:g})" in text


# -- a real worker under a step load ---------------------------------------------------------


def os_threads(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/task"))


def slot_changes(output: str) -> list[tuple[int, int, int, str]]:
    return [(int(a), int(b), int(busy), reason) for a, b, busy, reason in SLOTS_CHANGED.findall(output)]


def row_options() -> str:
    row = QueueWorker.objects.first()
    return row.options if row is not None else ""


@pytest.mark.acceptance
@pytest.mark.one_django
@pytest.mark.django_db(transaction=True)
def test_a_step_load_grows_the_threads_to_max_in_seconds_and_an_idle_window_takes_them_back(worker_process):
    total, nap = 300, 0.2
    process = worker_process(
        "--autoscale", "2,16", "--autoscale-idle", "3", "--sleep", "0.1", env={"DBQUEUE_TEST_WORKER_BEAT": "0.5"}
    )
    process.wait_for_output("worker started")
    assert "autoscale=2,16 threads=2 async=0" in process.output()
    wait_until(lambda: "autoscale=2,16 threads=2" in row_options(), 10, f"row: {row_options()!r}")
    enqueue_many(jobs.wait_and_record.bind(f"s-{i}", nap) for i in range(total))
    loaded = time.monotonic()
    # Doubling once a second: 2 -> 4 -> 8 -> 16 in about 3 s (10 s allowed: a loaded CI machine).
    wait_until(lambda: any(to == 16 for _, to, _, _ in slot_changes(process.output())), 10, process.output())
    wait_until(lambda: "threads=16" in row_options(), 5, f"the worker's row: {row_options()!r}")
    wait_until(lambda: Run.objects.count() == total, 30, f"the queue was not drained:\n{process.output()}")
    drained_in = time.monotonic() - loaded
    busy_threads = os_threads(process.pid)

    assert [(before, after, reason) for before, after, _, reason in slot_changes(process.output())] == [
        (2, 4, "backlog"),
        (4, 8, "backlog"),
        (8, 16, "backlog"),
    ]
    # 60 s of naps: 2 threads would take 30 s; 16 take 4 s once grown (a loaded machine, more).
    assert drained_in < total * nap / 2 * 0.75, (drained_in, process.output())
    assert len(set(Run.objects.values_list("note", flat=True))) == 16, "16 threads ran jobs"

    # Idle for a window of --autoscale-idle seconds: back to 2 (in two steps if the end of the
    # load fell on a window's end), the 14 threads ended.
    wait_until(lambda: slot_changes(process.output())[-1][1] == 2, 15, f"no shrink:\n{process.output()}")
    shrinks = slot_changes(process.output())[3:]
    assert 1 <= len(shrinks) <= 2 and {reason for _, _, _, reason in shrinks} == {"idle"}, process.output()
    assert shrinks[0][0] == 16 and shrinks[-1][1:] == (2, 0, "idle"), process.output()
    wait_until(lambda: os_threads(process.pid) <= busy_threads - 14, 10, "the threads too many did not end")
    wait_until(lambda: "threads=2" in row_options(), 5, f"the worker's row: {row_options()!r}")

    process.signal(signal.SIGTERM)
    assert process.wait(timeout=30) == 0, process.output()
    # Run.key is unique: a second run of any job would have failed to insert.
    assert Run.objects.count() == total
    assert set(Run.objects.values_list("key", flat=True)) == {f"s-{i}" for i in range(total)}
    assert not Job.objects.exists() and not FailedJob.objects.exists()
