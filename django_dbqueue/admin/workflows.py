"""The workflows' pages: a list with each workflow's state and nodes done, and a page per workflow
that draws its graph (inline SVG, drawn here: no JavaScript), lists its nodes, and cancels or retries it.

Workflow rows are written only by workflows.py and the lifecycle, so the pages are read-only; nodes
and edges are shown on their workflow's page, not registered on their own.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from django.contrib import admin, messages
from django.contrib.admin.utils import unquote
from django.core.exceptions import PermissionDenied
from django.db.models import Count, Q, QuerySet
from django.http import HttpRequest, HttpResponse
from django.urls import path
from django.utils.html import escape
from django.utils.safestring import SafeString, mark_safe
from django.utils.translation import ngettext
from django.views.decorators.http import require_POST

from .. import workflows
from ..models import FailedJob, NodeState, Workflow, workflow_state
from ..states import WorkflowState
from ..workflows import NodeView
from .base import ReadOnlyAdmin, StateFilter, permission

# Beyond this many nodes the page lists them without a drawing: a layered drawing of hundreds of
# boxes is wider or taller than anyone reads.
MAX_DRAWN = 200
# The drawing's geometry, in the SVG's own units (pixels at 100%): a box per node, a column per layer.
BOX_WIDTH, BOX_HEIGHT = 190, 58
COLUMN_GAP, ROW_GAP, MARGIN = 70, 18, 12
# Characters of a node's name and job name that fit in its box; the tooltip has them whole.
NAME_FITS, JOB_FITS = 24, 30
# Each status a node shows (NodeView.status), in the legend's order, with what it means.
STATUSES = {
    "blocked": "waits for its parents",
    "waiting": "ready, waits for a worker",
    "delayed": "ready at a later time",
    "running": "a worker runs it",
    "succeeded": "succeeded",
    "failed": "failed",
    "cancelled": "cancelled (a parent failed, or by hand)",
}
Check = Callable[[HttpRequest], bool]
Press = Callable[[HttpRequest, int], None]


def _in_state(rows: Any, *, state: str) -> QuerySet[Workflow]:
    return rows.in_state(state)  # type: ignore[no-any-return]


class WorkflowStateFilter(StateFilter):
    states = {state.value: (state.label, functools.partial(_in_state, state=state)) for state in WorkflowState}


def state_of(row: Any) -> WorkflowState:
    """A listed workflow's state, from the counts its row was annotated with (see ``WorkflowHandle.state``)."""
    return workflow_state(row.cancelled_at is not None, {NodeState.PENDING: row.pending, NodeState.FAILED: row.stopped})


# -- the drawing ------------------------------------------------------------------


@dataclass(frozen=True)
class Placed:
    node: NodeView
    layer: int
    row: int

    @property
    def x(self) -> int:
        return MARGIN + self.layer * (BOX_WIDTH + COLUMN_GAP)

    @property
    def y(self) -> int:
        return MARGIN + self.row * (BOX_HEIGHT + ROW_GAP)


def layers(nodes: Sequence[NodeView]) -> dict[str, int]:
    """Each node's layer: the length of the longest path to it from a node without parents.

    Parents outside ``nodes`` (a job of another workflow that ``enqueue_after`` waits for) are left out.
    """
    names = {node.name for node in nodes}
    parents = {node.name: [parent for parent in node.parents if parent in names] for node in nodes}
    depth: dict[str, int] = {}
    left = {name: len(of) for name, of in parents.items()}
    children: dict[str, list[str]] = {name: [] for name in names}
    for name, of in parents.items():
        for parent in of:
            children[parent].append(name)
    ready = [node.name for node in nodes if not left[node.name]]
    while ready:
        name = ready.pop()
        depth[name] = max((depth[parent] + 1 for parent in parents[name]), default=0)
        for child in children[name]:
            left[child] -= 1
            if not left[child]:
                ready.append(child)
    # The database refuses no cycle an operator's SQL could make: such nodes go in the last layer.
    last = max(depth.values(), default=-1) + 1
    return {node.name: depth.get(node.name, last) for node in nodes}


def place(nodes: Sequence[NodeView]) -> list[Placed]:
    """Each node in its layer (a column), the layer's nodes top to bottom by id."""
    layer_of = layers(nodes)
    rows: dict[int, int] = {}
    placed = []
    for node in sorted(nodes, key=lambda node: node.id):
        layer = layer_of[node.name]
        rows[layer] = rows.get(layer, -1) + 1
        placed.append(Placed(node, layer, rows[layer]))
    return placed


def _fit(text: str, width: int) -> str:
    """``text`` cut to ``width`` characters: a dotted name keeps its end, other text its start."""
    if len(text) <= width:
        return text
    if "." in text:
        return "…" + text[len(text) - width + 1 :]
    return text[: width - 1] + "…"


def _tooltip(node: NodeView) -> str:
    lines = [f"{node.name} ({node.job_name}): {node.status}"]
    if node.error:
        lines.append(node.error)
    if node.failed_job_id is not None:
        lines.append("Click for its failed job.")
    return "\n".join(lines)


def _box(spot: Placed, failed_url: Callable[[int], str] | None) -> str:
    node = spot.node
    status = node.status if node.status in STATUSES else "running"
    x, y = spot.x, spot.y
    middle = x + BOX_WIDTH / 2
    parts = [
        f'<g class="dbq-node dbq-{status}" data-node="{node.id}">',
        f"<title>{escape(_tooltip(node))}</title>",
        f'<rect x="{x}" y="{y}" width="{BOX_WIDTH}" height="{BOX_HEIGHT}" rx="9" ry="9"/>',
        f'<text class="dbq-name" x="{middle}" y="{y + 19}">{escape(_fit(node.name, NAME_FITS))}</text>',
        f'<text class="dbq-job" x="{middle}" y="{y + 35}">{escape(_fit(node.job_name, JOB_FITS))}</text>',
        f'<text class="dbq-status" x="{middle}" y="{y + 50}">{escape(node.status)}</text>',
        "</g>",
    ]
    if failed_url is not None and node.failed_job_id is not None:
        return f'<a href="{escape(failed_url(node.failed_job_id))}">{"".join(parts)}</a>'
    return "".join(parts)


def _edge(parent: Placed, child: Placed, run_anyway: bool) -> str:
    x1, y1 = parent.x + BOX_WIDTH, parent.y + BOX_HEIGHT / 2
    x2, y2 = child.x - 4, child.y + BOX_HEIGHT / 2
    bend = COLUMN_GAP / 2
    css = "dbq-edge dbq-anyway" if run_anyway else "dbq-edge"
    title = f"{parent.node.name} → {child.node.name}" + (" (runs anyway)" if run_anyway else "")
    return (
        f'<path class="{css}" d="M{x1},{y1} C{x1 + bend},{y1} {x2 - bend},{y2} {x2},{y2}" '
        f'marker-end="url(#dbq-arrow)"><title>{escape(title)}</title></path>'
    )


def graph_svg(nodes: Sequence[NodeView], failed_url: Callable[[int], str] | None = None) -> SafeString:
    """Draw ``nodes`` as boxes in layers, left to right, with an arrow per edge (dashed: run anyway);
    a node with a failed job links to ``failed_url(its id)``. Every user's text is escaped."""
    placed = place(nodes)
    by_name = {spot.node.name: spot for spot in placed}
    width = max(spot.x for spot in placed) + BOX_WIDTH + MARGIN
    height = max(spot.y for spot in placed) + BOX_HEIGHT + MARGIN
    edges = [
        _edge(by_name[parent], spot, parent in spot.node.run_anyway)
        for spot in placed
        for parent in spot.node.parents
        if parent in by_name
    ]
    label = escape(f"The workflow's graph: {len(placed)} nodes, {len(edges)} edges")
    return mark_safe(  # every text above is escaped
        f'<svg class="dbq-graph" viewBox="0 0 {width} {height}" width="{width}" height="{height}" '
        f'role="img" aria-label="{label}" xmlns="http://www.w3.org/2000/svg">'
        '<defs><marker id="dbq-arrow" viewBox="0 0 10 10" refX="9" refY="5" markerWidth="8" markerHeight="8" '
        'orient="auto-start-reverse"><path class="dbq-arrowhead" d="M0,0 L10,5 L0,10 z"/></marker></defs>'
        + "".join(edges)
        + "".join(_box(spot, failed_url) for spot in placed)
        + "</svg>"
    )


# -- the admin ----------------------------------------------------------------------


def _link(failed_url: Callable[[int], str] | None, node: NodeView) -> str:
    return failed_url(node.failed_job_id) if failed_url is not None and node.failed_job_id is not None else ""


class WorkflowAdmin(ReadOnlyAdmin):
    list_display = ["id", "name", "state", "nodes_done", "created_at", "cancelled_at"]
    list_display_links = ["id", "name"]
    list_filter = [WorkflowStateFilter]
    search_fields = ["name", "=id"]
    fields = [("id", "name", "state", "nodes_done"), ("created_at", "cancelled_at")]
    change_form_template = "admin/django_dbqueue/workflow_change_form.html"

    def get_queryset(self, request: HttpRequest) -> QuerySet[Workflow]:
        return (  # type: ignore[no-any-return]
            super()
            .get_queryset(request)
            .annotate(
                total=Count("nodes"),
                done=Count("nodes", filter=~Q(nodes__state=NodeState.PENDING)),
                pending=Count("nodes", filter=Q(nodes__state=NodeState.PENDING)),
                stopped=Count("nodes", filter=Q(nodes__state__in=[NodeState.FAILED, NodeState.CANCELLED])),
            )
        )

    def get_urls(self) -> list[Any]:
        view = self.admin_site.admin_view
        return [
            path("<int:pk>/cancel/", view(require_POST(self.cancel_view)), name="django_dbqueue_workflow_cancel"),
            path("<int:pk>/retry/", view(require_POST(self.retry_view)), name="django_dbqueue_workflow_retry"),
            *super().get_urls(),
        ]

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    @admin.display(description="state")
    def state(self, row: Workflow) -> str:
        return str(state_of(row).value)

    @admin.display(description="nodes done", ordering="done")
    def nodes_done(self, row: Any) -> str:
        return f"{row.done}/{row.total}"

    has_cancel_permission = permission("cancel_workflow")

    def has_retry_permission(self, request: HttpRequest) -> bool:
        """The permission to retry failed jobs, as the failed jobs' admin checks it."""
        if not self.admin_site.is_registered(FailedJob):
            return False
        failed_admin = self.admin_site.get_model_admin(FailedJob)
        return bool(getattr(failed_admin, "has_retry_permission", lambda request: False)(request))

    def _button_view(self, request: HttpRequest, pk: int, allowed: Check, press: Press) -> HttpResponse:
        """A button of a workflow's page: refused without permission; ``press`` runs if the workflow exists."""
        if not allowed(request):
            raise PermissionDenied
        if not Workflow.objects.filter(pk=pk).exists():
            messages.warning(request, f"Workflow {pk} no longer exists.")
            return self.redirect("workflow_changelist")
        press(request, pk)
        return self.redirect("workflow_change", pk)

    def cancel_view(self, request: HttpRequest, pk: int) -> HttpResponse:
        return self._button_view(request, pk, self.has_cancel_permission, self._cancel)

    def retry_view(self, request: HttpRequest, pk: int) -> HttpResponse:
        return self._button_view(request, pk, self.has_retry_permission, self._retry)

    def _cancel(self, request: HttpRequest, pk: int) -> None:
        cancelled = workflows.cancel(pk)
        if cancelled is None:
            messages.warning(request, f"Workflow {pk} was cancelled already.")
            return
        message = ngettext(
            "Workflow %(pk)d was cancelled: %(count)d node that had not started was cancelled; running nodes "
            "are asked to stop.",
            "Workflow %(pk)d was cancelled: %(count)d nodes that had not started were cancelled; running nodes "
            "are asked to stop.",
            cancelled,
        )
        messages.success(request, message % {"pk": pk, "count": cancelled})

    def _retry(self, request: HttpRequest, pk: int) -> None:
        count = len(workflows.retry(pk))
        if count:
            message = ngettext(
                "%(count)d node of workflow %(pk)d was put back: it runs once its parents succeed.",
                "%(count)d nodes of workflow %(pk)d were put back: each runs once its parents succeed.",
                count,
            )
            messages.success(request, message % {"count": count, "pk": pk})
        else:
            messages.warning(request, f"Workflow {pk} has no failed or cancelled nodes to retry.")

    def change_view(
        self, request: HttpRequest, object_id: str, form_url: str = "", extra_context: dict[str, Any] | None = None
    ) -> HttpResponse:
        row = self.get_object(request, unquote(object_id))
        extra = {**(extra_context or {}), **(self._graph_context(request, row) if row is not None else {})}
        return super().change_view(request, object_id, form_url, extra_context=extra)

    def _graph_context(self, request: HttpRequest, row: Any) -> dict[str, Any]:
        nodes = workflows.get_workflow(row.pk).nodes()
        state = state_of(row)
        failed_url = (lambda pk: self.url("failedjob_change", pk)) if self.may_view(request, FailedJob) else None
        return {
            "nodes": [{"view": node, "failed_url": _link(failed_url, node)} for node in nodes],
            "graph": graph_svg(nodes, failed_url) if 0 < len(nodes) <= MAX_DRAWN else "",
            "max_drawn": MAX_DRAWN,
            "statuses": STATUSES,
            "can_cancel": self.has_cancel_permission(request) and state == WorkflowState.RUNNING,
            "can_retry": self.has_retry_permission(request) and row.stopped > 0,
        }
