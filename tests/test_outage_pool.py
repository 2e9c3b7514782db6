"""A pooled worker rides out a database outage as a one-job worker does (issue 26, point 4).

Three ``queue_work --threads 8 --stop-when-empty`` processes drain jobs that carry a
timeout (so each pool arms its last resort, faulthandler's watchdog, for every run)
while their database is away for 90 s, longer than a run's timeout, grace and the
last resort's slack together. Every worker must be alive when the database returns,
record the outcomes it could not record during the outage, and drain the rest; every
job must run, and none twice (the jobs' ``retry_after`` is longer than the outage:
see docs/explanation/guarantees.md for one that is shorter).

The workers reach the database through a forwarder of their own that the test turns
into a server that is down (connections closed, connects refused): the real server
keeps serving the other tests. Runs are counted in a file, not in the database
(tests/testapp/outage_jobs.py).
"""

from __future__ import annotations

import collections
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from types import ModuleType

import pytest
from django.db import OperationalError, connection

from django_dbqueue import enqueue_many, workers
from django_dbqueue.conf import get as setting
from django_dbqueue.db import DbNow
from django_dbqueue.execution import Defaults, Outcome
from django_dbqueue.models import FailedJob, Job, QueueWorker
from django_dbqueue.pool import LAST_RESORT_SLACK, Pool, Run
from django_dbqueue.worker import EXIT_TIMED_OUT, Worker, WorkerOptions
from tests.conftest import ROOT, registered, wait_until
from tests.network import Forwarder
from tests.testapp import jobs

OUTAGE = 90.0
JOBS = 1500
WORKERS = 3
THREADS = 8
# Each run sleeps this long: a drain of several seconds, so runs are in flight when the outage begins.
RUN_SECONDS = 0.1


def runs(path: Path) -> collections.Counter[int]:
    """How many times each job ran, by its number."""
    if not path.exists():
        return collections.Counter()
    return collections.Counter(int(line) for line in path.read_text().split())


@pytest.mark.acceptance
@pytest.mark.skipif("connection.vendor == 'sqlite'", reason="SQLite has no server that can go away")
@pytest.mark.skipif(
    not os.environ.get("DBQUEUE_TEST_HEAVY"),
    reason="a 90 s outage: runs once per database, with Django 6.1 (scripts/test sets DBQUEUE_TEST_HEAVY)",
)
@pytest.mark.django_db(transaction=True)
def test_pooled_workers_ride_out_a_90_s_outage_and_run_every_job_once(worker_process, outage_jobs, tmp_path):
    definition = outage_jobs.drain_step
    assert definition.timeout is not None and definition.retry_after is not None
    # The outage crosses the last resort's window of every run in flight when it begins.
    assert OUTAGE > definition.timeout + float(setting("TIMEOUT_GRACE")) + LAST_RESORT_SLACK
    assert OUTAGE < definition.retry_after
    path = tmp_path / "runs"
    enqueue_many((definition.bind(n, RUN_SECONDS) for n in range(JOBS)), handles=False)
    settings = connection.settings_dict
    forwarder = Forwarder((settings["HOST"], int(settings["PORT"])))
    try:
        host, port = ("PGHOST", "PGPORT") if connection.vendor == "postgresql" else ("MYSQL_HOST", "MYSQL_PORT")
        env = {
            host: "127.0.0.1",
            port: str(forwarder.port),
            "DBQUEUE_TEST_OUTAGE_JOBS": "1",
            "DBQUEUE_TEST_RUNS_FILE": str(path),
        }
        args = ("--queue", outage_jobs.OUTAGE_QUEUE, "--threads", str(THREADS), "--stop-when-empty", "--sleep", "0.2")
        workers = [worker_process(*args, env=env) for _ in range(WORKERS)]
        for worker in workers:
            worker.wait_for_output("worker started")
        wait_until(lambda: sum(runs(path).values()) >= JOBS // 5, 60, "the drain did not get going")

        forwarder.refuse()
        down_at = time.monotonic()
        ran_before = sum(runs(path).values())
        while time.monotonic() < down_at + OUTAGE:
            time.sleep(1)
            dead = [worker.output()[-3000:] for worker in workers if worker.process.poll() is not None]
            assert not dead, f"a worker ended during the outage:\n{dead[0]}"
        ran_during = sum(runs(path).values()) - ran_before
        forwarder.accept()

        for worker in workers:
            assert worker.wait(timeout=120) == 0, worker.output()[-5000:]
    finally:
        forwarder.close()

    outputs = [worker.output() for worker in workers]
    for output in outputs:
        assert "reason=empty" in output, output[-3000:]
        assert "Timeout (" not in output, output[-5000:]
    assert any("connection_lost=True" in output for output in outputs), "the outage was not noticed"
    # Runs were in flight when the database went away: they ended during the outage, and
    # their outcomes waited for its return.
    assert ran_during > 0, "no run ended during the outage"
    counted = runs(path)
    assert set(counted) == set(range(JOBS)), f"{JOBS - len(counted)} jobs never ran"
    twice = {n: count for n, count in counted.items() if count > 1}
    assert not twice, f"{len(twice)} jobs ran more than once: {sorted(twice)[:20]}"
    assert not Job.objects.exists()
    assert not FailedJob.objects.exists()


# A pool whose one run reached its hard stop as it was armed, with a slack of 2 s; then
# the main thread either waits with the interpreter free (as for the database: a
# socket read, a reconnect's sleep) or is blocked by C code that holds the GIL.
LAST_RESORT_SCRIPT = textwrap.dedent(
    """
    import sys, time
    import django
    django.setup()
    from django_dbqueue import pool
    from django_dbqueue.execution import Defaults
    from django_dbqueue.models import Job

    pool.LAST_RESORT_SLACK = 2.0
    workers = pool.Pool(
        threads=1, async_slots=0, defaults=Defaults(tries=1, timeout=1, backoff=0), worker_id="t",
        cancel_level=lambda job: 0, wake=lambda: None,
    )
    run = pool.Run(Job(pk=1, name="stuck", attempts=1), on_loop=False)
    run.hard_at = time.monotonic()
    workers.runs[1] = run
    workers._arm_last_resort()
    if sys.argv[1] == "wait":
        time.sleep(7)
    else:
        sum(range(10**13))
    workers._disarm_last_resort()
    print("still running", flush=True)
    """
)


def run_last_resort_script(mode: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "DJANGO_SETTINGS_MODULE": "tests.settings", "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [sys.executable, "-c", LAST_RESORT_SCRIPT, mode], env=env, cwd=ROOT, capture_output=True, text=True, timeout=60
    )


def test_the_last_resort_spares_a_worker_that_waits_with_the_interpreter_free():
    waited = run_last_resort_script("wait")
    assert waited.returncode == 0, waited.stderr[-3000:]
    assert "still running" in waited.stdout


def test_the_last_resort_ends_a_process_whose_interpreter_is_blocked_past_a_hard_stop():
    blocked = run_last_resort_script("block")
    assert blocked.returncode == 1, (blocked.stdout, blocked.stderr[-3000:])
    assert "Timeout (" in blocked.stderr and "still running" not in blocked.stdout


@pytest.mark.skipif("connection.vendor == 'sqlite'", reason="SQLite has no connection to lose")
@pytest.mark.django_db(transaction=True)
def test_a_worker_that_lost_its_connection_takes_no_silent_worker_for_dead_until_it_could_beat_again(monkeypatch):
    pk = jobs.record.enqueue("held-elsewhere").id
    workers.register("elsewhere", ["default"])
    # Its row went unrefreshed for longer than dead_after() (the database was away), while
    # its reservation has not expired.
    Job.objects.filter(pk=pk).update(reserved_at=DbNow(), reserved_by="elsewhere", attempts=1)
    QueueWorker.objects.filter(worker_id="elsewhere").update(
        last_seen_at=DbNow() - timedelta(seconds=2 * workers.dead_after())
    )
    workers.forget_reclaim()
    worker = Worker(WorkerOptions(queues=["default"], defaults=Defaults(tries=3, timeout=30, backoff=0)))
    monkeypatch.setattr(worker, "wait", lambda *args, **kwargs: False)
    try:
        # What the worker's claim met as the database went away (2013: MySQL's lost connection;
        # a driver error without an SQLSTATE on PostgreSQL).
        lost = OperationalError("lost connection to the server")
        lost.__cause__ = Exception(2013, "Lost connection to server during query")
        worker.outages.trouble(lost, "reserve", 0)
    finally:
        os.close(worker._wake_r)
        os.close(worker._wake_w)

    assert workers.reclaim_dead() == 0
    assert Job.objects.filter(pk=pk, reserved_by="elsewhere").exists()
    # Had it not lost its connection, the row would be dead and its job reclaimed.
    workers.forget_reclaim()
    assert workers.reclaim_dead() == 1
    assert Job.objects.filter(pk=pk, reserved_at__isnull=True).exists()


def test_a_run_whose_outcome_waits_to_be_collected_is_not_stuck():
    # The worker collects outcomes between its database calls: after an outage, the runs
    # that ended meanwhile are past their hard stop by the time it collects them.
    pool = Pool(
        threads=1,
        async_slots=0,
        defaults=Defaults(tries=1, timeout=1, backoff=0),
        worker_id="t",
        cancel_level=lambda job: 0,
        wake=lambda: None,
    )
    run = Run(Job(pk=1, name="ended", attempts=1), on_loop=False)
    run.soft_at = run.hard_at = time.monotonic() - 1
    pool.runs[1] = run
    outcome = Outcome("succeeded", 0.1)
    pool._finished(run, outcome)
    try:
        stuck, _ = pool.check_deadlines()
    finally:
        pool._disarm_last_resort()
    assert stuck is None
    assert pool.collect() == [(run.job, outcome)]


def outage_env(forwarder: Forwarder) -> dict[str, str]:
    host, port = ("PGHOST", "PGPORT") if connection.vendor == "postgresql" else ("MYSQL_HOST", "MYSQL_PORT")
    return {host: "127.0.0.1", port: str(forwarder.port), "DBQUEUE_TEST_OUTAGE_JOBS": "1"}


@pytest.mark.acceptance
@pytest.mark.skipif("connection.vendor == 'sqlite'", reason="SQLite has no server that can go away")
@pytest.mark.django_db(transaction=True)
def test_a_job_that_runs_past_its_timeout_during_an_outage_is_stopped_and_its_worker_lives(
    worker_process, outage_jobs, tmp_path
):
    definition = outage_jobs.steps_until_stopped
    assert definition.timeout is not None
    outage = definition.timeout + float(setting("TIMEOUT_GRACE")) + LAST_RESORT_SLACK + 5
    settings = connection.settings_dict
    forwarder = Forwarder((settings["HOST"], int(settings["PORT"])))
    try:
        env = {**outage_env(forwarder), "DBQUEUE_TEST_RUNS_FILE": str(tmp_path / "runs")}
        worker = worker_process("--queue", outage_jobs.OUTAGE_QUEUE, "--threads", "2", "--sleep", "0.2", env=env)
        worker.wait_for_output("worker started")
        pk = definition.enqueue().id
        # It ends a second into the outage: its outcome waits for the database, and so does
        # the worker's main thread, which asks jobs past their timeout to stop meanwhile.
        other = outage_jobs.drain_step.enqueue(0, 1.5).id
        wait_until(
            lambda: Job.objects.filter(pk__in=[pk, other], reserved_at__isnull=False).count() == 2,
            30,
            "the jobs were not claimed",
        )
        time.sleep(0.3)
        # The database goes away while the job runs, before its timeout.
        forwarder.refuse()
        time.sleep(outage)
        assert worker.process.poll() is None, worker.output()[-5000:]
        forwarder.accept()
        wait_until(
            lambda: FailedJob.objects.filter(job_id=pk).exists(),
            30,
            f"the timeout was not recorded:\n{worker.output()[-5000:]}",
        )
        time.sleep(1)
        assert worker.process.poll() is None, f"exited {worker.process.returncode} ({EXIT_TIMED_OUT}: timed out)"
        worker.signal(signal.SIGTERM)
        assert worker.wait(timeout=30) == 0, worker.output()[-5000:]
    finally:
        forwarder.close()
    failed = FailedJob.objects.get(job_id=pk)
    assert "JobTimeout" in failed.exception_class, failed.error
    assert (tmp_path / "runs").read_text() == "0\n"
    assert not Job.objects.exists()
    assert "Timeout (" not in worker.output()


@pytest.fixture
def outage_jobs() -> Iterator[ModuleType]:
    """The jobs of tests/testapp/outage_jobs.py, registered for this test only."""
    with registered("outage_jobs") as module:
        yield module
