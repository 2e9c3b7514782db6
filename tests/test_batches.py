"""Batches: counters, callbacks, cancel, add, retry and progress, with a worker in this process."""

from __future__ import annotations

import json

import pytest
from django.db import transaction
from django.test import Client
from django.utils import timezone

from django_dbqueue import BatchClosed, batch, chain, claims, get_batch, get_progress, lifecycle
from django_dbqueue.execution import Defaults
from django_dbqueue.models import BatchState, FailedJob, Job, JobBatch
from django_dbqueue.operations import clear_queue, clearable, delete_unreserved
from django_dbqueue.progress import progress_token
from django_dbqueue.rows import follow_ups
from django_dbqueue.worker import Worker, WorkerOptions
from tests.conftest import run_worker
from tests.testapp import jobs
from tests.testapp.models import Run

pytestmark = pytest.mark.django_db(transaction=True)


def keys(prefix: str = "") -> set[str]:
    return set(Run.objects.filter(key__startswith=prefix).values_list("key", flat=True))


def counts(batch_id: int) -> tuple[int, int, int, int]:
    row = JobBatch.objects.get(pk=batch_id)
    return row.total, row.pending, row.failed, row.cancelled


def callbacks_of(batch_id: int) -> list[str]:
    return sorted(key for key in keys("cb-") if Run.objects.get(key=key).note == str(batch_id))


def test_a_batch_and_its_members_are_stored_together_and_counted():
    handle = batch(*(jobs.member.bind(f"m{i}") for i in range(5)), name="five").enqueue()
    assert (handle.total, handle.pending, handle.state, handle.name) == (5, 5, "running", "five")
    assert set(Job.objects.values_list("batch_id", flat=True)) == {handle.id}
    run_worker()
    handle.refresh()
    assert (handle.total, handle.pending, handle.failed, handle.succeeded) == (5, 0, 0, 5)
    assert handle.finished and handle.state == "finished" and handle.percent == 100
    assert {run.note for run in Run.objects.all()} == {str(handle.id)}


def test_then_and_on_finish_run_once_when_all_succeed_and_on_failure_never():
    handle = (
        batch(*(jobs.member.bind(f"m{i}") for i in range(12)))
        .then(jobs.batch_callback.bind("cb-then"))
        .on_failure(jobs.batch_callback.bind("cb-failure"))
        .on_finish(jobs.batch_callback.bind("cb-finish"))
        .enqueue()
    )
    run_worker()
    assert callbacks_of(handle.id) == ["cb-finish", "cb-then"]
    assert not Job.objects.exists()


def test_a_failed_member_fires_on_failure_once_and_on_finish_but_not_then():
    members = [jobs.member.bind(f"m{i}", fail=i in (2, 5, 7)) for i in range(10)]
    handle = (
        batch(*members)
        .then(jobs.batch_callback.bind("cb-then"))
        .on_failure(jobs.batch_callback.bind("cb-failure"))
        .on_finish(jobs.batch_callback.bind("cb-finish"))
        .enqueue()
    )
    run_worker()
    assert counts(handle.id) == (10, 0, 3, 0)
    assert callbacks_of(handle.id) == ["cb-failure", "cb-finish"]
    assert set(FailedJob.objects.filter(name=jobs.member.name).values_list("batch_id", flat=True)) == {handle.id}
    assert get_batch(handle.id).state == "failed"


def test_allow_failures_runs_then_despite_failed_members():
    handle = (
        batch(jobs.member.bind("m1"), jobs.member.bind("m2", fail=True), allow_failures=True)
        .then(jobs.batch_callback.bind("cb-then"))
        .on_finish(jobs.batch_callback.bind("cb-finish"))
        .enqueue()
    )
    run_worker()
    assert callbacks_of(handle.id) == ["cb-finish", "cb-then"]
    assert counts(handle.id) == (2, 0, 1, 0)


def test_retrying_failed_members_reopens_the_batch_and_fires_then_when_they_succeed():
    handle = (
        batch(jobs.member.bind("m1"), jobs.member.bind("m2", fail=True))
        .then(jobs.batch_callback.bind("cb-then"))
        .on_finish(jobs.batch_callback.bind("cb-finish"))
        .enqueue()
    )
    run_worker()
    assert callbacks_of(handle.id) == ["cb-finish"]
    # The member now succeeds: make its stored call a passing one, as a fixed bug would.
    failed = FailedJob.objects.get()
    envelope = json.loads(failed.payload)
    envelope["kwargs"]["fail"] = False
    FailedJob.objects.filter(pk=failed.pk).update(payload=json.dumps(envelope))
    Run.objects.filter(key="cb-finish").delete()
    retried = get_batch(handle.id).retry_failed()
    assert len(retried) == 1 and retried[0].batch_id == handle.id
    reopened = get_batch(handle.id)
    assert (reopened.pending, reopened.failed, reopened.finished) == (1, 0, False)
    run_worker()
    assert callbacks_of(handle.id) == ["cb-finish", "cb-then"]
    assert counts(handle.id) == (2, 0, 0, 0)


def test_an_empty_batch_finishes_at_once_and_runs_then_and_on_finish():
    handle = (
        batch().then(jobs.batch_callback.bind("cb-then")).on_finish(jobs.batch_callback.bind("cb-finish")).enqueue()
    )
    assert handle.finished and (handle.total, handle.pending) == (0, 0) and handle.percent == 100
    run_worker()
    assert callbacks_of(handle.id) == ["cb-finish", "cb-then"]


def test_a_batch_enqueued_in_a_rolled_back_transaction_leaves_nothing():
    class Rollback(Exception):
        pass

    with pytest.raises(Rollback), transaction.atomic():
        batch(*(jobs.member.bind(f"m{i}") for i in range(50))).then(jobs.batch_callback.bind("cb")).enqueue()
        assert Job.objects.count() == 50
        raise Rollback
    assert not JobBatch.objects.exists() and not Job.objects.exists()


def test_a_bad_member_argument_stores_nothing():
    with pytest.raises(TypeError):
        batch(jobs.member.bind("ok"), jobs.member.bind(object())).enqueue()  # type: ignore[arg-type]
    assert not JobBatch.objects.exists() and not Job.objects.exists()


def test_a_batch_of_chains_counts_each_chain_once_when_its_last_step_ends():
    handle = (
        batch(*(chain(jobs.step.bind(f"c{i}", 1), jobs.step.bind(f"c{i}", 2)) for i in range(3)))
        .then(jobs.batch_callback.bind("cb-then"))
        .enqueue()
    )
    run_worker(once=True)
    assert counts(handle.id) == (3, 3, 0, 0)  # a first step done: its chain goes on
    assert Job.objects.filter(batch_id=handle.id).count() == 3
    run_worker()
    assert keys("c") - {"cb-then"} == {f"c{i}-{n}" for i in range(3) for n in (1, 2)}
    assert counts(handle.id) == (3, 0, 0, 0)
    assert callbacks_of(handle.id) == ["cb-then"]


def test_a_failing_chain_step_fails_its_member():
    handle = batch(chain(jobs.step.bind("c", 1), jobs.failing_step.bind("c", 2), jobs.step.bind("c", 3))).enqueue()
    run_worker()
    assert counts(handle.id) == (1, 0, 1, 0)
    assert FailedJob.objects.get().batch_id == handle.id


def test_a_member_adds_members_to_its_own_batch():
    handle = batch(jobs.add_members.bind("adder", 4)).then(jobs.batch_callback.bind("cb-then")).enqueue()
    run_worker()
    assert keys("adder") == {"adder", *(f"adder-{i}" for i in range(4))}
    assert counts(handle.id) == (5, 0, 0, 0)
    assert callbacks_of(handle.id) == ["cb-then"]


def test_cancel_deletes_waiting_members_runs_on_finish_and_refuses_new_members():
    handle = (
        batch(*(jobs.member.bind(f"m{i}") for i in range(6)))
        .then(jobs.batch_callback.bind("cb-then"))
        .on_finish(jobs.batch_callback.bind("cb-finish"))
        .enqueue()
    )
    run_worker(max_jobs=2, batch=1)
    assert handle.cancel() == 4
    assert handle.is_cancelled and handle.finished and handle.state == "cancelled"
    assert counts(handle.id) == (6, 0, 0, 4)
    assert not Job.objects.filter(batch_id=handle.id).exists()
    with pytest.raises(BatchClosed):
        handle.add(jobs.member.bind("late"))
    assert handle.cancel() == 0
    run_worker()
    assert callbacks_of(handle.id) == ["cb-finish"]


def test_a_running_chain_of_a_cancelled_batch_stops_after_its_current_step():
    handle = batch(chain(jobs.step.bind("c", 1), jobs.step.bind("c", 2))).enqueue()
    [first] = claims.reserve_many(["default"], limit=1)
    assert get_batch(handle.id).cancel() == 0  # the running step is left to its worker
    # Its worker records the step's success with the chain's next step, as after a run.
    assert lifecycle.delete(first, follow_ups=follow_ups(first, succeeded=True)) is True
    assert not Job.objects.exists()  # the next step was dropped: the member counts as cancelled
    assert counts(handle.id) == (1, 0, 0, 1)
    assert get_batch(handle.id).state == "cancelled"


def test_operator_deletes_count_as_cancelled_members():
    handle = batch(*(jobs.member.bind(f"m{i}") for i in range(4))).enqueue()
    ids = list(Job.objects.order_by("id").values_list("pk", flat=True))
    assert len(delete_unreserved(ids[:1])) == 1
    assert counts(handle.id) == (4, 3, 0, 1)
    assert clear_queue(clearable("default")) == 3
    assert counts(handle.id) == (4, 0, 0, 4)
    assert get_batch(handle.id).finished


def test_batch_progress_is_read_through_the_progress_api_and_view_with_its_access_rules():
    handle = batch(*(jobs.member.bind(f"m{i}") for i in range(4))).enqueue()
    run_worker(max_jobs=1, batch=1)
    progress = get_progress(handle.progress_key)
    assert progress is not None
    assert (progress["total"], progress["done"], progress["percent"], progress["finished"]) == (4, 1, 25.0, False)
    client = Client()
    assert client.get(f"/queue/progress/{handle.progress_key}/").status_code == 401
    token = progress_token(handle.progress_key)
    response = client.get(f"/queue/progress/{handle.progress_key}/", {"token": token})
    assert response.status_code == 200 and response.json()["done"] == 1
    other = progress_token("batch:999999")
    assert client.get(f"/queue/progress/{handle.progress_key}/", {"token": other}).status_code == 403
    assert get_progress("batch:999999") is None and get_progress("batch:x") is None


def test_a_unique_member_whose_key_is_held_is_not_counted():
    unique_member = jobs.member.using(unique=True)
    unique_member.enqueue("held")
    handle = batch(unique_member.bind("held"), unique_member.bind("new"), jobs.member.bind("plain")).enqueue()
    assert (handle.total, handle.pending) == (2, 2)
    run_worker()
    assert counts(handle.id) == (2, 0, 0, 0) and keys() == {"held", "new", "plain"}


def test_a_claimed_member_of_a_batch_cancelled_since_does_not_start():
    declared = batch(*(jobs.member.bind(f"m{i}") for i in range(3))).on_finish(jobs.batch_callback.bind("cb-f"))
    handle = declared.enqueue()
    claimed = claims.reserve_many(["default"], limit=3)
    assert len(claimed) == 3 and handle.cancel() == 0  # all three held by a worker: none deleted
    worker = Worker(WorkerOptions(queues=["default"], defaults=Defaults(tries=3, timeout=30, backoff=0)))
    for job in claimed:
        worker.process(job)
    worker.heartbeat.stop()  # the worker's loop, which stops it, never ran
    assert not keys("m")  # none ran
    assert counts(handle.id) == (3, 0, 0, 3) and get_batch(handle.id).state == "cancelled"
    run_worker()
    assert callbacks_of(handle.id) == ["cb-f"]


def test_failed_members_of_a_cancelled_batch_are_retried_outside_it():
    handle = batch(jobs.member.bind("x", fail=True), jobs.member.bind("y", seconds=0)).enqueue()
    run_worker(max_jobs=1, batch=1)
    assert counts(handle.id) == (2, 1, 1, 0)
    assert handle.cancel() == 1
    with pytest.raises(BatchClosed):
        get_batch(handle.id).retry_failed()
    [job] = lifecycle.retry(FailedJob.objects.filter(pk__in=[FailedJob.objects.get().pk]))
    assert job.batch_id is None
    assert counts(handle.id) == (2, 0, 0, 2) and get_batch(handle.id).state == "cancelled"


def test_every_batch_state_names_the_same_rows_in_sql_and_on_a_row():
    now = timezone.now()
    made = [
        (BatchState.RUNNING, {}),
        (BatchState.RUNNING, {"total": 2, "pending": 1, "failed": 1}),
        (BatchState.FINISHED, {"finished_at": now}),
        (BatchState.FAILED, {"finished_at": now, "total": 1, "failed": 1}),
        (BatchState.CANCELLING, {"cancelled_at": now}),
        (BatchState.CANCELLED, {"cancelled_at": now, "finished_at": now}),
        (BatchState.CANCELLED, {"cancelled_at": now, "finished_at": now, "total": 1, "failed": 1}),
    ]
    rows = [(state, JobBatch.objects.create(created_at=now, **values).pk) for state, values in made]
    for state in BatchState:
        expected = {pk for named, pk in rows if named is state}
        assert set(JobBatch.objects.in_state(state).values_list("pk", flat=True)) == expected
        assert {pk for pk in expected if JobBatch.objects.get(pk=pk).state is state} == expected
    assert JobBatch.objects.in_state().count() == 0
    assert JobBatch.objects.in_state("finished", "failed").count() == 2
    assert [state.value for state in BatchState] == ["running", "finished", "failed", "cancelling", "cancelled"]
