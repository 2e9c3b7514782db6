"""A worker host cut off from the database (issue 16, points 10 and 11).

Each worker runs in a network namespace of its own (a "host"), joined to this
machine by a veth pair; a cut drops every packet of one host without a reset.
Workers set ``NETWORK_TIMEOUT`` 3 s (and a 3 s connect timeout), jobs a lease
(``retry_after``) of 6 s, and record every ``job_succeeded`` they send.
"""

from __future__ import annotations

import os
import time

import pytest
from django.db import connection

from django_dbqueue import chain
from django_dbqueue.models import FailedJob, Job
from tests.conftest import wait_until
from tests.network import hosts, namespaces_usable
from tests.testapp import jobs
from tests.testapp.models import Attempt, Run

USABLE, WHY = namespaces_usable()
NETWORK_TIMEOUT = 3
WORKER_ENV = {
    "DBQUEUE_TEST_NETWORK_TIMEOUT": str(NETWORK_TIMEOUT),
    "DBQUEUE_TEST_CONNECT_TIMEOUT": "3",
    "DBQUEUE_TEST_RECORD_SIGNALS": "1",
}

pytestmark = [
    pytest.mark.acceptance,
    pytest.mark.skipif(
        not os.environ.get("DBQUEUE_TEST_HEAVY"),
        reason="runs once per database, with Django 6.1 (scripts/test sets DBQUEUE_TEST_HEAVY)",
    ),
    pytest.mark.skipif("connection.vendor == 'sqlite'", reason="SQLite has no network between worker and database"),
    pytest.mark.skipif(not USABLE, reason=WHY),
    pytest.mark.django_db(transaction=True),
]


def database() -> tuple[str, int]:
    settings = connection.settings_dict
    return settings["HOST"], int(settings["PORT"])


def reported_successes(job_id: int) -> list[str]:
    """The workers that sent job_succeeded for ``job_id``, as ``succeeded:<id>:<worker id>`` keys."""
    return list(Attempt.objects.filter(key__startswith=f"succeeded:{job_id}:").values_list("key", flat=True))


def start_worker(worker_process, host, *args: str):
    worker = worker_process(
        "--sleep", "0.05", *args, env={**WORKER_ENV, **host.env(connection.vendor)}, prefix=host.prefix
    )
    worker.wait_for_output("worker started")
    return worker


def test_a_host_cut_off_longer_than_the_lease_loses_its_job_to_the_other_host_and_reports_nothing(worker_process):
    with hosts(database(), 2) as (first, second):
        chain(jobs.partition_step.bind("p", 2.5), jobs.step.bind("p", 2)).enqueue()
        step_one = Job.objects.get(name=jobs.partition_step.name)
        cut_off = start_worker(worker_process, first, "--queue", "default,first")
        wait_until(lambda: Attempt.objects.filter(key="p-start").exists(), 30, cut_off.output())
        other = start_worker(worker_process, second)

        first.cut()
        cut_at = time.monotonic()
        noticed = reclaimed = None
        while time.monotonic() - cut_at < 60 and (noticed is None or reclaimed is None):
            if noticed is None and "connection_lost=True" in cut_off.output():
                noticed = time.monotonic() - cut_at
            if reclaimed is None and Run.objects.filter(key="p-2").exists():
                reclaimed = time.monotonic() - cut_at
            time.sleep(0.1)
        assert reclaimed is not None, f"the other host never ran the chain:\n{other.output()}"
        # The job computes 2.5 s more, then its outcome meets the silent network.
        assert noticed is not None and noticed < 2.5 + NETWORK_TIMEOUT + 3, (noticed, cut_off.output())

        first.heal()
        healed_at = time.monotonic()
        jobs.record.using(queue="first").enqueue("after-heal")
        wait_until(
            lambda: Run.objects.filter(key="after-heal").exists(),
            30,
            f"the cut-off worker did not go on after the heal:\n{cut_off.output()}",
        )
        resumed = time.monotonic() - healed_at
        assert cut_off.process.poll() is None, "the cut-off worker exited"
        wait_until(lambda: "reservation lost" in cut_off.output(), 20, cut_off.output())
        # A worker deletes the jobs it ran with its next claim: let that statement
        # through before the hosts' network goes away.
        wait_until(lambda: not Job.objects.exists(), 20, f"{cut_off.output()}\n{other.output()}")

    output = cut_off.output()
    # Its late outcome was refused by the compare-and-set: the job ran on both hosts and
    # was reported once, by the other host; the chain's next step ran once.
    assert Attempt.objects.filter(key="p-start").count() == 2
    successes = reported_successes(step_one.pk)
    assert len(successes) == 1 and f":{other.pid}:" in successes[0], (successes, output)
    assert Run.objects.filter(key="p-2").count() == 1
    assert not FailedJob.objects.exists()
    assert f"reclaimed job={jobs.partition_step.name} id={step_one.pk}" in other.output()
    assert "outcome unknown" in output or "reservation lost" in output
    assert not Job.objects.exists()
    print(f"noticed after {noticed:.1f} s, run elsewhere after {reclaimed:.1f} s, resumed {resumed:.1f} s after heal")


def test_a_cut_shorter_than_the_lease_changes_nothing(worker_process):
    with hosts(database(), 2) as (first, second):
        job = jobs.partition_step.enqueue("s", 3)
        worker = start_worker(worker_process, first)
        wait_until(lambda: Attempt.objects.filter(key="s-start").exists(), 30, worker.output())
        other = start_worker(worker_process, second)
        first.cut()
        time.sleep(2)
        first.heal()
        wait_until(lambda: not Job.objects.filter(pk=job.pk).exists(), 30, worker.output())
        wait_until(lambda: reported_successes(job.pk), 10, worker.output())
    assert Attempt.objects.filter(key="s-start").count() == 1
    successes = reported_successes(job.pk)
    assert len(successes) == 1 and f":{worker.pid}:" in successes[0], successes
    assert "reclaimed" not in other.output()
    assert not FailedJob.objects.exists()
