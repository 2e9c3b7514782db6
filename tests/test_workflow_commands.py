"""queue_workflows: list (by state, with a limit), show a workflow's nodes, retry, cancel; unknown ids refused."""

from __future__ import annotations

from io import StringIO

import pytest
from django.core.management import call_command
from django.core.management.base import CommandError

from django_dbqueue import get_workflow, workflow
from django_dbqueue.models import NodeState, WorkflowNode
from tests.conftest import run_worker
from tests.testapp import workflow_jobs as jobs

pytestmark = pytest.mark.django_db(transaction=True)


def run(*args: str) -> str:
    out = StringIO()
    call_command("queue_workflows", *args, stdout=out)
    return out.getvalue()


def failed_diamond(name: str = "order 7") -> int:
    wf = workflow(name)
    wf.add("a", jobs.node.bind("a"))
    wf.add("b", jobs.node.bind("b", fail=True), after=["a"])
    wf.add("c", jobs.node.bind("c"), after=["a"])
    wf.add("d", jobs.node.bind("d"), after=["b", "c"], run_anyway=["c"])
    handle = wf.enqueue()
    run_worker()
    return handle.id


def waiting(name: str) -> int:
    wf = workflow(name)
    wf.add("first", jobs.node.bind("first"))
    wf.add("second", jobs.node.bind("second"), after=["first"])
    return wf.enqueue().id


def test_list_shows_each_workflow_newest_first_and_filters_by_state_with_a_limit():
    failed = failed_diamond()
    running = waiting("nightly import")
    lines = run("list").splitlines()
    assert lines[0].split() == ["id", "name", "state", "done", "failed", "cancelled", "created"]
    assert lines[1].split()[:5] == [str(running), "nightly", "import", "running", "0/2"]
    assert lines[2].split()[:6] == [str(failed), "order", "7", "failed", "4/4", "1"]
    only_failed = run("list", "--state", "failed")
    assert "order 7" in only_failed and "nightly" not in only_failed
    assert "1 of 2 workflows shown; --limit shows more." in run("list", "--limit", "1")
    assert run("list", "--state", "cancelled").strip() == "No workflows."


def test_show_lists_the_nodes_with_status_parents_and_error():
    pk = failed_diamond()
    out = run("show", str(pk))
    assert out.splitlines()[0] == f"Workflow {pk} order 7: failed, 4/4 nodes done"
    table, errors = out.split("\nErrors:\n")
    rows = {line.split()[0]: line.split() for line in table.splitlines()[2:]}
    assert rows["a"] == ["a", "tests.testapp.workflow_jobs.node", "succeeded", "-"]
    assert rows["b"] == ["b", "tests.testapp.workflow_jobs.node", "failed", "a"]
    assert rows["d"] == ["d", "tests.testapp.workflow_jobs.node", "cancelled", "b,", "c", "(anyway)"]
    assert errors.splitlines()[0] == "b: RuntimeError: node b fails on purpose"
    assert errors.splitlines()[1].startswith("d: cancelled")


def test_retry_puts_the_failed_and_cancelled_nodes_back():
    pk = failed_diamond()
    assert run("retry", str(pk)).strip() == f"Workflow {pk}: 2 nodes put back; each runs once its parents succeed."
    states = dict(WorkflowNode.objects.filter(workflow_id=pk).values_list("name", "state"))
    assert states == {"a": "succeeded", "b": NodeState.PENDING, "c": "succeeded", "d": NodeState.PENDING}
    # Nothing left to retry (b waits again).
    assert run("retry", str(pk)).strip() == f"Workflow {pk} has no failed or cancelled nodes to retry."


def test_cancel_cancels_the_nodes_not_started_once():
    pk = waiting("to cancel")
    out = run("cancel", str(pk))
    assert out.strip() == (
        f"Workflow {pk} was cancelled: 2 nodes that had not started cancelled; running nodes are asked to stop."
    )
    assert get_workflow(pk).state == "cancelled"
    assert run("cancel", str(pk)).strip() == f"Workflow {pk} was cancelled already."


@pytest.mark.parametrize("action", ["show", "retry", "cancel"])
def test_an_unknown_id_is_refused(action):
    with pytest.raises(CommandError, match="No workflow has the id 999999"):
        run(action, "999999")


def test_an_action_is_required_and_an_id_must_be_a_whole_number():
    with pytest.raises(CommandError):
        run()
    with pytest.raises(CommandError):
        run("show", "x")
