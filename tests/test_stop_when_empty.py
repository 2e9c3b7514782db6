"""``queue_work --stop-when-empty`` stops only when nothing it could run is waiting.

A claim can come back empty while such jobs wait: the plain claim gives back the
jobs with limits it met (``claims.plain_claimed``), which the flow claim takes
from then on; and a flow claim that ran out of rounds while it still held rows
back says so (``claims.retry_in`` is 0). Neither is an empty queue. Jobs that a
limit holds back (a saturated key, a rate) are not waiting for this worker: it
stops with them still there (docs/flow.md).
"""

from __future__ import annotations

import pytest
from django.db.models import F

from django_dbqueue import claims, enqueue_many
from django_dbqueue.db import DbNow
from django_dbqueue.models import FailedJob, Job
from django_dbqueue.worker import StopReason
from tests.conftest import run_worker
from tests.testapp import jobs
from tests.testapp.models import Run


@pytest.mark.acceptance
@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("threads", [1, 4])
def test_a_worker_that_stops_when_empty_runs_the_keyed_jobs_its_plain_claim_gave_back(worker_process, limits, threads):
    mixed = "stop-when-empty-mixed"  # no definition names it: the worker starts with the plain claim
    enqueue_many(limits.keyed.using(queue=mixed).bind("mixed", n, 0) for n in range(4))
    enqueue_many(jobs.record.using(queue=mixed).bind(f"mixed-plain-{n}") for n in range(4))
    worker = worker_process(
        "--queue", mixed, "--stop-when-empty", "--threads", str(threads), env={"DBQUEUE_TEST_LIMITS": "1"}
    )
    assert worker.wait(timeout=60) == 0, worker.output()
    output = worker.output()
    assert "claimed with limits from now on" in output, output
    assert "reason=empty" in output
    waiting = list(Job.objects.values_list("name", flat=True))
    assert not waiting, f"stopped with {len(waiting)} jobs waiting: {waiting}\n{output}"
    assert Run.objects.filter(key__startswith="mixed:").count() == 4
    assert Run.objects.filter(key__startswith="mixed-plain-").count() == 4
    assert not FailedJob.objects.exists()


@pytest.mark.django_db(transaction=True)
def test_a_worker_that_stops_when_empty_claims_again_after_a_flow_claim_that_ran_out_of_rounds(limits, monkeypatch):
    queue = limits.KEYS_QUEUE
    # One round per claim: the first reads only rows of a saturated key, blocks them and
    # gives up; the plain job behind them waits for the next claim.
    monkeypatch.setattr(claims.flow, "FLOW_ROUNDS", 1)
    enqueue_many(limits.keyed.bind("busy", n, 0) for n in range(claims.FLOW_LOOKAHEAD + 2))
    first = Job.objects.order_by("id").first()
    assert first is not None
    # Another worker runs the key's first job: the key is saturated (its limit is 1).
    Job.objects.filter(pk=first.pk).update(reserved_at=DbNow(), reserved_by="elsewhere", attempts=F("attempts") + 1)
    jobs.record.using(queue=queue).enqueue("behind-the-busy-key")

    _, reason = run_worker([queue])

    assert reason is StopReason.EMPTY
    assert Run.objects.filter(key="behind-the-busy-key").exists(), "stopped with the plain job waiting"
    # The key's other jobs wait blocked for its slot: nothing this worker could run.
    assert Job.objects.filter(blocked=True).count() == claims.FLOW_LOOKAHEAD + 1
