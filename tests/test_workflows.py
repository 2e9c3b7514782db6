"""Workflows: dependencies, results passed on, failure below a node, cancel, retry, with a worker in this process."""

from __future__ import annotations

import json
import signal
import time

import pytest
from django.db import connection, transaction

from django_dbqueue import (
    CycleError,
    WaitTimeout,
    WorkflowState,
    enqueue_after,
    get_workflow,
    handles,
    lifecycle,
    workflow,
)
from django_dbqueue.db import IdListener
from django_dbqueue.lifecycle import dependencies
from django_dbqueue.models import FailedJob, Job, NodeState, Workflow, WorkflowEdge, WorkflowNode
from tests.conftest import run_worker, wait_until
from tests.testapp import workflow_jobs as jobs
from tests.testapp.models import Run

pytestmark = pytest.mark.django_db(transaction=True)


def ran() -> set[str]:
    return set(Run.objects.values_list("key", flat=True))


def note(key: str) -> object:
    return json.loads(Run.objects.get(key=key).note)


def diamond(name: str = "diamond"):
    wf = workflow(name)
    wf.add("a", jobs.node.bind("a", value=1))
    wf.add("b", jobs.add_up, "b", after=["a"], pass_results=True)
    wf.add("c", jobs.node.bind("c", value=100), after=["a"])
    wf.add("d", jobs.node.bind("d"), after=["b", "c"], pass_results=True)
    return wf


def test_a_diamond_runs_each_node_once_after_its_parents_and_d_receives_b_and_c_results():
    handle = diamond().enqueue()
    assert handle.state == WorkflowState.RUNNING and handle.counts == {"pending": 4}
    # Only the root can be claimed: the others are blocked until their parents succeed.
    assert list(Job.objects.filter(blocked=False).values_list("name", flat=True)) == [
        "tests.testapp.workflow_jobs.node"
    ]
    assert {view.name: view.status for view in handle.nodes()} == {
        "a": "waiting", "b": "blocked", "c": "blocked", "d": "blocked",
    }  # fmt: skip
    run_worker()
    assert ran() == {"a", "b", "c", "d"}
    assert note("d") == {"b": 1, "c": 100}
    handle.refresh()
    assert handle.state == WorkflowState.SUCCEEDED and handle.finished
    assert handle.counts == {"succeeded": 4}
    assert handle["b"].status == "succeeded" and handle["b"].result == 1
    assert not Job.objects.exists()


def test_a_failed_parent_cancels_its_subtree_while_an_independent_branch_finishes():
    wf = workflow("branches")
    wf.add("root", jobs.node.bind("root"))
    wf.add("bad", jobs.node.bind("bad", fail=True), after=["root"])
    wf.add("below", jobs.node.bind("below"), after=["bad"])
    wf.add("further", jobs.node.bind("further"), after=["below"])
    wf.add("good", jobs.node.bind("good"), after=["root"])
    wf.add("good2", jobs.node.bind("good2"), after=["good"])
    wf.add("anyway", jobs.node.bind("anyway"), after=["bad", "good"], run_anyway=["bad"])
    handle = wf.enqueue()
    run_worker()
    assert ran() == {"root", "bad", "good", "good2", "anyway"}
    states = {view.name: (view.status, view.error) for view in handle.refresh().nodes()}
    assert states["bad"][0] == "failed" and "fails on purpose" in states["bad"][1]
    assert states["below"][0] == "cancelled" and states["further"][0] == "cancelled"
    assert handle.state == WorkflowState.FAILED and handle.counts == {"succeeded": 4, "failed": 1, "cancelled": 2}
    cancelled = FailedJob.objects.get(job_id=handle["below"].id)
    assert cancelled.exception_class == "django_dbqueue.exceptions.JobCancelled"
    assert "its parent 'bad' did not succeed" in cancelled.error
    assert handle["further"].status == "cancelled"


def test_retrying_a_workflow_from_its_failed_node_runs_it_and_the_nodes_below_it_once():
    wf = workflow("retry")
    wf.add("a", jobs.node.bind("a"))
    wf.add("b", jobs.node.bind("b", fail=True), after=["a"])
    wf.add("c", jobs.node.bind("c"), after=["b"])
    handle = wf.enqueue()
    run_worker()
    assert ran() == {"a", "b"}
    Run.objects.filter(key="b").delete()
    # The failed node must succeed now: its stored call is changed to one that does.
    failed = FailedJob.objects.get(job_id=handle["b"].job_id)
    failed.payload = failed.payload.replace('"fail":true', '"fail":false')
    failed.save()
    new = handle.retry()
    assert len(new) == 2
    states = {view.name: view.status for view in handle.refresh().nodes()}
    assert states == {"a": "succeeded", "b": "waiting", "c": "blocked"}
    run_worker()
    assert ran() == {"a", "b", "c"}
    assert handle.refresh().state == WorkflowState.SUCCEEDED
    assert not FailedJob.objects.exists()


def test_a_cycle_is_refused_at_enqueue_with_the_cycle_named_and_nothing_stored():
    wf = workflow("loop")
    wf.add("a", jobs.node.bind("a"))
    wf.add("b", jobs.node.bind("b"), after=["a", "d"])
    wf.add("c", jobs.node.bind("c"), after=["b"])
    wf.add("d", jobs.node.bind("d"), after=["c"])
    with pytest.raises(
        CycleError, match=r"has a cycle: (b -> c -> d -> b|c -> d -> b -> c|d -> b -> c -> d)"
    ) as caught:
        wf.enqueue()
    assert set(caught.value.cycle) == {"b", "c", "d"}
    assert not Workflow.objects.exists() and not Job.objects.exists()


def test_bad_graphs_and_calls_are_refused_when_declared():
    wf = workflow()
    wf.add("a", jobs.node.bind("a"))
    with pytest.raises(ValueError, match="has a node named 'a' already"):
        wf.add("a", jobs.node.bind("a2"))
    with pytest.raises(CycleError, match="cannot run after itself"):
        wf.add("self", jobs.node.bind("s"), after=["self"])
    with pytest.raises(ValueError, match="run_anyway names parents"):
        wf.add("x", jobs.node.bind("x"), after=["a"], run_anyway=["zzz"])
    with pytest.raises(TypeError, match="results"):
        wf.add("y", jobs.slow_node.bind("y", "/tmp/m"), after=["a"], pass_results=True)
    wf.add("z", jobs.node.bind("z"), after=["missing"])
    with pytest.raises(ValueError, match="runs after 'missing', which is not in workflow"):
        wf.enqueue()


def test_a_workflow_enqueued_in_a_transaction_that_rolls_back_leaves_nothing():
    with pytest.raises(RuntimeError), transaction.atomic():
        diamond().enqueue()
        raise RuntimeError("roll back")
    assert not Workflow.objects.exists() and not WorkflowNode.objects.exists() and not Job.objects.exists()


def test_cancelling_a_workflow_cancels_what_has_not_started_and_nothing_runs_after():
    handle = diamond().enqueue()
    assert handle.cancel() == 4
    assert handle.state == WorkflowState.CANCELLED
    run_worker()
    assert ran() == set()
    assert set(WorkflowNode.objects.values_list("state", flat=True)) == {NodeState.CANCELLED}
    assert handle.cancel() == 0  # once only


def test_a_job_enqueued_after_others_runs_once_they_succeeded_and_receives_their_results():
    first = jobs.node.enqueue("p1", value=2)
    second = jobs.node.enqueue("p2", value=3)
    after = jobs.node.bind("sum").enqueue(depends_on=[first, second])
    assert after.status == "waiting" and Job.objects.get(pk=after.id).blocked
    run_worker()
    assert ran() == {"p1", "p2", "sum"}
    assert after.wait(timeout=5).status == "succeeded"


def test_a_job_enqueued_after_passes_results_when_asked():
    first = jobs.node.enqueue("p1", value=2)
    second = jobs.node.enqueue("p2", value=3)
    after = enqueue_after([first, second], jobs.node.bind("sum", value=7), pass_results=True)
    run_worker()
    assert after.wait(timeout=5).status == "succeeded"
    assert note("sum") == {f"job {first.id}": 2, f"job {second.id}": 3}


def test_a_job_enqueued_after_a_failed_job_is_cancelled_at_once_unless_run_anyway():
    failed = jobs.node.enqueue("bad", fail=True)
    run_worker()
    after = jobs.node.bind("never").enqueue(depends_on=[failed])
    assert after.status == "cancelled"
    anyway = enqueue_after([failed], jobs.node.bind("anyway"), run_anyway=True)
    run_worker()
    assert ran() == {"bad", "anyway"} and anyway.refresh() is None and anyway.status == "succeeded"


def test_a_job_enqueued_after_one_that_succeeded_already_is_released_at_once():
    done = jobs.node.enqueue("done")
    run_worker()
    after = jobs.node.bind("after").enqueue(depends_on=[done])
    assert not Job.objects.get(pk=after.id).blocked
    run_worker()
    assert ran() == {"done", "after"}


def test_a_node_cancelled_by_hand_cancels_the_nodes_below_it():
    handle = diamond().enqueue()
    assert handle["c"].cancel(reason="not needed")
    run_worker()
    assert ran() == {"a", "b"}
    states = {view.name: view.status for view in handle.refresh().nodes()}
    assert states == {"a": "succeeded", "b": "succeeded", "c": "cancelled", "d": "cancelled"}


def test_waiting_for_a_workflow_returns_once_every_node_ended_and_times_out_otherwise():
    handle = diamond().enqueue()
    with pytest.raises(WaitTimeout, match="is still running"):
        handle.wait(timeout=0.05)
    run_worker()
    assert get_workflow(handle.id).wait(timeout=5).state == WorkflowState.SUCCEEDED


needs_postgresql = pytest.mark.skipif(
    connection.vendor != "postgresql", reason="announced by NOTIFY on PostgreSQL; elsewhere a wait polls"
)


def announced(listener: IdListener) -> set[int]:
    """The workflow ids announced to ``listener`` so far (each wait returns at the first notification)."""
    ids: set[int] = set()
    while found := listener.wait(0.2):
        ids |= found
    return ids


@needs_postgresql
@pytest.mark.parametrize("leaf", ["plain", "limited"], ids=["in-the-claim", "in-python"])
def test_a_workflow_is_announced_when_a_node_without_children_ends_well_or_any_node_ends_badly(leaf):
    # A leaf's success is announced by dbqueue_release in the worker's claim statement; a leaf
    # under a concurrency limit ends through the lifecycle's reactions in Python instead.
    # (A queue of its own: a limit moves its queue to the flow claim for the rest of this process.)
    options = {"concurrency_key": "wf-leaf", "concurrency_limit": 1, "queue": "limited"} if leaf == "limited" else {}
    listener = IdListener("default", lifecycle.WORKFLOW_ENDED_CHANNEL)
    assert listener.open()
    try:
        wf = workflow("leaves")
        wf.add("a", jobs.node.bind("a"))
        wf.add("b", jobs.node.using(**options).bind("b"), after=["a"])
        good = wf.enqueue()
        run_worker(queues=["default", "limited"])
        assert announced(listener) == {good.id}
        bad = workflow("bad")
        bad.add("a", jobs.node.bind("a2", fail=True))
        bad.add("b", jobs.node.bind("b2"), after=["a"])
        failing = bad.enqueue()
        run_worker(queues=["default", "limited"])
        assert announced(listener) == {failing.id}
        cancelled = diamond("cancelled").enqueue()
        cancelled.cancel()
        assert announced(listener) == {cancelled.id}
    finally:
        listener.close()


@needs_postgresql
def test_a_workflow_wait_is_woken_by_its_end_not_by_polling(worker_process, monkeypatch):
    # Reads a minute apart: only the announcement can end this wait before its timeout.
    monkeypatch.setattr(handles, "WAIT_FIRST", 60.0)
    monkeypatch.setattr(handles, "WAIT_LONGEST", 60.0)
    wf = workflow("woken")
    wf.add("a", jobs.node.using(delay=1).bind("a"))
    wf.add("b", jobs.node.bind("b"), after=["a"])
    handle = wf.enqueue()
    worker_process("--sleep", "0.05")
    started = time.monotonic()
    assert handle.wait(timeout=30).state == WorkflowState.SUCCEEDED
    # Polling would have read it again only at the timeout (30 s): the announcement woke it.
    assert time.monotonic() - started < 20


@needs_postgresql
@pytest.mark.parametrize("parent", ["plain", "limited"], ids=["in-the-claim", "in-python"])
def test_a_released_child_wakes_the_idle_workers_of_its_queue(parent, worker_process):
    # The child's queue is served only by a worker that polls every 30 s: only the release's
    # NOTIFY can make it claim the child within seconds (an UPDATE fires no INSERT trigger).
    limited = {"concurrency_key": "wf-parent", "concurrency_limit": 1, "queue": "limited"}
    options = limited if parent == "limited" else {}
    idle = worker_process("--queue", "released-here", "--sleep", "30")
    idle.wait_for_output("worker started")
    time.sleep(2)  # past its first, empty claim: it sleeps, listening
    wf = workflow("wake")
    wf.add("a", jobs.node.using(**options).bind("a"))
    wf.add("b", jobs.node.using(queue="released-here").bind("b"), after=["a"])
    wf.enqueue()
    started = time.monotonic()
    run_worker(queues=["default", "limited"])
    wait_until(lambda: Run.objects.filter(key="b").exists(), 20, "the released child waited for the next poll")
    assert time.monotonic() - started < 20


@needs_postgresql
def test_a_worker_claims_the_children_its_own_claim_statement_released_without_waiting_for_its_poll(worker_process):
    # One worker: the statement that deletes "a" releases "b" but cannot see it (one snapshot);
    # the worker must claim again rather than sleep its 30 s poll.
    wf = workflow("self")
    wf.add("a", jobs.node.bind("a"))
    wf.add("b", jobs.node.bind("b"), after=["a"])
    wf.enqueue()
    worker_process("--sleep", "30")
    wait_until(lambda: Run.objects.filter(key="a").exists(), 20, "a never ran")
    started = time.monotonic()
    wait_until(lambda: Run.objects.filter(key="b").exists(), 20, "the worker slept past its own release")
    assert time.monotonic() - started < 20


def test_a_job_waiting_for_a_workflow_without_a_timeout_is_refused():
    handle = diamond().enqueue()
    jobs.wait_for_workflow.bind(handle.id).enqueue()
    run_worker()
    failed = FailedJob.objects.get(name=jobs.wait_for_workflow.name)
    assert "without a timeout" in failed.error and f"workflow {handle.id}" in failed.error


def test_releasing_a_fan_in_marks_each_parents_edge_once_and_the_child_runs_once():
    wf = workflow("fan")
    for i in range(30):
        wf.add(f"p{i}", jobs.node.bind(f"p{i}", value=i))
    wf.add("sum", jobs.add_up, "sum", after=[f"p{i}" for i in range(30)], pass_results=True)
    handle = wf.enqueue()
    run_worker(batch=5)
    assert Run.objects.get(key="sum").note == str(sum(range(30)))
    assert WorkflowEdge.objects.filter(done=True).count() == 30
    assert handle.refresh().state == WorkflowState.SUCCEEDED


def fan(children: int):
    wf = workflow("wide")
    wf.add("root", jobs.node.bind("root"))
    for i in range(children):
        wf.add(f"n{i}", jobs.node.bind(f"n{i}"), after=["root"])
    wf.add("sink", jobs.node.bind("sink"), after=[f"n{i}" for i in range(children)])
    return wf


@needs_postgresql
def test_a_wide_fan_out_is_released_a_chunk_per_transaction_and_every_child_runs_once():
    children = dependencies.FIRST_CHUNK * 3 + 7  # chunks of 500, 1,000, then the last 7
    handle = fan(children).enqueue()
    calls: list[tuple[str, object]] = []
    with connection.execute_wrapper(
        lambda execute, sql, params, many, context: (
            calls.append((sql, params)) if "dbqueue_release_chunk(%s" in sql else None,
            execute(sql, params, many, context),
        )[1]
    ):
        run_worker(batch=1, max_jobs=1)  # the root: its claim statement released the first 500
    assert Job.objects.filter(blocked=False).count() == children
    assert [params[1] for _, params in calls] == [1000, 2000]  # the rest after its commit
    assert WorkflowEdge.objects.filter(done=False, parent__name="root").count() == 0
    run_worker()
    assert Run.objects.filter(key__startswith="n").count() == children
    assert set(Run.objects.values_list("key", flat=True)) == {"root", "sink", *(f"n{i}" for i in range(children))}
    assert Run.objects.count() == children + 2, "a node ran twice"
    assert handle.refresh().state == WorkflowState.SUCCEEDED


@needs_postgresql
def test_a_release_interrupted_between_two_chunks_is_finished_by_the_sweep():
    children = dependencies.FIRST_CHUNK * 2
    fan(children).enqueue()
    root = WorkflowNode.objects.get(name="root")
    Job.objects.filter(pk=root.job_id).delete()  # its job succeeded, its worker killed after the first chunk:
    with connection.cursor() as cursor:
        cursor.execute("SELECT racing, more FROM dbqueue_release_chunk(%s, %s)", [[root.pk], dependencies.FIRST_CHUNK])
        assert cursor.fetchone() == (0, True)
    assert Job.objects.filter(blocked=False).count() == dependencies.FIRST_CHUNK
    assert lifecycle.sweep("default") >= 1
    assert Job.objects.filter(blocked=False).count() == children
    assert not WorkflowEdge.objects.filter(done=False, parent=root).exists()
    run_worker()
    assert Run.objects.filter(key__startswith="n").count() == children and Run.objects.filter(key="sink").exists()


def test_a_workflow_survives_kill_9_of_its_workers_mid_graph_and_every_node_runs_once(worker_process, tmp_path):
    marker = tmp_path / "b-started"
    wf = workflow("killed")
    wf.add("a", jobs.sturdy.bind("a", value=1))
    wf.add("b", jobs.slow_node.bind("b", str(marker), seconds=1.5), after=["a"])
    for i in range(6):
        wf.add(f"c{i}", jobs.sturdy.bind(f"c{i}", value=i), after=["a"])
    wf.add("d", jobs.sturdy.bind("d"), after=["b", *(f"c{i}" for i in range(6))], pass_results=True)
    wf.add("e", jobs.sturdy.bind("e"), after=["d"])
    handle = wf.enqueue()
    first = [worker_process("--sleep", "0.05"), worker_process("--sleep", "0.05")]
    wait_until(marker.exists, 30, "node b never started")
    for process in first:
        process.signal(signal.SIGKILL)
        process.wait(10)
    assert not Run.objects.filter(key="b").exists()
    second = [worker_process("--sleep", "0.05"), worker_process("--sleep", "0.05")]
    try:
        wait_until(lambda: Run.objects.filter(key="e").exists(), 60, "the graph never finished")
    except AssertionError:
        runs = sorted(Run.objects.values_list("key", flat=True))
        rows = list(Job.objects.values_list("name", "blocked", "reserved_at", "attempts", "node_id"))
        raise AssertionError(
            f"{runs}\n{rows}\n{[(v.name, v.status) for v in handle.nodes()]}\n{second[0].output()[-3000:]}"
        ) from None
    wait_until(lambda: not Job.objects.exists(), 10, "rows left behind")
    assert sorted(Run.objects.values_list("key", flat=True)) == sorted(
        ["a", "b", "d", "e", *(f"c{i}" for i in range(6))]
    )
    assert note("d") == {"b": "b", **{f"c{i}": i for i in range(6)}}
    assert handle.refresh().state == WorkflowState.SUCCEEDED
