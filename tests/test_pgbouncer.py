"""Workers behind PgBouncer in transaction pooling mode (issue 16, point 8).

The fixture starts Debian's ``pgbouncer`` on a free local port, in transaction
mode, in front of the test's PostgreSQL; workers and an enqueueing process reach
the database only through it. ``LISTEN`` cannot pass a transaction pooler, so the
workers either poll (``LISTEN = False``) or listen on an alias that reaches the
server directly (``LISTEN_DATABASE``).
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import django
import pytest
from django.db import connection

from django_dbqueue.models import FailedJob, Job, JobProgress
from tests.conftest import ROOT, wait_until
from tests.testapp import jobs
from tests.testapp.models import Run

PGBOUNCER = shutil.which("pgbouncer") or ("/usr/sbin/pgbouncer" if Path("/usr/sbin/pgbouncer").exists() else None)

pytestmark = [
    pytest.mark.acceptance,
    pytest.mark.skipif("connection.vendor != 'postgresql'", reason="PgBouncer pools PostgreSQL connections"),
    pytest.mark.skipif(PGBOUNCER is None, reason="pgbouncer is not installed (scripts/test installs it)"),
    pytest.mark.django_db(transaction=True),
]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.fixture
def pgbouncer() -> Iterator[int]:
    """A PgBouncer in transaction pooling mode in front of the test's PostgreSQL; yields its port."""
    assert PGBOUNCER is not None
    directory = Path(tempfile.mkdtemp(prefix="dbqueue-pgbouncer-"))
    port = free_port()
    settings = connection.settings_dict
    (directory / "users.txt").write_text(f'"{settings["USER"]}" ""\n')
    (directory / "pgbouncer.ini").write_text(
        "[databases]\n"
        f"* = host={settings['HOST']} port={settings['PORT']}\n"
        "[pgbouncer]\n"
        f"listen_addr = 127.0.0.1\nlisten_port = {port}\n"
        f"auth_type = trust\nauth_file = {directory / 'users.txt'}\n"
        "pool_mode = transaction\nunix_socket_dir =\n"
        f"logfile = {directory / 'pgbouncer.log'}\n"
        "max_client_conn = 1200\ndefault_pool_size = 10\n"
    )
    command = [PGBOUNCER, str(directory / "pgbouncer.ini")]
    if os.geteuid() == 0:
        # PgBouncer refuses to run as root.
        directory.chmod(0o755)
        shutil.chown(directory, "postgres")
        for path in directory.iterdir():
            shutil.chown(path, "postgres")
        command[1:1] = ["-u", "postgres"]
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 10
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                if time.monotonic() > deadline or process.poll() is not None:
                    log = (directory / "pgbouncer.log").read_text() if (directory / "pgbouncer.log").exists() else ""
                    raise AssertionError(f"pgbouncer did not start: {log}") from None
                time.sleep(0.1)
        yield port
    finally:
        process.terminate()
        process.wait(timeout=10)
        shutil.rmtree(directory, ignore_errors=True)


ENQUEUE = """
import django
from django_dbqueue import chain, enqueue_many
from tests.testapp import jobs

enqueue_many([jobs.record.bind(f"b{i}") for i in range(300)])
chain(jobs.step.bind("c", 1), jobs.step.bind("c", 2), jobs.step.bind("c", 3)).enqueue()
print("PROGRESS", jobs.report_progress.enqueue("pr").pk)
jobs.partition_step.enqueue("hb", 3)
if django.VERSION >= (6, 0):
    from tests.testapp.tasks import add_numbers

    print("RESULT", add_numbers.enqueue(2, 3).id)
"""


def through(port: int, **extra: str) -> dict[str, str]:
    return {"PGPORT": str(port), "DBQUEUE_TEST_USE_TEST_DB": "1", **extra}


def test_workers_behind_pgbouncer_claim_beat_chain_report_progress_and_enqueue_in_bulk(pgbouncer, worker_process):
    enqueued = subprocess.run(
        [sys.executable, "-m", "django", "shell", "-c", ENQUEUE],
        cwd=ROOT,
        env={
            **os.environ,
            "DJANGO_SETTINGS_MODULE": "tests.settings",
            "PYTHONPATH": str(ROOT),
            **through(pgbouncer),
        },
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert enqueued.returncode == 0, enqueued.stderr
    printed = dict(line.split(" ", 1) for line in enqueued.stdout.splitlines() if " " in line)
    workers = [
        worker_process("--sleep", "0.1", "--batch", "10", env=through(pgbouncer, DBQUEUE_TEST_LISTEN="0"))
        for _ in range(2)
    ]
    expected = {f"b{i}" for i in range(300)} | {"c-1", "c-2", "c-3", "pr"}
    wait_until(lambda: not Job.objects.exists(), 90, f"jobs were left:\n{workers[0].output()[-3000:]}")
    assert set(Run.objects.values_list("key", flat=True)) == expected
    assert not FailedJob.objects.exists()
    progress = JobProgress.objects.get(key=printed["PROGRESS"])
    assert progress.finished and progress.percent == 100
    if django.VERSION >= (6, 0):
        from django_dbqueue.models import TaskResultRecord

        result = TaskResultRecord.objects.get(pk=printed["RESULT"])
        assert (result.status, result.return_value) == ("SUCCESSFUL", 5)
    # The 3 s job outlived a third of its 6 s lease: the heartbeat extended it through the pooler.
    # Its line is logged after its row's delete commits: wait for the line, not just the row.
    wait_until(
        lambda: "job=tests.testapp.jobs.partition_step" in "".join(worker.output() for worker in workers),
        10,
        f"the 3 s job's outcome was not logged:\n{workers[0].output()[-3000:]}",
    )
    logs = "".join(worker.output() for worker in workers)
    assert "outcome=succeeded" in logs
    for trouble in ("reclaimed", "database error", "prepared statement", "heartbeat failed", "Traceback"):
        assert trouble not in logs, f"{trouble!r} in the workers' logs:\n{logs[-3000:]}"


def test_behind_pgbouncer_idle_workers_listen_on_a_direct_connection_and_wake_at_once(pgbouncer, worker_process):
    settings = connection.settings_dict
    worker = worker_process("--sleep", "10", env=through(pgbouncer, DBQUEUE_TEST_DIRECT_PORT=str(settings["PORT"])))
    worker.wait_for_output("worker started")
    time.sleep(1)  # idle, waiting on its direct connection
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND query LIKE 'LISTEN%%'"
        )
        assert cursor.fetchone()[0] == 1
    enqueued_at = time.monotonic()
    jobs.record.enqueue("woken")
    wait_until(lambda: Run.objects.filter(key="woken").exists(), 8, worker.output())
    assert time.monotonic() - enqueued_at < 3, "the worker polled instead of being woken"
