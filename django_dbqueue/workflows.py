"""Workflows: a graph of jobs stored in one transaction, each node running once its parents succeeded.

``wf = workflow("order 42")``, then ``wf.add("charge", charge.bind(42))``,
``wf.add("receipt", receipt.bind(42), after=["charge"])`` and ``wf.enqueue()`` store a
``Workflow`` row, a node and a job row per call and an edge per ``after`` name. A node's row is
``blocked`` until every parent succeeded (``lifecycle.dependencies`` releases it), so the claim
does not change. ``enqueue_after`` adds one job after jobs enqueued earlier (``depends_on``).
Here: declaring, storing, the handle, and the results a node receives from its parents.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime, timedelta
from typing import Any

from asgiref.sync import sync_to_async
from django.db import connections, transaction
from django.db.models import Count

from . import insert, lifecycle, payload, registry, rows, unique, validation
from .db import DbNow, alias, read_back
from .exceptions import WaitTimeout
from .handles import KEEP_RESULT, JobHandle, await_until, refuse_endless_wait_in_job, wait_seconds, wait_until
from .models import (
    FailedJob,
    Job,
    NodeState,
    TaskResultRecord,
    Workflow,
    WorkflowEdge,
    WorkflowNode,
    record_id,
    workflow_state,
)
from .registry import JobCall, JobDefinition
from .signals import job_enqueued
from .states import JobStatus, WorkflowState

logger = logging.getLogger("django_dbqueue")

# The keyword a node with ``pass_results`` is called with: ``{parent name: its result}``.
RESULTS_ARGUMENT = "results"
# Envelope keys of a node's job: its parents (name -> node id), read when it passes results.
PARENTS_KEY = "parents"


class CycleError(ValueError):
    """A workflow's edges make a cycle; ``cycle`` names its nodes in order, the first again at the end."""

    def __init__(self, message: str, cycle: Sequence[str]) -> None:
        super().__init__(message)
        self.cycle = list(cycle)


@dataclasses.dataclass(frozen=True)
class Node:
    """One job of a workflow as declared: its name, call and the names it runs after."""

    name: str
    call: JobCall
    after: tuple[str, ...] = ()
    # Parents whose failure does not cancel this node: it runs once they ended, whichever way.
    run_anyway: frozenset[str] = frozenset()
    pass_results: bool = False


def _as_call(
    item: JobCall | JobDefinition[..., Any],
    pass_results: bool,
    args: tuple[Any, ...] = (),
    kwargs: Mapping[str, Any] | None = None,
) -> JobCall:
    if isinstance(item, JobDefinition):
        # Not bound: its arguments are checked below with the results it will get.
        call = JobCall(item, tuple(args), dict(kwargs or {}))
    elif isinstance(item, JobCall):
        if args or kwargs:
            raise TypeError(f"{item.definition.name}: pass arguments to bind(...) or to add(...), not to both")
        call = item
    else:
        raise TypeError(f"a workflow node must be a job call such as my_job.bind(...), not {item!r}")
    definition = call.definition
    kwargs = {**call.kwargs, RESULTS_ARGUMENT: {}} if pass_results else call.kwargs
    if pass_results and RESULTS_ARGUMENT in call.kwargs:
        raise TypeError(f"{definition.name}: pass_results passes {RESULTS_ARGUMENT}=...; do not bind it too")
    error = validation.call_error(definition.func, call.args, kwargs, takes_context=definition.takes_context)
    if error is not None:
        hint = f" (pass_results calls it with {RESULTS_ARGUMENT}={{parent name: result}})" if pass_results else ""
        raise TypeError(f"Cannot add {definition.name} to a workflow: {error}{hint}")
    if unique.scope(definition) is not None or definition.unique_for is not None:
        raise TypeError(
            f"Cannot add {definition.name} to a workflow: it is a unique job, and a node whose key is held "
            "could not be left out of the graph. Use .using(unique=False) for the node."
        )
    return call


class WorkflowBuilder:
    """A graph of jobs being declared: ``add`` nodes, then ``enqueue`` it; build it with ``workflow(name)``."""

    def __init__(self, name: str = "") -> None:
        if not isinstance(name, str) or len(name) > 200:
            raise ValueError(f"a workflow's name is text of at most 200 characters, not {name!r}")
        self.name = name
        self.nodes: dict[str, Node] = {}

    def add(
        self,
        name: str,
        call: JobCall | JobDefinition[..., Any],
        /,
        *args: Any,
        after: Iterable[str] = (),
        run_anyway: Iterable[str] = (),
        pass_results: bool = False,
        **kwargs: Any,
    ) -> str:
        """Add a node that runs ``call`` once the nodes named in ``after`` succeeded; return its name.

        ``call``: ``my_job.bind(...)``, or ``my_job`` with its arguments after it (the form for a job
        whose ``results`` parameter has no default). ``run_anyway``: parents (among ``after``) whose
        failure or cancel does not cancel this node. ``pass_results``: call it with
        ``results={parent name: result}`` (its parents keep their results). A name in ``after`` may
        be added later; ``enqueue`` refuses a name never added, and a cycle.
        """
        if not isinstance(name, str) or not name or len(name) > 200:
            raise ValueError(f"a node's name is text of 1 to 200 characters, not {name!r}")
        if name in self.nodes:
            raise ValueError(f"workflow {self.name!r} has a node named {name!r} already")
        parents = tuple(dict.fromkeys(after if not isinstance(after, str) else [after]))
        anyway = frozenset([run_anyway] if isinstance(run_anyway, str) else run_anyway)
        if name in parents:
            raise CycleError(f"node {name!r} cannot run after itself", [name, name])
        if not anyway <= set(parents):
            raise ValueError(
                f"run_anyway names parents of {name!r} it does not run after: {sorted(anyway - set(parents))}"
            )
        if pass_results and not parents:
            raise ValueError(f"node {name!r} passes results but runs after no node")
        self.nodes[name] = Node(name, _as_call(call, pass_results, args, kwargs), parents, anyway, pass_results)
        return name

    def order(self) -> list[Node]:
        """The nodes with each after its parents (Kahn's order); raise ``CycleError`` naming a cycle."""
        for node in self.nodes.values():
            missing = [parent for parent in node.after if parent not in self.nodes]
            if missing:
                raise ValueError(
                    f"node {node.name!r} runs after {missing[0]!r}, which is not in workflow {self.name!r}"
                )
        left = {name: len(node.after) for name, node in self.nodes.items()}
        children: dict[str, list[str]] = {name: [] for name in self.nodes}
        for node in self.nodes.values():
            for parent in node.after:
                children[parent].append(node.name)
        ready = [name for name, count in left.items() if count == 0]
        ordered: list[Node] = []
        while ready:
            name = ready.pop(0)
            ordered.append(self.nodes[name])
            for child in children[name]:
                left[child] -= 1
                if left[child] == 0:
                    ready.append(child)
        if len(ordered) < len(self.nodes):
            cycle = _a_cycle({name: self.nodes[name].after for name, count in left.items() if count})
            raise CycleError(f"workflow {self.name!r} has a cycle: {' -> '.join(cycle)}", cycle)
        return ordered

    def enqueue(self) -> WorkflowHandle:
        """Store the workflow, its nodes, jobs and edges in one transaction (the caller's, if open); return a handle."""
        if not self.nodes:
            raise ValueError(f"workflow {self.name!r} has no node")
        ordered = self.order()
        using = alias()
        with transaction.atomic(using=using, savepoint=False):
            row = Workflow(name=self.name, created_at=DbNow())
            row.save(force_insert=True, using=using)
            read_back(row, "created_at")
            nodes = _store_nodes(using, row, ordered)
            _store_jobs(using, nodes, ordered)
            WorkflowEdge.objects.using(using).bulk_create(
                [
                    WorkflowEdge(parent=nodes[parent], child=nodes[node.name], run_anyway=parent in node.run_anyway)
                    for node in ordered
                    for parent in node.after
                ]
            )
        logger.info("enqueued workflow id=%s name=%s nodes=%s", row.pk, row.name or "-", len(nodes))
        return WorkflowHandle(row)


def workflow(name: str = "") -> WorkflowBuilder:
    """Start declaring a workflow: ``wf = workflow("order 42"); wf.add(...); wf.enqueue()``."""
    return WorkflowBuilder(name)


def _a_cycle(edges: Mapping[str, Sequence[str]]) -> list[str]:
    """A cycle among ``edges`` (node -> parents, every node on or behind a cycle), parent first."""
    path: list[str] = []
    seen: dict[str, int] = {}
    name = next(iter(edges))
    while name not in seen:
        seen[name] = len(path)
        path.append(name)
        name = next(parent for parent in edges[name] if parent in edges)
    cycle = [*path[seen[name] :], name]
    return list(reversed(cycle))


def _store_nodes(using: str, row: Workflow, ordered: Sequence[Node]) -> dict[str, WorkflowNode]:
    made = WorkflowNode.objects.using(using).bulk_create(
        [
            WorkflowNode(
                workflow=row, name=node.name, job_name=node.call.definition.name, pass_results=node.pass_results
            )
            for node in ordered
        ]
    )
    if any(node.pk is None for node in made):  # MySQL returns no ids from a bulk insert
        ids = dict(WorkflowNode.objects.using(using).filter(workflow=row).values_list("name", "pk"))
        for node in made:
            node.pk = ids[node.name]
    return {node.name: node for node in made}


def _store_jobs(using: str, nodes: Mapping[str, WorkflowNode], ordered: Sequence[Node]) -> None:
    """Insert a job row per node (blocked if it has parents) and point each node at its row."""
    read = {parent for node in ordered if node.pass_results for parent in node.after}
    checked: set[tuple[str, str]] = set()
    jobs = []
    for node in ordered:
        new, _ = rows.prepare(node.call, checked=checked)
        extra: dict[str, Any] = {}
        if node.name in read:
            extra[KEEP_RESULT] = True
        if node.pass_results:
            extra[PARENTS_KEY] = {parent: nodes[parent].pk for parent in node.after}
        if extra:
            envelope = payload.raw(new.payload)
            envelope.update(extra)
            new = new._replace(payload=payload.dumps(envelope))
            payload.check_size(new.name, new.payload)
        job = new.to_job()
        job.node_id = nodes[node.name].pk
        job.blocked = bool(node.after)
        jobs.append(job)
    if connections[using].features.can_return_rows_from_bulk_insert:
        stored = insert.bulk_enqueue(jobs, using)
    else:  # MySQL: one INSERT per row, for the ids
        stored = [job for job in insert.insert_each(jobs, using) if job is not None]
    for node, job in zip(ordered, stored, strict=True):
        nodes[node.name].job_id = job.pk
    # In small statements: one CASE of thousands of ids costs PostgreSQL seconds.
    WorkflowNode.objects.using(using).bulk_update(list(nodes.values()), ["job_id"], batch_size=200)
    if job_enqueued.has_listeners(JobDefinition):
        for job in stored:
            job_enqueued.send_robust(sender=JobDefinition, job=job)


# -- one job after others ---------------------------------------------------------


def enqueue_after(
    parents: Sequence[Any],
    call: JobCall | JobDefinition[..., Any],
    *,
    run_anyway: bool = False,
    pass_results: bool = False,
) -> JobHandle:
    """Enqueue ``call`` to run once every job of ``parents`` (handles, or job ids) succeeded; return its
    handle. ``run_anyway``: once they ended, whichever way. A parent that failed already cancels it at
    once. ``pass_results``: call it with ``results={"job <id>": result}``; a parent that started before
    this call passes its result only if it keeps results (``@job(results=True)``)."""
    ids = [int(getattr(parent, "job_id", None) or getattr(parent, "id", parent)) for parent in parents]
    if not ids:
        raise ValueError("enqueue_after needs at least one job to run after")
    after = tuple(f"job {pk}" for pk in ids)
    child = Node(
        "job", _as_call(call, pass_results), after, frozenset(after) if run_anyway else frozenset(), pass_results
    )
    using = alias()
    with transaction.atomic(using=using, savepoint=False):
        row = Workflow(name=f"after {', '.join(map(str, ids))}"[:200], created_at=DbNow())
        row.save(force_insert=True, using=using)
        read_back(row, "created_at")
        parent_nodes = [_adopt(using, row, pk, keep=pass_results) for pk in ids]
        nodes = {**dict(zip(after, parent_nodes, strict=True)), **_store_nodes(using, row, [child])}
        _store_jobs(using, nodes, [child])
        WorkflowEdge.objects.using(using).bulk_create(
            [WorkflowEdge(parent=node, child=nodes["job"], run_anyway=run_anyway) for node in parent_nodes]
        )
        job_id = nodes["job"].job_id
        # Parents that ended already: told now, as their ends would have been.
        good = [node.pk for node in parent_nodes if node.state == NodeState.SUCCEEDED]
        bad = [node.pk for node in parent_nodes if node.state in (NodeState.FAILED, NodeState.CANCELLED)]
        if good:
            WorkflowEdge.objects.using(using).filter(parent_id__in=good, child=nodes["job"]).update(done=True)
        if bad:
            lifecycle.dependencies.cancel_below(using, bad)
        if good or bad:
            lifecycle.release_children(using, good + bad)
    assert job_id is not None
    return JobHandle.get(job_id)


def _adopt(using: str, row: Workflow, job_id: int, *, keep: bool = False) -> WorkflowNode:
    """The node of job ``job_id``: its own if it is one; else a node of ``row`` made for it, its
    row marked (an ended job's node is made ended). ``keep``: a job not started keeps its result."""
    job = (
        Job.objects.using(using)
        .filter(pk=job_id)
        .select_for_update()
        .only("id", "name", "node_id", "reserved_at", "payload")
        .first()
    )
    text = None
    if job is not None and keep and job.reserved_at is None:
        envelope = payload.raw(job.payload)
        if not envelope.get(KEEP_RESULT):
            text = payload.dumps({**envelope, KEEP_RESULT: True})
    if job is not None and job.node_id is not None:
        own: WorkflowNode | None = WorkflowNode.objects.using(using).filter(pk=job.node_id).first()
        if own is not None:
            if text is not None:
                lifecycle.dependencies.adopt(using, job.pk, own.pk, text)
            return own
    handle = JobHandle(id=job_id)
    handle.refresh()
    if job is None and handle.status == JobStatus.WAITING and not handle.name:
        raise ValueError(f"there is no job {job_id} to run after")
    state = {
        JobStatus.SUCCEEDED: NodeState.SUCCEEDED,
        JobStatus.FAILED: NodeState.FAILED,
        JobStatus.CANCELLED: NodeState.CANCELLED,
    }.get(handle.status, NodeState.PENDING)
    node = WorkflowNode(
        workflow=row,
        name=f"job {job_id}",
        job_name=handle.name or (job.name if job else ""),
        job_id=handle.job_id,
        state=state,
        adopted=job is not None and job.reserved_at is not None,
    )
    node.save(force_insert=True, using=using)
    if job is not None:
        lifecycle.dependencies.adopt(using, job.pk, node.pk, text)
    return node


# -- what a node receives -----------------------------------------------------------


def passed_results(envelope: Mapping[str, Any]) -> dict[str, Any]:
    """The keyword arguments a node's job gets besides its own: ``results`` if it passes them."""
    parents = envelope.get(PARENTS_KEY)
    if not isinstance(parents, dict):
        return {}
    return {RESULTS_ARGUMENT: parent_results(parents)}


def parent_results(parents: Mapping[str, int]) -> dict[str, Any]:
    """``{parent name: its kept result}`` for parents named with their node ids (None for one not kept)."""
    jobs = dict(WorkflowNode.objects.filter(pk__in=list(parents.values())).values_list("pk", "job_id"))
    keys = {record_id(pk): pk for pk in jobs.values() if pk is not None}
    records = dict(TaskResultRecord.objects.filter(pk__in=list(keys)).values_list("pk", "return_value"))
    names = dict(WorkflowNode.objects.filter(pk__in=list(parents.values())).values_list("pk", "job_name"))
    results = {}
    for name, node_id in parents.items():
        job_id = jobs.get(node_id)
        value = records.get(record_id(job_id)) if job_id is not None else None
        results[name] = _decode(names.get(node_id, ""), value)
    return results


def _decode(name: str, value: Any) -> Any:
    if value is None:
        return None
    definition = registry.find(name) if name else None
    envelope = payload.decode(json.dumps({"args": [value], "kwargs": {}}))
    return payload.arguments(envelope, definition.func if definition else None, result=True)[0][0]


# -- the handle -------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class NodeView:
    """A node as it stands: ``status`` is ``blocked`` (waiting for parents) or a ``JobStatus``."""

    id: int
    name: str
    job_name: str
    job_id: int | None
    status: str
    error: str
    parents: tuple[str, ...]
    run_anyway: tuple[str, ...]
    finished_at: datetime | None
    failed_job_id: int | None = None


class WorkflowHandle:
    """A workflow as its caller follows it: its state and nodes now; ``wait``, ``cancel``, ``retry``."""

    def __init__(self, row: Workflow) -> None:
        self._row = row
        self._counts: dict[str, int] = {}
        self._read_counts()

    def __repr__(self) -> str:
        return f"<WorkflowHandle id={self.id} name={self.name!r} state={self.state}>"

    @property
    def id(self) -> int:
        return int(self._row.pk)

    @property
    def pk(self) -> int:
        return self.id

    @property
    def name(self) -> str:
        return self._row.name

    @property
    def created_at(self) -> datetime:
        return self._row.created_at

    @property
    def cancelled_at(self) -> datetime | None:
        return self._row.cancelled_at

    @property
    def counts(self) -> dict[str, int]:
        """Nodes by ``NodeState``: pending, succeeded, failed, cancelled."""
        return dict(self._counts)

    @property
    def state(self) -> WorkflowState:
        return workflow_state(self._row.cancelled_at is not None, self._counts)

    @property
    def finished(self) -> bool:
        return self._counts.get(NodeState.PENDING, 0) == 0

    def _read_counts(self) -> None:
        counts = WorkflowNode.objects.filter(workflow_id=self.id).order_by().values("state").annotate(n=Count("id"))
        self._counts = {row["state"]: row["n"] for row in counts}

    def refresh(self) -> WorkflowHandle:
        """Read the workflow and its nodes' states again."""
        self._row = Workflow.objects.get(pk=self.id)
        self._read_counts()
        return self

    async def arefresh(self) -> WorkflowHandle:
        return await sync_to_async(self.refresh)()

    def node(self, name: str) -> JobHandle:
        """The handle of the node named ``name`` (its job, followed through retries)."""
        row = WorkflowNode.objects.filter(workflow_id=self.id, name=name).values_list("job_id", flat=True).first()
        if row is None:
            raise KeyError(f"workflow {self.id} has no node named {name!r}")
        return JobHandle.get(row)

    def __getitem__(self, name: str) -> JobHandle:
        return self.node(name)

    @property
    def results(self) -> dict[str, Any]:
        """``{node name: result}`` of the nodes whose results were kept."""
        nodes = dict(WorkflowNode.objects.filter(workflow_id=self.id).values_list("name", "pk"))
        return parent_results(nodes)

    def nodes(self) -> list[NodeView]:
        """Every node as it stands now, in the order declared (three queries, whatever the size)."""
        nodes = list(WorkflowNode.objects.filter(workflow_id=self.id).order_by("id"))
        edges = WorkflowEdge.objects.filter(child__workflow_id=self.id).values_list(
            "parent__name", "child_id", "run_anyway"
        )
        parents: dict[int, list[str]] = {}
        anyway: dict[int, list[str]] = {}
        for parent, child, run_anyway in edges:
            parents.setdefault(child, []).append(parent)
            if run_anyway:
                anyway.setdefault(child, []).append(parent)
        job_ids = [node.job_id for node in nodes if node.job_id is not None]
        live = {
            row["pk"]: row
            for row in Job.objects.filter(pk__in=job_ids)
            .annotate(clock=DbNow())
            .values("pk", "blocked", "reserved_at", "available_at", "clock")
        }
        failed = dict(FailedJob.objects.filter(job_id__in=job_ids).order_by("id").values_list("job_id", "pk"))
        views = []
        for node in nodes:
            row = live.get(node.job_id) if node.job_id is not None else None
            if node.state != NodeState.PENDING or row is None:
                status = node.state if node.state != NodeState.PENDING else JobStatus.RUNNING
            elif row["reserved_at"] is not None:
                status = JobStatus.RUNNING
            elif row["blocked"]:
                status = "blocked"
            else:
                status = JobStatus.DELAYED if row["available_at"] > row["clock"] else JobStatus.WAITING
            views.append(
                NodeView(
                    node.pk, node.name, node.job_name, node.job_id, str(status), node.error,
                    tuple(parents.get(node.pk, ())), tuple(anyway.get(node.pk, ())), node.finished_at,
                    failed.get(node.job_id) if node.job_id is not None else None,
                )
            )  # fmt: skip
        return views

    def cancel(self) -> int:
        """Cancel the nodes that have not started (those running are asked to stop); return how many."""
        cancelled = lifecycle.cancel_workflow(self.id, alias())
        self.refresh()
        return cancelled or 0

    async def acancel(self) -> int:
        return await sync_to_async(self.cancel)()

    def retry(self) -> list[Job]:
        """Put the failed and cancelled nodes back (each waits for its parents again); return their new rows."""
        return retry(self.id)

    def wait(self, timeout: float | timedelta | None = None) -> WorkflowHandle:
        """Block until every node ended and return this handle, read again; after ``timeout`` seconds
        raise ``WaitTimeout`` and leave the workflow alone. Read with backoff (10 ms, doubling to
        0.5 s), woken on PostgreSQL when a node with no child, or any node that did not succeed, ends."""
        wait_until(
            self._read_finished, self._timed_out, self._checked_timeout(timeout), channel=_ended_channel, ids=self._ids
        )
        return self

    async def wait_async(self, timeout: float | timedelta | None = None) -> WorkflowHandle:
        """``wait`` for async code: ``await handle.wait_async(timeout=60)``; the event loop runs on."""
        seconds = self._checked_timeout(timeout)
        await await_until(sync_to_async(self._read_finished), self._timed_out, seconds)
        return self

    def _ids(self) -> set[int | None]:
        return {self.id}

    def _checked_timeout(self, timeout: float | timedelta | None) -> float | None:
        """``timeout`` in seconds; refuse a wait without one inside a job (the nodes may need its slot)."""
        seconds = wait_seconds(timeout)
        refuse_endless_wait_in_job(f"workflow {self.id}", "its nodes", seconds)
        return seconds

    def _read_finished(self) -> bool:
        return self.refresh().finished

    def _timed_out(self, seconds: float) -> Exception:
        return WaitTimeout(
            f"workflow {self.id} ({self.name or 'unnamed'}) is still {self.state} after {seconds} s; "
            "it was left as it is",
            job_id=self.id,
            status=str(self.state),
        )


def _ended_channel() -> str:
    return lifecycle.WORKFLOW_ENDED_CHANNEL


def get_workflow(workflow_id: int) -> WorkflowHandle:
    """Return the handle of workflow ``workflow_id``, from any process."""
    return WorkflowHandle(Workflow.objects.get(pk=workflow_id))


def cancel(workflow_id: int) -> int | None:
    """Cancel a workflow's nodes that have not started; None if it was cancelled already."""
    return lifecycle.cancel_workflow(workflow_id, alias())


def retry(workflow_id: int) -> list[Job]:
    """Retry a workflow from its failed nodes: the failed and cancelled nodes back, each waiting for its
    parents again; the workflow is no longer cancelled. Return the new job rows."""
    using = alias()
    with transaction.atomic(using=using):
        Workflow.objects.using(using).filter(pk=workflow_id).update(cancelled_at=None)
        stopped = WorkflowNode.objects.using(using).filter(
            workflow_id=workflow_id, state__in=[NodeState.FAILED, NodeState.CANCELLED]
        )
        return lifecycle.retry(FailedJob.objects.using(using).filter(job_id__in=stopped.values("job_id")))
