"""The workflows' admin pages through Django's test client (and once in a real Chromium): the list,
the graph drawn as SVG (a box per node, an arrow per edge, colours by status, links to failed jobs,
escaped names), the node table, cancel and retry with their permissions and CSRF.

Set DBQUEUE_SCREENSHOTS=1 to refresh docs/workflow.png.
"""

from __future__ import annotations

import re
from collections.abc import Iterator

import pytest
from django.contrib.auth.models import User
from django.urls import reverse

from django_dbqueue import claims, get_workflow, job, registry, workflow
from django_dbqueue.admin.workflows import MAX_DRAWN, graph_svg, layers
from django_dbqueue.models import FailedJob, NodeState, WorkflowNode
from django_dbqueue.workflows import NodeView
from tests.conftest import run_worker
from tests.test_batch_admin import RETRY, csrf_token, login
from tests.test_browser import live_url, page, screenshot_path  # noqa: F401  (fixtures)
from tests.testapp import workflow_jobs as jobs

pytestmark = pytest.mark.django_db(transaction=True)

WORKFLOW_LIST = reverse("admin:django_dbqueue_workflow_changelist")


def change_url(pk: int) -> str:
    return reverse("admin:django_dbqueue_workflow_change", args=[pk])


def failed_diamond(name: str = "diamond") -> int:
    """a -> b, a -> c, b and c -> d, and e after b (run anyway): b fails, so d is cancelled; a, c and e succeed."""
    wf = workflow(name)
    wf.add("a", jobs.node.bind("a"))
    wf.add("b", jobs.node.bind("b", fail=True), after=["a"])
    wf.add("c", jobs.node.bind("c"), after=["a"])
    wf.add("d", jobs.node.bind("d"), after=["b", "c"])
    wf.add("e", jobs.node.bind("e"), after=["b"], run_anyway=["b"])
    handle = wf.enqueue()
    run_worker()
    assert {node.name: node.status for node in handle.nodes()} == {
        "a": "succeeded", "b": "failed", "c": "succeeded", "d": "cancelled", "e": "succeeded",
    }  # fmt: skip
    return handle.id


def test_the_list_shows_each_workflows_state_and_nodes_done_and_filters_and_searches(admin):
    failed = failed_diamond("order 1")
    running = workflow("order 2")
    running.add("only", jobs.node.bind("only"))
    waiting = running.enqueue().id
    html = admin.get(WORKFLOW_LIST).content.decode()
    assert "order 1" in html and "order 2" in html
    assert re.search(rf'href="{change_url(failed)}".*?field-state">failed<.*?field-nodes_done">5/5<', html, re.S)
    assert re.search(rf'href="{change_url(waiting)}".*?field-state">running<.*?field-nodes_done">0/1<', html, re.S)
    only_failed = admin.get(WORKFLOW_LIST, {"state": "failed"}).content.decode()
    assert "order 1" in only_failed and "order 2" not in only_failed
    only_running = admin.get(WORKFLOW_LIST, {"state": "running"}).content.decode()
    assert "order 2" in only_running and "order 1" not in only_running
    assert "order 1" not in admin.get(WORKFLOW_LIST, {"q": "order 2"}).content.decode()


def test_the_page_draws_a_box_per_node_an_arrow_per_edge_coloured_by_status(admin):
    pk = failed_diamond()
    response = admin.get(change_url(pk))
    assert response.status_code == 200
    html = response.content.decode()
    start = html.index('<svg class="dbq-graph"')
    svg = html[start : html.index("</svg>", start)]
    ids = dict(WorkflowNode.objects.filter(workflow_id=pk).values_list("name", "pk"))
    drawn = dict((node, status) for status, node in re.findall(r'class="dbq-node dbq-(\w+)" data-node="(\d+)"', svg))
    assert drawn == {
        str(ids["a"]): "succeeded", str(ids["b"]): "failed", str(ids["c"]): "succeeded",
        str(ids["d"]): "cancelled", str(ids["e"]): "succeeded",
    }  # fmt: skip
    assert svg.count('<path class="dbq-edge') == 5
    assert svg.count('<path class="dbq-edge dbq-anyway"') == 1
    assert "b → e (runs anyway)" in svg
    # The legend names each status; the node table lists each node with its error.
    assert all(f'dbq-swatch dbq-{status}"' in html for status in ("blocked", "waiting", "running", "failed"))
    table = html[html.index('id="workflow-nodes"') :]
    assert table.count("<tr class=") == 5
    assert "RuntimeError: node b fails on purpose" in table
    assert "its parent &#x27;b&#x27; did not succeed" in table or "did not succeed" in table


def test_a_failed_node_links_to_its_failed_job_and_its_tooltip_has_the_error(admin):
    pk = failed_diamond()
    handle = get_workflow(pk)
    failed = FailedJob.objects.get(job_id=handle["b"].id)
    html = admin.get(change_url(pk)).content.decode()
    link = reverse("admin:django_dbqueue_failedjob_change", args=[failed.pk])
    box = re.search(rf'<a href="{link}"><g class="dbq-node dbq-failed".*?</g></a>', html, re.S)
    assert box is not None
    assert "<title>b (tests.testapp.workflow_jobs.node): failed\nRuntimeError: node b fails on purpose" in box.group()


def test_user_text_is_escaped_in_the_drawing_and_the_table(admin):
    wf = workflow("<script>alert('wf')</script>")
    wf.add("<script>alert(1)</script>", jobs.node.bind("x"))
    wf.add('"><img src=x onerror=alert(2)>', jobs.node.bind("y"), after=["<script>alert(1)</script>"])
    pk = wf.enqueue().id
    html = admin.get(change_url(pk)).content.decode()
    assert "<script>alert" not in html and "<img src=x" not in html
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in html
    assert html.count('class="dbq-node') == 2


def test_a_graph_is_laid_out_in_layers_by_the_longest_path_from_a_root():
    def view(pk: int, name: str, *parents: str) -> NodeView:
        return NodeView(pk, name, "job", pk, "waiting", "", parents, (), None)

    nodes = [view(1, "a"), view(2, "b", "a"), view(3, "c", "b"), view(4, "d", "a", "c"), view(5, "x", "elsewhere")]
    assert layers(nodes) == {"a": 0, "b": 1, "c": 2, "d": 3, "x": 0}
    svg = graph_svg(nodes)
    assert svg.count('class="dbq-node') == 5 and svg.count('class="dbq-edge') == 4


def test_beyond_the_limit_the_nodes_are_listed_not_drawn(admin):
    wf = workflow("wide")
    for index in range(MAX_DRAWN + 1):
        wf.add(f"n{index}", jobs.node.bind(f"n{index}"))
    html = admin.get(change_url(wf.enqueue().id)).content.decode()
    assert '<svg class="dbq-graph"' not in html
    assert f"{MAX_DRAWN + 1} nodes: more than {MAX_DRAWN} are listed below, not drawn." in html


def test_workflows_cannot_be_added_changed_or_deleted_through_the_admin(admin):
    pk = failed_diamond()
    assert admin.get(reverse("admin:django_dbqueue_workflow_add")).status_code == 403
    assert admin.get(reverse("admin:django_dbqueue_workflow_delete", args=[pk])).status_code == 403
    html = admin.get(change_url(pk)).content.decode()
    assert 'name="_save"' not in html
    assert "workflownode" not in admin.get(reverse("admin:index")).content.decode()


def test_the_cancel_button_cancels_needs_its_permission_refuses_get_and_needs_a_csrf_token():
    wf = workflow("to cancel")
    wf.add("a", jobs.node.bind("a"))
    wf.add("b", jobs.node.bind("b"), after=["a"])
    pk = wf.enqueue().id
    cancel = reverse("admin:django_dbqueue_workflow_cancel", args=[pk])
    viewer = login("view_workflow")
    assert 'id="cancel-workflow"' not in viewer.get(change_url(pk)).content.decode()
    assert viewer.post(cancel).status_code == 403
    operator = login("view_workflow", "cancel_workflow", csrf=True)
    assert 'id="cancel-workflow"' in operator.get(change_url(pk)).content.decode()
    assert operator.get(cancel).status_code == 405
    assert operator.post(cancel).status_code == 403  # no CSRF token
    assert get_workflow(pk).state == "running"
    response = operator.post(cancel, {"csrfmiddlewaretoken": csrf_token(operator, change_url(pk))}, follow=True)
    assert f"Workflow {pk} was cancelled: 2 nodes that had not started were cancelled" in response.content.decode()
    assert get_workflow(pk).state == "cancelled"
    assert 'id="cancel-workflow"' not in response.content.decode()


def test_the_retry_button_retries_from_the_failed_nodes_with_the_failed_jobs_retry_permission():
    pk = failed_diamond()
    retry = reverse("admin:django_dbqueue_workflow_retry", args=[pk])
    viewer = login("view_workflow", "cancel_workflow")
    assert 'id="retry-workflow"' not in viewer.get(change_url(pk)).content.decode()
    assert viewer.post(retry).status_code == 403
    operator = login("view_workflow", *RETRY, csrf=True)
    assert operator.get(retry).status_code == 405
    assert operator.post(retry).status_code == 403  # no CSRF token
    token = csrf_token(operator, change_url(pk))
    response = operator.post(retry, {"csrfmiddlewaretoken": token}, follow=True)
    assert f"2 nodes of workflow {pk} were put back" in response.content.decode()
    states = dict(WorkflowNode.objects.filter(workflow_id=pk).values_list("name", "state"))
    assert states["b"] == states["d"] == NodeState.PENDING
    assert 'id="retry-workflow"' not in response.content.decode()


# -- in a browser, and the screenshot of the docs ------------------------------------------------


def charge_card(order: int) -> None:
    pass


def reserve_stock(order: int) -> None:
    raise RuntimeError(f"out of stock for order {order}: SKU 4411 (2 wanted, 0 left)")


def send_receipt(order: int) -> None:
    pass


def ship(order: int) -> None:
    pass


def tell_support(order: int) -> None:
    pass


@pytest.fixture
def shop() -> Iterator[dict[str, object]]:
    made = {
        function.__name__: job(name=f"shop.{function.__name__}", tries=1)(function)
        for function in (charge_card, reserve_stock, send_receipt, ship, tell_support)
    }
    try:
        yield made
    finally:
        for name in made:
            registry.unregister(f"shop.{name}")


def test_an_operator_sees_an_order_workflow_and_opens_its_failed_node_in_a_browser(
    live_url,  # noqa: F811
    page,  # noqa: F811
    tmp_path,
    shop,
):
    wf = workflow("order 1042")
    wf.add("charge", shop["charge_card"].bind(1042))
    wf.add("reserve stock", shop["reserve_stock"].bind(1042), after=["charge"])
    wf.add("send receipt", shop["send_receipt"].bind(1042), after=["charge"])
    wf.add("ship", shop["ship"].bind(1042), after=["reserve stock", "send receipt"])
    wf.add("tell support", shop["tell_support"].using(queue="support").bind(1042), after=["reserve stock"],
           run_anyway=["reserve stock"])  # fmt: skip
    handle = wf.enqueue()
    run_worker()
    assert claims.reserve(["support"]) is not None  # a worker runs it now
    User.objects.create_superuser("ops", "ops@example.com", "s3cret-pass")
    page.goto(f"{live_url}{reverse('admin:login')}?next={change_url(handle.id)}")
    page.fill("#id_username", "ops")
    page.fill("#id_password", "s3cret-pass")
    page.click("input[type=submit]")
    page.wait_for_selector("svg.dbq-graph")
    assert page.locator("svg.dbq-graph g.dbq-node").count() == 5
    statuses = page.locator("svg.dbq-graph .dbq-status").all_text_contents()
    assert sorted(text.lower() for text in statuses) == ["cancelled", "failed", "running", "succeeded", "succeeded"]
    page.set_viewport_size({"width": 1300, "height": 800})
    page.screenshot(path=str(screenshot_path("workflow.png", tmp_path)), full_page=True)
    page.click("svg.dbq-graph a g.dbq-failed")
    page.wait_for_selector("#failedjob_form, #content-main")
    assert "out of stock for order 1042" in page.inner_text("#content-main")
