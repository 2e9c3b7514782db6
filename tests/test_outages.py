"""Workers resume within seconds of the database's return, whatever the outage's length
(issue 16, point 12): the wait between two reconnects is capped at 2 s (``DB_RETRY_DELAYS``).

Each worker reaches the database through a forwarder of its own that the test turns
into a server that is down (connections closed, connects refused) for 5, 31 or 61 s.
The three lengths run on PostgreSQL; MariaDB runs the 5 s one, past the cap already:
how a driver reports the lost connection is the same at any length, and the wait
between reconnects is the worker's, the same on every database.
"""

from __future__ import annotations

import os
import time

import pytest
from django.db import connection

from django_dbqueue.outcomes import DB_RETRY_DELAYS
from tests.conftest import wait_until
from tests.network import Forwarder
from tests.testapp import jobs
from tests.testapp.models import Run

OUTAGES = (5, 31, 61) if os.environ.get("DBQUEUE_TEST_DB", "sqlite") == "postgres" else (5,)


@pytest.mark.acceptance
@pytest.mark.skipif("connection.vendor == 'sqlite'", reason="SQLite has no server that can go away")
@pytest.mark.skipif(
    not os.environ.get("DBQUEUE_TEST_HEAVY"),
    reason="a minute of outages: runs once per database, with Django 6.1 (scripts/test sets DBQUEUE_TEST_HEAVY)",
)
@pytest.mark.django_db(transaction=True)
def test_workers_resume_within_the_reconnect_cap_after_outages_of_5_31_and_61_seconds(worker_process):
    settings = connection.settings_dict
    forwarders = {seconds: Forwarder((settings["HOST"], int(settings["PORT"]))) for seconds in OUTAGES}
    try:
        workers = {}
        for seconds, forwarder in forwarders.items():
            host, port = ("PGHOST", "PGPORT") if connection.vendor == "postgresql" else ("MYSQL_HOST", "MYSQL_PORT")
            workers[seconds] = worker_process(
                "--queue", f"outage{seconds}", "--sleep", "0.5", env={host: "127.0.0.1", port: str(forwarder.port)}
            )
        for worker in workers.values():
            worker.wait_for_output("worker started")
        down_at = time.monotonic()
        for forwarder in forwarders.values():
            forwarder.refuse()
        for seconds in OUTAGES:
            jobs.record.using(queue=f"outage{seconds}").enqueue(f"after-{seconds}")
        resumed = {}
        for seconds in OUTAGES:
            time.sleep(max(0.0, down_at + seconds - time.monotonic()))
            forwarders[seconds].accept()
            back_at = time.monotonic()
            wait_until(
                lambda seconds=seconds: Run.objects.filter(key=f"after-{seconds}").exists(),
                30,
                f"no job ran after the {seconds} s outage:\n{workers[seconds].output()[-3000:]}",
            )
            resumed[seconds] = time.monotonic() - back_at
        for worker in workers.values():
            assert worker.process.poll() is None, worker.output()[-3000:]
            assert "connection_lost=True" in worker.output(), "the outage was not noticed"
        # The longest wait between two reconnects, plus a connect, a claim and the job.
        assert all(after <= DB_RETRY_DELAYS[-1] + 1.5 for after in resumed.values()), resumed
        print("resumed after the database's return:", {f"{s} s down": f"{r:.2f} s" for s, r in resumed.items()})
    finally:
        for forwarder in forwarders.values():
            forwarder.close()
