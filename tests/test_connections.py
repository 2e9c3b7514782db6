"""The connection bill of many threaded workers (issue 31): 1,000 job threads on 4 worker
processes ("hosts") run 50 ms jobs that use the ORM within 100 server connections, bounded by
Django's connection pool or by PgBouncer, and every job runs once.

A job thread gives its connection back when its job ends (``pool._reset_connections``, Django's
``CONN_MAX_AGE`` rule); with ``OPTIONS["pool"]`` it goes back to the process's pool, behind
PgBouncer its server connection goes back at each transaction's end. The server's connections
are sampled from ``pg_stat_activity`` while the workers drain.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import psycopg
import pytest
from django.db import connection

from django_dbqueue import enqueue_many
from django_dbqueue.checks import check_worker_connections
from django_dbqueue.db import pool_size
from django_dbqueue.models import FailedJob, Job
from tests.conftest import WorkerProcess, wait_until
from tests.test_pgbouncer import PGBOUNCER, pgbouncer, through
from tests.testapp import jobs
from tests.testapp.models import Run

__all__ = ["pgbouncer"]  # the fixture, for the test below

pytestmark = pytest.mark.skipif("connection.vendor != 'postgresql'", reason="Django's pool and PgBouncer: PostgreSQL")

HOSTS = 4
THREADS = 250
JOBS = 4000
LIMIT = 100  # server connections for all the hosts together


@contextmanager
def server_connections() -> Iterator[list[int]]:
    """Sample the test database's server connections every 20 ms (the sampler's own included);
    yields the list of samples, filled until the block ends."""
    settings = connection.settings_dict
    samples: list[int] = []
    done = threading.Event()

    def sample() -> None:
        with psycopg.connect(
            host=settings["HOST"], port=settings["PORT"], user=settings["USER"], dbname="postgres", autocommit=True
        ) as sampler:
            while not done.is_set():
                row = sampler.execute(
                    "SELECT count(*) FROM pg_stat_activity WHERE datname = %s AND backend_type = 'client backend'",
                    [settings["NAME"]],
                ).fetchone()
                samples.append(int(row[0]) if row else 0)
                done.wait(0.02)

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    try:
        yield samples
    finally:
        done.set()
        thread.join(10)


def drain_on_hosts(start: Callable[..., WorkerProcess], env: dict[str, str]) -> tuple[list[int], float, str]:
    """Enqueue JOBS 50 ms jobs that each write a row, drain them with HOSTS workers of THREADS
    threads; return the connection samples, the jobs/s and the workers' logs."""
    enqueue_many((jobs.nap.bind(f"n{i}", 0.05) for i in range(JOBS)), handles=False)
    with server_connections() as samples:
        workers = [start("--threads", str(THREADS), "--sleep", "0.2", "--skip-checks", env=env) for _ in range(HOSTS)]
        for worker in workers:
            worker.wait_for_output("worker started", timeout=60)
        began = time.monotonic()
        wait_until(lambda: not Job.objects.exists(), 120, f"jobs were left:\n{workers[0].output()[-3000:]}")
        rate = JOBS / (time.monotonic() - began)
    return samples, rate, "".join(worker.output() for worker in workers)


def assert_each_job_ran_once(logs: str) -> None:
    keys = list(Run.objects.values_list("key", flat=True))
    assert len(keys) == JOBS and set(keys) == {f"n{i}" for i in range(JOBS)}
    assert not FailedJob.objects.exists()
    for trouble in ("too many clients", "given_back=connection_lost", "database error", "Traceback"):
        assert trouble not in logs, f"{trouble!r} in the workers' logs:\n{logs[-3000:]}"


@pytest.mark.acceptance
@pytest.mark.django_db(transaction=True)
def test_a_thousand_job_threads_on_four_hosts_stay_within_100_connections_with_djangos_pool(worker_process):
    """Without a bound each thread holding a connection would need 1,000 (the server allows 100)."""
    samples, rate, logs = drain_on_hosts(worker_process, {"DBQUEUE_TEST_POOL": "20"})
    assert_each_job_ran_once(logs)
    print(f"\n{JOBS} jobs at {rate:.0f} jobs/s; server connections: at most {max(samples)}")
    # Four pools of 20, and the sampler's connection.
    assert max(samples) <= HOSTS * 20 + 1 <= LIMIT
    assert max(samples) > HOSTS, "the sampler saw the workers' connections"


@pytest.mark.skipif(PGBOUNCER is None, reason="pgbouncer is not installed (scripts/test installs it)")
@pytest.mark.acceptance
@pytest.mark.django_db(transaction=True)
def test_a_thousand_job_threads_on_four_hosts_share_pgbouncers_server_connections(pgbouncer, worker_process):
    """PgBouncer in transaction mode: 10 server connections for every client (its pool size);
    each thread keeps its client connection (``CONN_MAX_AGE = None``), which costs PgBouncer little."""
    env = through(pgbouncer, DBQUEUE_TEST_LISTEN="0", DBQUEUE_TEST_CONN_MAX_AGE="none")
    samples, rate, logs = drain_on_hosts(worker_process, env)
    assert_each_job_ran_once(logs)
    print(f"\n{JOBS} jobs at {rate:.0f} jobs/s through PgBouncer; server connections: at most {max(samples)}")
    # PgBouncer's pool of 10, the test's own connection and the sampler's.
    assert max(samples) <= 10 + 2


@pytest.mark.acceptance
@pytest.mark.django_db(transaction=True)
def test_supervised_processes_open_pools_of_their_own(worker_process):
    """The supervisor uses the database before it forks (checks, reclaims): a child that
    inherited its pool would share its sockets ("lost synchronization with server")."""
    enqueue_many((jobs.record.bind(f"s{i}") for i in range(300)), handles=False)
    worker = worker_process("--concurrency", "2", "--threads", "4", "--sleep", "0.2", env={"DBQUEUE_TEST_POOL": "6"})
    wait_until(lambda: not Job.objects.exists(), 60, f"jobs were left:\n{worker.output()[-3000:]}")
    assert sorted(Run.objects.values_list("key", flat=True)) == sorted(f"s{i}" for i in range(300))
    logs = worker.output()
    for trouble in ("lost synchronization", "database error", "Traceback"):
        assert trouble not in logs, f"{trouble!r} in the workers' logs:\n{logs[-3000:]}"


@pytest.mark.django_db
def test_the_connection_check_counts_djangos_pool_not_the_threads(monkeypatch):
    options = {**connection.settings_dict["OPTIONS"], "pool": {"min_size": 2, "max_size": 10}}
    monkeypatch.setitem(connection.settings_dict, "OPTIONS", options)
    assert pool_size(connection) == 10
    with connection.cursor() as cursor:
        cursor.execute("SHOW max_connections")
        limit = int(cursor.fetchone()[0])
    # 1,000 threads a process: the pool bounds each process, not the threads.
    processes = -(-limit // 20)  # 10 each: the fewest that take half the server's connections
    [warning] = check_worker_connections(processes, 1000, 0)
    assert f"{processes * 10} database connections" in warning.msg and "pool of 10" in warning.msg
    assert check_worker_connections(processes - 1, 1000, 0) == []
    monkeypatch.setitem(connection.settings_dict, "OPTIONS", {**options, "pool": True})
    assert pool_size(connection) == 4, "psycopg_pool's default size"
