"""Dependencies between jobs: what a workflow node's end does to the nodes after it.

A node's job row is ``blocked`` while one of its edges is not ``done``. When nodes succeed
(``nodes_ended``, a reaction), their edges are marked done and the children left with none
undone are unblocked: two statements per transaction of ended parents, never one row
that every parent updates. Two parents ending at once in separate transactions may each see
the other's edge undone, so the release is tried again after the commit (the last commit sees
every edge) and, for a process killed between the two, by ``sweep``. A node that fails for
good, or is cancelled, cancels the nodes below it that have not started, unless an edge says
``run_anyway``. A retry from ``FailedJob`` brings a node back and its children wait again.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Iterable, Mapping, Sequence
from datetime import timedelta
from typing import Any

from django.db import connections, transaction
from django.db.models import Exists, F, OuterRef, Q
from django.db.models.functions import Greatest

from ..db import DbNow, bound_cursor, cached_sql, notify_ids, notify_queues
from ..models import CANCEL, CANCELLED_CLASS, FailedJob, Job, NodeState, Workflow, WorkflowEdge, WorkflowNode
from ..states import Ended
from .failed import cancel_unstarted

logger = logging.getLogger("django_dbqueue")

PENDING = NodeState.PENDING
# Where the workflows that may have ended are announced (PostgreSQL, at commit), for ``WorkflowHandle.wait``:
# those of nodes with no child that succeeded (also sent by ``dbqueue_release``), failed or were cancelled.
WORKFLOW_ENDED_CHANNEL = "dbqueue_workflow_ended"
# Children released per statement.
CHUNK = 500


def _undone() -> Exists:
    """True for a node (the outer row) with an edge not done."""
    return Exists(WorkflowEdge.objects.filter(child_id=OuterRef("pk"), done=False))


def nodes_ended(using: str, ended: Mapping[str, Sequence[Any]], follow: list[Job]) -> None:
    """Workflow nodes' jobs ended (or came back): release, cancel or hold back the nodes after them."""
    succeeded = sorted({row.node_id for row in ended.get(Ended.SUCCEEDED, ())})
    if succeeded:
        _succeeded(using, succeeded)
    stopped = [*ended.get(Ended.FAILED, ()), *ended.get(Ended.CANCELLED, ())]
    if stopped:
        _stopped(using, stopped)
    back = ended.get(Ended.RETRIED, ())
    if back:
        _retried(using, back)


def _succeeded(using: str, node_ids: Sequence[int]) -> None:
    WorkflowNode.objects.using(using).filter(pk__in=node_ids).update(state=NodeState.SUCCEEDED, finished_at=DbNow())
    _announce(using, WorkflowNode.objects.using(using).filter(pk__in=node_ids, child_edges__isnull=True))
    marked = WorkflowEdge.objects.using(using).filter(parent_id__in=node_ids, done=False).update(done=True)
    if marked and release_children(using, node_ids) < marked:
        # A child still waits: for another parent, or for one ending now in another transaction.
        transaction.on_commit(functools.partial(release_children, using, node_ids), using=using, robust=True)


# -- PostgreSQL: a success and its release in one statement ------------------------


def _names(connection: Any) -> dict[str, str]:
    """Quoted table and column names of the statements below (from the models, never input)."""
    qn = connection.ops.quote_name
    names = {
        "job": qn(Job._meta.db_table),
        "node": qn(WorkflowNode._meta.db_table),
        "edge": qn(WorkflowEdge._meta.db_table),
    }
    for model, prefix in ((Job, "j_"), (WorkflowNode, "n_"), (WorkflowEdge, "e_")):
        names.update({prefix + field.attname: qn(field.column) for field in model._meta.concrete_fields})
    return names


# On PostgreSQL, ``dbqueue_release_chunk(node ids, max_edges)`` (migrations 0015, 0021) marks the
# nodes succeeded and up to ``max_edges`` of their edges done, unblocks the children left with no
# undone edge, and returns how many children may wait for a parent ending beside it (``racing``)
# and whether edges were left (``more``). A function's statements are planned once per server session.
# The statement that deletes the parents' rows releases the first FIRST_CHUNK edges: a wide fan-out
# is released after its commit, a chunk per transaction, each twice the one before (``release_rest``),
# while the other workers run the children released so far.
FIRST_CHUNK = 500
LARGEST_CHUNK = 8000
REPORT = (
    "report AS (SELECT racing, more FROM dbqueue_release_chunk("
    f"ARRAY(SELECT node_id FROM done WHERE node_id IS NOT NULL), {FIRST_CHUNK}))"
)
# The report's columns, after the nodes released: how many may have raced, and whether edges were left.
REPORTED = "(SELECT racing FROM report), (SELECT more FROM report)"


@cached_sql
def _delete_and_release_sql(connection: Any) -> str:
    """Delete the rows whose (id, attempts) are in two arrays, then release their nodes' first chunk."""
    n = _names(connection)
    return (
        f"WITH done AS (DELETE FROM {n['job']} USING unnest(%s::bigint[], %s::bigint[]) AS d (id, attempts) "
        f"WHERE {n['job']}.{n['j_id']} = d.id AND {n['job']}.{n['j_attempts']} = d.attempts "
        f"RETURNING {n['job']}.{n['j_id']} AS id, {n['job']}.{n['j_node_id']} AS node_id), {REPORT} "
        f"SELECT ARRAY(SELECT id FROM done), ARRAY(SELECT node_id FROM done WHERE node_id IS NOT NULL), {REPORTED}"
    )


def released(using: str, nodes: Sequence[int] | None, racing: int, more: bool) -> None:
    """After ``dbqueue_release_chunk``: once committed, release the edges it left (``more``), and try
    the release again if a child may have raced."""
    if not nodes or not (racing or more):
        return
    follow = functools.partial(_after_release, using, nodes, racing, more)
    if connections[using].in_atomic_block:
        transaction.on_commit(follow, using=using, robust=True)
    else:
        # Committed: a parent ending beside this one has committed too, or sees this one.
        follow()


def _after_release(using: str, nodes: Sequence[int], racing: int, more: bool) -> None:
    if more:
        racing += release_rest(using, nodes)
    if racing:
        release_children(using, nodes)


def release_rest(using: str, nodes: Sequence[int]) -> int:
    """Mark the undone edges of ``nodes`` (succeeded) done and release their children, a chunk per
    transaction (each twice the one before, up to LARGEST_CHUNK), until none is left; return how
    many children may have raced. Safe to repeat, and to run beside another release of the same nodes."""
    racing, size, more = 0, FIRST_CHUNK * 2, True
    with bound_cursor(connections[using]) as cursor:
        while more:
            cursor.execute("SELECT racing, more FROM dbqueue_release_chunk(%s::bigint[], %s)", [list(nodes), size])
            raced, more = cursor.fetchone()
            racing += raced
            size = min(size * 2, LARGEST_CHUNK)
    return racing


# A child's node, if pending, by its primary key (LIMIT: not pulled up into a join, which a stale
# estimate of the pending nodes turned into a scan of every node, per release).
_PENDING_CHILD = "SELECT {n_id}, {n_job_id} FROM {node} WHERE {n_id} = e.child_id AND {n_state} = 'pending' LIMIT 1"


@cached_sql
def _release_sql(connection: Any) -> str:
    """``release_children`` in one statement, from the parents' edges (materialized first: planned as a
    semi-join, a stale estimate of the pending nodes made PostgreSQL read them all, 8 ms a release)."""
    n = _names(connection)
    return (
        f"WITH children AS MATERIALIZED (SELECT DISTINCT {n['e_child_id']} AS id FROM {n['edge']} "
        f"WHERE {n['e_parent_id']} = ANY(%s::bigint[])) "
        f"UPDATE {n['job']} SET {n['j_blocked']} = false "
        f"FROM (SELECT id AS child_id FROM children) AS e CROSS JOIN LATERAL ({_PENDING_CHILD.format(**n)}) AS c "
        f"WHERE {n['job']}.{n['j_id']} = c.{n['n_job_id']} AND ("
        f"SELECT u.{n['e_parent_id']} FROM {n['edge']} u WHERE u.{n['e_child_id']} = c.{n['n_id']} "
        f"AND NOT u.{n['e_done']} ORDER BY u.{n['e_parent_id']} DESC LIMIT 1) IS NULL "
        f"AND {n['job']}.{n['j_blocked']} AND {n['job']}.{n['j_reserved_at']} IS NULL "
        f"RETURNING {n['job']}.{n['j_queue']}"
    )


def delete_and_release(using: str, jobs: Sequence[Job]) -> set[int]:
    """``lifecycle.delete_many`` of workflow nodes that succeeded, on PostgreSQL (rows that carry no
    other reaction's column): one statement, and the release again if a child may have raced."""
    connection = connections[using]
    with bound_cursor(connection) as cursor:
        cursor.execute(_delete_and_release_sql(connection), [[job.pk for job in jobs], [job.attempts for job in jobs]])
        deleted, nodes, racing, more = cursor.fetchone()
    released(using, nodes, racing, more)
    return set(deleted)


def release_children(using: str, parent_ids: Iterable[int]) -> int:
    """Unblock the job rows of the children of ``parent_ids`` whose edges are all done (and wake the
    workers listening for their queues); return how many. Safe to repeat: a row already unblocked,
    running or gone is left alone."""
    parent_ids = list(parent_ids)
    connection = connections[using]
    if connection.vendor == "postgresql":
        with bound_cursor(connection) as cursor:
            cursor.execute(_release_sql(connection), [parent_ids])
            queues = [queue for (queue,) in cursor.fetchall()]
        notify_queues(using, queues)
        return len(queues)
    # The children first, by the parents' index: a plan that starts from every pending node costs
    # a drain of a large graph a scan per release.
    edges = WorkflowEdge.objects.using(using).filter(parent_id__in=parent_ids)
    children = sorted(set(edges.values_list("child_id", flat=True)))
    released = 0
    for start in range(0, len(children), CHUNK):
        ready = (
            WorkflowNode.objects.using(using)
            .filter(pk__in=children[start : start + CHUNK], state=PENDING, job_id__isnull=False)
            .filter(~_undone())
            .values("job_id")
        )
        jobs = Job.objects.using(using).filter(pk__in=ready, blocked=True, reserved_at__isnull=True)
        released += jobs.update(blocked=False)
    return released


def adopt(using: str, job_id: int, node_id: int, envelope_text: str | None = None) -> None:
    """Make job ``job_id`` the job of node ``node_id`` (``depends_on`` on a job enqueued before), with
    ``envelope_text`` as its payload if given and nobody holds it yet."""
    Job.objects.using(using).filter(pk=job_id).update(node_id=node_id)
    if envelope_text is not None:
        Job.objects.using(using).filter(pk=job_id, reserved_at__isnull=True).update(payload=envelope_text)


def _stopped(using: str, rows: Sequence[Any]) -> None:
    """Nodes whose jobs failed for good or were cancelled: record why, then cancel what they held back."""
    jobs = {row.pk: row.node_id for row in rows}
    found = (
        FailedJob.objects.using(using).filter(job_id__in=list(jobs)).values_list("job_id", "exception_class", "error")
    )
    reasons = {pk: (exception_class, error) for pk, exception_class, error in found}
    for pk, node_id in jobs.items():
        exception_class, error = reasons.get(pk, ("", ""))
        state = NodeState.CANCELLED if exception_class == CANCELLED_CLASS else NodeState.FAILED
        WorkflowNode.objects.using(using).filter(pk=node_id, state=PENDING).update(
            state=state, error=_last_line(error), finished_at=DbNow()
        )
    cancel_below(using, sorted(set(jobs.values())))
    _announce(using, WorkflowNode.objects.using(using).filter(pk__in=list(jobs.values())))


def _announce(using: str, nodes: Any) -> None:
    """Send the workflows of ``nodes`` (a query) on ``WORKFLOW_ENDED_CHANNEL`` (PostgreSQL: nothing read elsewhere)."""
    if connections[using].vendor == "postgresql":
        notify_ids(using, WORKFLOW_ENDED_CHANNEL, set(nodes.values_list("workflow_id", flat=True)))


def cancel_below(using: str, node_ids: Sequence[int], *, everything: bool = False) -> int:
    """Cancel the pending nodes that wait for ``node_ids`` (which ended badly), level by level, except
    across ``run_anyway`` edges (unless ``everything``), whose children may run now; return how many."""
    names = dict(WorkflowNode.objects.using(using).filter(pk__in=node_ids).values_list("pk", "name"))
    frontier, cancelled, anyway = list(node_ids), 0, []
    while frontier:
        edges = list(
            WorkflowEdge.objects.using(using)
            .filter(parent_id__in=frontier, child__state=PENDING)
            .values_list("parent_id", "child_id", "run_anyway", "child__job_id")
        )
        if not everything:
            spared = {(parent, child) for parent, child, run_anyway, _ in edges if run_anyway}
            if spared:
                WorkflowEdge.objects.using(using).filter(
                    parent_id__in={parent for parent, _ in spared}, run_anyway=True, done=False
                ).update(done=True)
                anyway += [parent for parent, _ in spared]
        doomed: dict[int, tuple[int | None, int]] = {}
        for parent, child, run_anyway, job_id in edges:
            if everything or not run_anyway:
                doomed.setdefault(child, (job_id, parent))
        if not doomed:
            break
        because: dict[int, str] = {
            job_id: names.get(parent, str(parent)) for job_id, parent in doomed.values() if job_id
        }

        def error(job: Job, because: dict[int, str] = because) -> str:
            return (
                f"{job.name} (job {job.pk}) was cancelled before it ran: "
                f"its parent {because.get(job.pk, '?')!r} did not succeed."
            )

        moved = cancel_unstarted([job_id for job_id, _ in doomed.values() if job_id], error, using)
        # A child running already (only across a cancelled workflow): asked to stop.
        Job.objects.using(using).filter(
            pk__in=[job_id for job_id, _ in doomed.values() if job_id], reserved_at__isnull=False
        ).update(cancel=Greatest(F("cancel"), CANCEL))
        WorkflowNode.objects.using(using).filter(pk__in=list(doomed), state=PENDING).update(
            state=NodeState.CANCELLED,
            error="cancelled: a node before it did not succeed",
            finished_at=DbNow(),
        )
        cancelled += len(moved)
        names.update(WorkflowNode.objects.using(using).filter(pk__in=list(doomed)).values_list("pk", "name"))
        frontier = list(doomed)
    if anyway:
        release_children(using, anyway)
        transaction.on_commit(functools.partial(release_children, using, anyway), using=using, robust=True)
    return cancelled


def _retried(using: str, jobs: Sequence[Job]) -> None:
    """Nodes retried from ``FailedJob`` (``jobs``: their new rows): pending again, and their children wait for them."""
    for job in jobs:
        WorkflowNode.objects.using(using).filter(pk=job.node_id).update(
            state=PENDING, job_id=job.pk, error="", finished_at=None
        )
    node_ids = sorted({job.node_id for job in jobs if job.node_id is not None})
    WorkflowEdge.objects.using(using).filter(parent_id__in=node_ids).update(done=False)
    # A parent that ended badly and is not retried with it: the operator chose to run the node anyway.
    WorkflowEdge.objects.using(using).filter(child_id__in=node_ids, done=False).exclude(parent__state=PENDING).exclude(
        parent__state=NodeState.SUCCEEDED
    ).update(done=True)
    waiting = WorkflowNode.objects.using(using).filter(pk__in=node_ids).filter(_undone()).values("job_id")
    Job.objects.using(using).filter(pk__in=waiting, reserved_at__isnull=True).update(blocked=True)


def cancel_workflow(workflow_id: int, using: str) -> int | None:
    """Mark a workflow cancelled and cancel its nodes that have not started (those running are asked
    to stop); return how many were cancelled, or None if it was cancelled already."""
    with transaction.atomic(using=using):
        if (
            not Workflow.objects.using(using)
            .filter(pk=workflow_id, cancelled_at__isnull=True)
            .update(cancelled_at=DbNow())
        ):
            return None
        nodes = dict(
            WorkflowNode.objects.using(using).filter(workflow_id=workflow_id, state=PENDING).values_list("job_id", "pk")
        )
        moved = cancel_unstarted(
            [pk for pk in nodes if pk is not None],
            lambda job: f"{job.name} (job {job.pk}) was cancelled before it ran: its workflow was cancelled.",
            using,
        )
        WorkflowNode.objects.using(using).filter(pk__in=[nodes[row.pk] for row in moved]).update(
            state=NodeState.CANCELLED, error="cancelled: the workflow was cancelled", finished_at=DbNow()
        )
        Job.objects.using(using).filter(pk__in=[pk for pk in nodes if pk], reserved_at__isnull=False).update(
            cancel=Greatest(F("cancel"), CANCEL)
        )
        notify_ids(using, WORKFLOW_ENDED_CHANNEL, [workflow_id])
    logger.info("workflow cancelled id=%s nodes_cancelled=%s", workflow_id, len(moved))
    return len(moved)


def sweep(using: str) -> int:
    """Release the nodes a lost recheck or an interrupted release (``release_rest``) left blocked,
    and end the nodes whose jobs ended unseen (a job adopted while running); return how many rows
    changed. Idle workers call it now and then."""
    changed = 0
    adopted = list(
        WorkflowNode.objects.using(using)
        .filter(adopted=True, state=PENDING, job_id__isnull=False)
        .filter(~Exists(Job.objects.filter(pk=OuterRef("job_id"))))
        .values_list("pk", "job_id")
    )
    if adopted:
        failed = set(
            FailedJob.objects.using(using).filter(job_id__in=[pk for _, pk in adopted]).values_list("job_id", flat=True)
        )
        with transaction.atomic(using=using):
            gone_well = [node for node, job in adopted if job not in failed]
            if gone_well:
                _succeeded(using, gone_well)
            stopped = [Job(pk=job, node_id=node) for node, job in adopted if job in failed]
            if stopped:
                _stopped(using, stopped)
        changed += len(adopted)
    if connections[using].vendor == "postgresql":
        # A wide fan-out whose release stopped between two chunks (its worker killed): the rest.
        cut = list(
            WorkflowEdge.objects.using(using)
            .filter(done=False, parent__state=NodeState.SUCCEEDED)
            .values_list("parent_id", flat=True)
            .distinct()[:CHUNK]
        )
        if cut:
            release_rest(using, cut)
            changed += len(cut)
    ready = (
        WorkflowNode.objects.using(using)
        .filter(state=PENDING, job_id__isnull=False)
        .filter(~_undone(), Q(parent_edges__isnull=False))
        .values("job_id")
    )
    changed += (
        Job.objects.using(using).filter(pk__in=ready, blocked=True, reserved_at__isnull=True).update(blocked=False)
    )
    return changed


def prune_workflows(hours: float, using: str | None = None) -> int:
    """Delete the workflows whose nodes all ended more than ``hours`` ago (with their nodes and
    edges, in one transaction each, a hundred at a time); return how many."""
    using = using or Workflow.objects.get_queryset().db
    cutoff = DbNow() - timedelta(hours=hours)
    recent = WorkflowNode.objects.filter(workflow_id=OuterRef("pk")).filter(
        Q(state=PENDING) | Q(finished_at__gte=cutoff) | Q(finished_at__isnull=True)
    )
    old = Workflow.objects.using(using).filter(created_at__lt=cutoff).filter(~Exists(recent)).order_by("id")
    deleted = 0
    while ids := list(old.values_list("pk", flat=True)[:100]):
        with transaction.atomic(using=using):
            WorkflowEdge.objects.using(using).filter(child__workflow_id__in=ids)._raw_delete(using)
            WorkflowNode.objects.using(using).filter(workflow_id__in=ids)._raw_delete(using)
            deleted += Workflow.objects.using(using).filter(pk__in=ids)._raw_delete(using) or 0
    return deleted


def _last_line(text: str) -> str:
    lines = [line.strip() for line in (text or "").strip().splitlines() if line.strip()]
    return lines[-1][:1000] if lines else ""
