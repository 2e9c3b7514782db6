"""Jobs used by the tests; found by autodiscovery like any app's jobs.py."""

import datetime as dt
import os
import queue
import time

from django_dbqueue import JobContext, job

from .models import Attempt, Order, Run


@job
def record(key: str, note: str = "") -> str:
    Run.objects.create(key=key, note=note, pid=os.getpid())
    return key


@job(name="tests.add")
def add(a: int, b: int) -> int:
    return a + b


@job
def echo(*args: object, **kwargs: object) -> None:
    Run.objects.create(key="echo", note=repr((args, kwargs)))


@job(takes_context=True, tries=3)
def fail_once(context: JobContext, key: str) -> None:
    Attempt.objects.create(key=key, attempt=context.attempt)
    if context.attempt == 1:
        raise RuntimeError(f"first attempt of {key} fails")
    Run.objects.create(key=key, pid=os.getpid())


@job(tries=2)
def always_fail(key: str) -> None:
    Attempt.objects.create(key=key, attempt=0)
    raise ValueError(f"{key} always fails")


@job(tries=1, timeout=1, retry_after=30)
def sleep_past_timeout(key: str) -> None:
    Attempt.objects.create(key=key, attempt=0)
    time.sleep(10)
    Run.objects.create(key=key)


@job(tries=1, timeout=1, retry_after=30)
def block_in_c(key: str) -> None:
    Attempt.objects.create(key=key, attempt=0)
    # A C loop that holds the GIL and never checks for signals: SIGALRM cannot stop it.
    sum(range(10**15))
    Run.objects.create(key=key)


@job(takes_context=True, tries=5, retry_after=2, timeout=1)
def slow(context: JobContext, key: str, seconds: float) -> None:
    Attempt.objects.create(key=key, attempt=context.attempt)
    time.sleep(seconds)
    Run.objects.create(key=f"{key}-{context.attempt}", pid=os.getpid())


@job(retry_after=120)
def nap(key: str, seconds: float) -> None:
    """No timeout of its own: under queue_work --timeout 0 it may run as long as it likes."""
    time.sleep(seconds)
    Run.objects.create(key=key, pid=os.getpid())


@job(tries=5, timeout=20, retry_after=30)
def sleep_then_record(key: str, seconds: float) -> None:
    time.sleep(seconds)
    Run.objects.create(key=key, pid=os.getpid())


@job
def record_when_allowed(key: str, timeout: float = 30) -> None:
    """Run until the test creates the Run ``<key>-allow`` (polling), then record ``key``: a
    running job that stays running for as long as the test reads it, however loaded the machine."""
    deadline = time.monotonic() + timeout
    while not Run.objects.filter(key=f"{key}-allow").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    Run.objects.create(key=key, pid=os.getpid())


@job
def touch_order(order: Order) -> None:
    Run.objects.create(key=f"order-{order.pk}", note=order.number)


@job(tries=3)
def raise_system_exit() -> None:
    raise SystemExit(3)


@job(tries=1)
def raise_keyboard_interrupt() -> None:
    raise KeyboardInterrupt


@job(backoff=[5, 60], tries=4)
def fail_with_backoff() -> None:
    raise RuntimeError("try later")


async def _async_body(key: str) -> None:
    from asgiref.sync import sync_to_async

    await sync_to_async(Run.objects.create)(key=key)


@job
async def async_record(key: str) -> None:
    await _async_body(key)


@job(takes_context=True, tries=3, retry_after=3, timeout=2)
def crash_target(context: JobContext, key: str) -> None:
    """Sleeps on its first attempt (long enough to be killed), records on the next."""
    Attempt.objects.create(key=key, attempt=context.attempt)
    if context.attempt == 1:
        time.sleep(1.8)
    Run.objects.create(key=key, pid=os.getpid())


@job
def step(chain_key: str, n: int) -> None:
    Run.objects.create(key=f"{chain_key}-{n}", pid=os.getpid())


@job(tries=1)
def failing_step(chain_key: str, n: int) -> None:
    """Fails until a ``<chain_key>-allow`` run exists."""
    if not Run.objects.filter(key=f"{chain_key}-allow").exists():
        raise RuntimeError(f"step {n} of {chain_key} broke")
    Run.objects.create(key=f"{chain_key}-{n}")


@job(takes_context=True)
def progress_step(context: JobContext, key: str, seconds: float = 0) -> None:
    context.progress(50, "halfway")
    time.sleep(seconds)
    Run.objects.create(key=key)


@job(takes_context=True, tries=1)
def progress_then_fail(context: JobContext, key: str) -> None:
    from django.db import transaction

    with transaction.atomic():
        Run.objects.create(key=key)
        context.progress(30, "working")
        raise ValueError(f"{key} gave up at 30%")


@job(takes_context=True, tries=3, retry_after=3, timeout=2)
def slow_step(context: JobContext, chain_key: str, n: int, seconds: float) -> None:
    Attempt.objects.create(key=f"{chain_key}-{n}", attempt=context.attempt)
    if context.attempt == 1:
        time.sleep(seconds)
    Run.objects.create(key=f"{chain_key}-{n}", pid=os.getpid())


@job(takes_context=True, tries=3, timeout=20, retry_after=30)
def long_running(context: JobContext, key: str, seconds: float, again: float | None = None) -> None:
    """Records each attempt, runs ``seconds`` (``again`` on a later attempt, if given), then
    records the run (unique key).

    The heartbeat tests enqueue it with ``.using(retry_after=2)``: a reservation
    far shorter than the run, while the definition itself passes dbqueue.W002.
    """
    Attempt.objects.create(key=key, attempt=context.attempt)
    time.sleep(seconds if again is None or context.attempt == 1 else again)
    Run.objects.create(key=key, pid=os.getpid())


_leaked: list[bytes] = []


@job
def leak(key: str, megabytes: int) -> None:
    """Keeps ``megabytes`` of memory for the life of its process, as a leaking job would."""
    _leaked.append(b"\x01" * (megabytes * 1024 * 1024))
    Run.objects.create(key=key, pid=os.getpid())


def _session_id() -> int:
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_backend_pid()" if connection.vendor == "postgresql" else "SELECT CONNECTION_ID()")
        return int(cursor.fetchone()[0])


@job(takes_context=True, tries=2, retry_after=30, timeout=20)
def wait_for_session_kill(context: JobContext, key: str, kills: int) -> None:
    """On its first ``kills`` runs, publish its session id and query until the test kills that session."""
    runs = Attempt.objects.filter(key=key).count()
    Attempt.objects.create(key=key, attempt=_session_id() if runs < kills else 0)
    if runs < kills:
        for _ in range(400):
            time.sleep(0.05)
            Run.objects.filter(key="nothing").exists()
        raise AssertionError("the test did not kill this session")
    Run.objects.create(key=key, pid=os.getpid())


@job(tries=2, retry_after=30, timeout=20)
def kill_own_session(key: str) -> None:
    """Ends its own database session, every time."""
    from django.db import connection

    Attempt.objects.create(key=key, attempt=0)
    with connection.cursor() as cursor:
        if connection.vendor == "postgresql":
            cursor.execute("SELECT pg_terminate_backend(pg_backend_pid())")
        else:
            cursor.execute(f"KILL {_session_id()}")


@job(tries=2, retry_after=30, timeout=20)
def refused_query(key: str) -> None:
    """A query the database refuses (a missing table): the job's fault, not the connection's."""
    from django.db import connection

    Attempt.objects.create(key=key, attempt=0)
    with connection.cursor() as cursor:
        cursor.execute("SELECT * FROM dbqueue_no_such_table")


@job(takes_context=True, tries=3, retry_after=6, timeout=4)
def partition_step(context: JobContext, key: str, seconds: float) -> None:
    """Records that it started, then computes for ``seconds`` without touching the database."""
    Attempt.objects.create(key=f"{key}-start", attempt=context.attempt)
    time.sleep(seconds)


@job(takes_context=True)
def report_progress(context: JobContext, key: str) -> None:
    context.progress(50, "half way")
    Run.objects.create(key=key, pid=os.getpid())


# -- snooze, retry_until and middleware (tests/test_lifecycle.py) ---------------


@job(takes_context=True, tries=2, retry_after=30, timeout=20)
def snooze_then_record(context: JobContext, key: str, times: int, seconds: float) -> None:
    """Snoozes on its first ``times`` runs (through the context, then by raising), then records."""
    from django_dbqueue import Snooze

    Attempt.objects.create(key=key, attempt=context.attempt)
    if context.attempt <= times:
        try:
            if context.attempt % 2:
                context.snooze(seconds)
            raise Snooze(seconds)
        except Exception:  # noqa: BLE001 - a job's broad except must not swallow a snooze
            Run.objects.create(key=f"{key}-swallowed")
    Run.objects.create(key=key, note=f"given_back={context.given_back} last={context.is_last_attempt}")


@job(takes_context=True, tries=1)
def snooze_for(context: JobContext, key: str, seconds: object) -> None:
    Attempt.objects.create(key=key, attempt=context.attempt)
    context.snooze(seconds)


from collections.abc import Callable  # noqa: E402 - kept with the jobs that use it
from typing import Any  # noqa: E402

MIDDLEWARE_CALLS: list[str] = []


def _recording(label: str) -> Callable[[JobContext, Callable[[], Any]], Any]:
    def middleware(context: JobContext, call_next: Callable[[], Any]) -> Any:
        MIDDLEWARE_CALLS.append(f"{label}:before:{context.name.rsplit('.', 1)[-1]}:{context.attempt}")
        result = call_next()
        MIDDLEWARE_CALLS.append(f"{label}:after:{result}")
        return result

    return middleware


outer_middleware = _recording("outer")
inner_middleware = _recording("inner")
job_middleware = _recording("job")


@job(middleware=["tests.testapp.jobs.job_middleware"])
def wrapped(key: str) -> str:
    MIDDLEWARE_CALLS.append("run")
    return key


def failing_middleware(context: JobContext, call_next: Callable[[], Any]) -> Any:
    Attempt.objects.create(key=f"mw-{context.job_id}", attempt=context.attempt)
    raise RuntimeError("the middleware broke")


@job(tries=2, retry_after=30, timeout=20, middleware=[failing_middleware])
def behind_failing_middleware(key: str) -> None:
    Run.objects.create(key=key)


@job(tries=1, middleware=["tests.testapp.no_such_module.middleware"])
def behind_missing_middleware(key: str) -> None:
    Run.objects.create(key=key)


def sleeping_middleware(context: JobContext, call_next: Callable[[], Any]) -> Any:
    """Waits 10 s before the job, stopping when asked to (at the job's timeout)."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        context.check_cancelled()
        time.sleep(0.02)
    return call_next()


@job(tries=1, timeout=1, retry_after=30, middleware=[sleeping_middleware])
def behind_sleeping_middleware(key: str) -> None:
    Run.objects.create(key=key)


@job
def log_line(key: str) -> None:
    import logging

    logging.getLogger("tests.jobs").warning("inside key=%s", key)


# -- handles, results and cancel (tests/test_handles.py) ------------------------------


@job(results=True)
def keep_result(x: int) -> dict[str, object]:
    return {"x": x, "when": dt.datetime(2030, 1, 2, 3, 4, 5, tzinfo=dt.UTC)}


@job(results=True, takes_context=True, tries=3)
def keep_after_one_failure(context: JobContext, key: str) -> str:
    if context.attempt == 1:
        raise ValueError(f"{key}: first attempt fails")
    return f"{key} done"


@job(results=True)
def keep_a_set() -> set[int]:
    return {1, 2}


@job(takes_context=True, tries=3, timeout=60, retry_after=90)
def report_until_cancelled(context: JobContext, key: str) -> None:
    """Reports progress every 0.1 s for up to 30 s; a cancel request stops it at the next report."""
    Attempt.objects.create(key=key, attempt=context.attempt)
    for i in range(300):
        context.progress(i / 3, "working")
        time.sleep(0.1)
    Run.objects.create(key=key)


@job(tries=3, timeout=60, retry_after=90)
def ignore_cancel(key: str, seconds: float) -> None:
    """Never checks for a cancel request: only a hard cancel stops it."""
    Attempt.objects.create(key=key, attempt=0)
    time.sleep(seconds)
    Run.objects.create(key=key)


@job(takes_context=True, tries=10, max_exceptions=2)
def snooze_then_raise(context: JobContext, key: str) -> None:
    """Snoozes on odd attempts and raises on even ones: only the exceptions count."""
    Attempt.objects.create(key=key, attempt=context.attempt)
    if context.attempt % 2:
        context.snooze(0)
    raise RuntimeError(f"{key}: attempt {context.attempt} fails")


# -- jobs that wait (queue_work --threads / --async-concurrency) -------------------


@job(retry_after=60, tries=3)
def wait_and_record(key: str, seconds: float) -> None:
    """Waits like a network call, then records its run (thread, pid) in the database."""
    import threading

    time.sleep(seconds)
    Run.objects.create(key=key, pid=os.getpid(), note=threading.current_thread().name)


@job(retry_after=60, tries=3)
async def async_wait_and_record(key: str, seconds: float) -> None:
    """Awaits like an HTTP call, then records its run through Django's async ORM API."""
    import asyncio

    await asyncio.sleep(seconds)
    await Run.objects.acreate(key=key, pid=os.getpid(), note="loop")


@job(tries=1, timeout=1, retry_after=30)
async def async_past_timeout(key: str) -> None:
    import asyncio

    await Attempt.objects.acreate(key=key, attempt=0)
    await asyncio.sleep(10)
    await Run.objects.acreate(key=key)


@job(tries=1, timeout=1, retry_after=30)
async def async_block_loop(key: str) -> None:
    """Blocks the event loop (a sync sleep in an async job): no await can cancel it."""
    await Attempt.objects.acreate(key=key, attempt=0)
    time.sleep(30)
    await Run.objects.acreate(key=key)


@job(takes_context=True, tries=1, timeout=1, retry_after=30)
def busy_past_timeout(context: JobContext, key: str) -> None:
    """Python code past its timeout that looks whether it was asked to stop: it stops
    there, and its process goes on."""
    Attempt.objects.create(key=key, attempt=0)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        context.check_cancelled()
    Run.objects.create(key=key)


@job(takes_context=True, retry_after=60)
async def async_progress(context: JobContext, key: str) -> None:
    """Reports progress from the event loop (the write goes through a thread)."""
    import asyncio

    context.progress(40, "halfway")
    await asyncio.sleep(0.05)
    await Run.objects.acreate(key=key, note="loop")


# -- test_threads jobs


def _wait_interruptibly(context: JobContext, seconds: float) -> None:
    """Wait in short sleeps, looking between them whether the job was asked to stop (a
    timeout, a hard cancel, a forced stop): it stops there, within 20 ms."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        context.check_cancelled()
        time.sleep(0.02)


@job(takes_context=True, tries=3, timeout=30, retry_after=60)
def attempt_and_wait(context: JobContext, key: str, seconds: float, again: float | None = None) -> None:
    """Records each attempt as it starts, waits ``seconds`` (``again`` on later attempts)
    stopping when asked to, then records its run with the attempt it was."""
    import threading

    Attempt.objects.create(key=key, attempt=context.attempt)
    _wait_interruptibly(context, seconds if again is None or context.attempt == 1 else again)
    Run.objects.create(
        key=key,
        pid=os.getpid(),
        note=f"attempt={context.attempt} given_back={context.given_back} thread={threading.current_thread().name}",
    )


@job(takes_context=True, tries=3, timeout=60, retry_after=90)
def attempt_and_sleep(context: JobContext, key: str, seconds: float) -> None:
    """Like ``attempt_and_wait`` in one ``time.sleep``, never looking whether it was asked
    to stop: a timeout or a hard cancel ends its process."""
    Attempt.objects.create(key=key, attempt=context.attempt)
    time.sleep(seconds)
    Run.objects.create(key=key, pid=os.getpid())


_shared_state: dict[str, int] = {}


@job(tries=1)
def thread_unsafe(key: str) -> None:
    """Leaves a transaction open on its thread's connection, then mutates state shared by
    every thread while iterating over it, which raises RuntimeError."""
    from django.db import transaction

    transaction.atomic().__enter__()
    Attempt.objects.create(key=key, attempt=0)
    _shared_state[key] = 0
    for name in _shared_state:
        _shared_state[f"{name}+"] = 1


@job(takes_context=True)
def progress_and_record(context: JobContext, key: str) -> None:
    """Reports progress, then records what another connection reads of it."""
    from django_dbqueue import get_progress

    context.progress(40, "working")
    seen = get_progress(str(context.job_id))
    Run.objects.create(key=key, note=f"{seen['percent']:g} {seen['stage']}" if seen else "none")


_arrivals: dict[str, int] = {}


import threading as _threading  # noqa: E402 - kept with the jobs that use it

_ARRIVAL_LOCK = _threading.Lock()


@job(tries=1, timeout=30, retry_after=60)
def all_at_once(group: str, key: str, total: int) -> None:
    """Arrives, waits (20 s at most) until ``total`` jobs of ``group`` run at once in this
    process, then records its run with its thread's name."""
    with _ARRIVAL_LOCK:
        _arrivals[group] = _arrivals.get(group, 0) + 1
    deadline = time.monotonic() + 20
    while _arrivals[group] < total:
        if time.monotonic() > deadline:
            raise TimeoutError(f"only {_arrivals[group]} of {total} jobs of {group} ran at once")
        time.sleep(0.02)
    Run.objects.create(key=key, pid=os.getpid(), note=_threading.current_thread().name)


@job(tries=1, timeout=30, retry_after=60)
async def async_all_at_once(group: str, key: str, total: int) -> None:
    """``all_at_once`` on the event loop: awaits until ``total`` jobs of ``group`` are in flight."""
    import asyncio

    _arrivals[group] = _arrivals.get(group, 0) + 1
    deadline = time.monotonic() + 20
    while _arrivals[group] < total:
        if time.monotonic() > deadline:
            raise TimeoutError(f"only {_arrivals[group]} of {total} jobs of {group} were in flight at once")
        await asyncio.sleep(0.02)
    await Run.objects.acreate(key=key, pid=os.getpid(), note=_threading.current_thread().name)


@job(tries=3, timeout=60, retry_after=90)
async def async_attempt_and_wait(key: str, seconds: float) -> None:
    """Records that it started, awaits ``seconds``, then records its run."""
    import asyncio

    await Attempt.objects.acreate(key=key, attempt=0)
    await asyncio.sleep(seconds)
    await Run.objects.acreate(key=key, pid=os.getpid(), note="loop")


@job
def record_tick(tick: dt.datetime, schedule: str = "") -> None:
    """Run by the periodic schedules of the tests: one row per tick, so a tick run twice cannot insert."""
    Run.objects.create(key=f"tick:{schedule}:{tick.isoformat()}", pid=os.getpid())


# -- batches ---------------------------------------------------------------------


@job(takes_context=True, tries=1)
def member(context: JobContext, key: str, fail: bool = False, seconds: float = 0) -> None:
    """A batch member: records one Run per success (the unique key proves it ran once)."""
    if seconds:
        time.sleep(seconds)
    if fail:
        raise RuntimeError(f"member {key} fails on purpose")
    Run.objects.create(key=key, note=str(context.batch_id), pid=os.getpid())


@job(takes_context=True, tries=1)
def batch_callback(context: JobContext, key: str) -> None:
    """A batch callback: records which batch it ran for (exactly once: the unique key)."""
    Run.objects.create(key=key, note=str(context.batch_id), pid=os.getpid())


@job(takes_context=True, tries=1)
def add_members(context: JobContext, key: str, count: int) -> None:
    """A member that adds ``count`` members to its own batch."""
    assert context.batch is not None
    context.batch.add(*(member.bind(f"{key}-{i}") for i in range(count)))
    Run.objects.create(key=key, note=str(context.batch_id), pid=os.getpid())


@job(takes_context=True, tries=1)
def until_batch_cancelled(context: JobContext, key: str, seconds: float) -> None:
    """A member that stops early once its batch is cancelled; records whether it saw it."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        batch = context.batch
        if batch is not None and batch.is_cancelled:
            Run.objects.create(key=key, note="saw cancel", pid=os.getpid())
            return
        time.sleep(0.05)
    Run.objects.create(key=key, note="ran out", pid=os.getpid())


@job(takes_context=True, tries=3, timeout=2, retry_after=3)
def counted_member(context: JobContext, key: str, seconds: float = 0) -> None:
    """A batch member that may run more than once (a worker killed under it): one Attempt per run."""
    Attempt.objects.create(key=key, attempt=context.attempt)
    if seconds:
        time.sleep(seconds)


# -- test_hard_cancel jobs: a hard cancel or a timeout must never leave the next job a broken
# connection or a held lock


# Module-level, like the pools urllib3 keeps: a stop that lands inside put() or get() could
# leave its mutex held for every later job of the process.
_shared_queue: queue.LifoQueue[int] = queue.LifoQueue()


@job(tries=3, timeout=60, retry_after=90)
def select_forever(key: str) -> None:
    """Loops on ``SELECT 1`` on its thread's connection and never checks for a cancel."""
    from django.db import connection

    Attempt.objects.create(key=key, attempt=0)
    with connection.cursor() as cursor:
        while True:
            cursor.execute("SELECT 1")
            cursor.fetchone()


@job(tries=3, timeout=60, retry_after=90)
def hold_queue_forever(key: str) -> None:
    """Puts and gets on the shared queue without end, so its mutex is held most of the time."""
    Attempt.objects.create(key=key, attempt=0)
    while True:
        _shared_queue.put(1)
        _shared_queue.get()


@job(takes_context=True, tries=1, retry_after=60)
def use_what_a_stop_may_break(context: JobContext, key: str) -> None:
    """Uses the shared queue and the thread's connection, then records its run and whether
    it was given back before (a broken connection gives a job back)."""
    from django.db import connection

    if not _shared_queue.mutex.acquire(timeout=5):
        raise RuntimeError("the shared queue's mutex was left held")
    _shared_queue.mutex.release()
    _shared_queue.put(1)
    _shared_queue.get()
    with connection.cursor() as cursor:
        cursor.execute("SELECT 1")
        cursor.fetchone()
    Run.objects.create(key=key, note=f"given_back={context.given_back}", pid=os.getpid())


@job(tries=1)
def wait_for_job(job_id: int, timeout: float | None = None) -> None:
    """Waits inside a job for another job (``JobHandle.wait``), and records what it saw."""
    from django_dbqueue import get_job

    handle = get_job(job_id).wait(timeout)
    Run.objects.create(key=f"waited-{job_id}", note=str(handle.status), pid=os.getpid())


@job(tries=1, takes_context=True)
def wait_for_itself(context: JobContext) -> None:
    from django_dbqueue import get_job

    get_job(context.job_id).wait(5)


from .workflow_jobs import add_up, node, slow_node, sturdy  # noqa: E402, F401  (registered with the others)
