"""The workflow tables: a graph of jobs (nodes) and the edges between them, and durable steps.

A node's job row exists from the workflow's enqueue; while one of its edges is not ``done`` the row
is ``blocked`` and no claim takes it. Each edge is written by its parent's end only, so a fan-in of
many parents into one child updates many rows once each, never one row many times (no hot row).
"""

from __future__ import annotations

from typing import Any

from django.db import models
from django.db.models import Exists, OuterRef, Q

from ..states import WorkflowState
from .jobs import QueueDatabaseManager


class NodeState(models.TextChoices):
    """Where a workflow's node is; ``pending``: its job has not ended (blocked, waiting or running)."""

    PENDING = "pending", "pending"
    SUCCEEDED = "succeeded", "succeeded"
    FAILED = "failed", "failed"
    CANCELLED = "cancelled", "cancelled"


def _nodes(condition: Q) -> Exists:
    return Exists(WorkflowNode.objects.filter(condition, workflow_id=OuterRef("pk")))


def _in_sql() -> dict[str, Q]:
    """Each ``WorkflowState`` in SQL, as ``WorkflowHandle.state`` reads it from the nodes' counts."""
    pending = Q(state=NodeState.PENDING)
    stopped = Q(state__in=[NodeState.FAILED, NodeState.CANCELLED])
    running, cancelled = Q(cancelled_at__isnull=True), Q(cancelled_at__isnull=False)
    return {
        WorkflowState.RUNNING: running & Q(_nodes(pending)),
        WorkflowState.SUCCEEDED: running & ~Q(_nodes(pending | stopped)),
        WorkflowState.FAILED: running & ~Q(_nodes(pending)) & Q(_nodes(stopped)),
        WorkflowState.CANCELLING: cancelled & Q(_nodes(pending)),
        WorkflowState.CANCELLED: cancelled & ~Q(_nodes(pending)),
    }


class WorkflowQuerySet(models.QuerySet["Workflow"]):
    def in_state(self, *states: str) -> WorkflowQuerySet:
        """The workflows in any of ``states`` (``WorkflowState`` values)."""
        condition = Q(pk__in=[])
        chosen = _in_sql()
        for state in dict.fromkeys(states):
            condition |= chosen[WorkflowState(state)]
        return self.filter(condition)


def workflow_state(cancelled: bool, counts: dict[str, Any]) -> WorkflowState:
    """A workflow's state from its nodes' counts by ``NodeState`` (missing: 0) and whether it was cancelled."""
    pending = counts.get(NodeState.PENDING, 0)
    if cancelled:
        return WorkflowState.CANCELLING if pending else WorkflowState.CANCELLED
    if pending:
        return WorkflowState.RUNNING
    bad = counts.get(NodeState.FAILED, 0) + counts.get(NodeState.CANCELLED, 0)
    return WorkflowState.FAILED if bad else WorkflowState.SUCCEEDED


class Workflow(models.Model):
    """A graph of jobs enqueued in one transaction (workflows.py); its state is its nodes'."""

    id = models.BigAutoField(primary_key=True)
    name = models.CharField(max_length=200, blank=True, default="")
    created_at = models.DateTimeField()
    cancelled_at = models.DateTimeField(null=True, blank=True)

    objects = QueueDatabaseManager.from_queryset(WorkflowQuerySet)()

    class Meta:
        db_table = "dbqueue_workflow"
        verbose_name = "workflow"
        ordering = ["-created_at", "-id"]
        indexes = [models.Index(fields=["created_at"], name="dbqueue_workflow_created")]
        permissions = [("cancel_workflow", "Can cancel workflows")]

    def __str__(self) -> str:
        return f"{self.name or 'workflow'} #{self.pk}"


class WorkflowNode(models.Model):
    """One job of a workflow, under a name unique in it; ``job_id``: the row that runs it now."""

    id = models.BigAutoField(primary_key=True)
    workflow = models.ForeignKey(Workflow, on_delete=models.CASCADE, related_name="nodes")
    name = models.CharField(max_length=200)
    job_name = models.CharField(max_length=200)
    # None until the job row is inserted (the same transaction); a retry from FailedJob makes another.
    job_id = models.BigIntegerField(null=True, blank=True)
    state = models.CharField(max_length=20, choices=NodeState.choices, default=NodeState.PENDING)
    # Called with ``results={parent name: result}`` (its parents keep their results).
    pass_results = models.BooleanField(default=False)
    # Why it failed or was cancelled: the error's last line.
    error = models.TextField(blank=True, default="")
    finished_at = models.DateTimeField(null=True, blank=True)
    # A job a dependent was attached to while a worker held it (``depends_on``): that worker does
    # not know it is a node, so its end is found by ``lifecycle.dependencies.sweep``.
    adopted = models.BooleanField(default=False)

    objects = QueueDatabaseManager()

    class Meta:
        db_table = "dbqueue_workflow_node"
        verbose_name = "workflow node"
        ordering = ["id"]
        constraints = [models.UniqueConstraint(fields=["workflow", "name"], name="dbqueue_node_name")]
        indexes = [
            models.Index(fields=["job_id"], name="dbqueue_node_job"),
            # Partial: the sweep's adopted nodes only. Not on ``state``, so a node's end is a HOT update
            # (and an index on every node's state lured the release's plan into reading them all).
            models.Index(fields=["adopted"], condition=Q(adopted=True), name="dbqueue_node_adopted"),
        ]

    def __str__(self) -> str:
        return f"{self.name} ({self.job_name})"


class WorkflowEdge(models.Model):
    """``child`` runs after ``parent``; ``done`` once the parent succeeded (or, ``run_anyway``, ended)."""

    id = models.BigAutoField(primary_key=True)
    # Indexed by the two indexes below, not each on its own.
    parent = models.ForeignKey(WorkflowNode, on_delete=models.CASCADE, related_name="child_edges", db_index=False)
    child = models.ForeignKey(WorkflowNode, on_delete=models.CASCADE, related_name="parent_edges", db_index=False)
    # The child runs even if this parent fails or is cancelled.
    run_anyway = models.BooleanField(default=False)
    done = models.BooleanField(default=False)

    objects = QueueDatabaseManager()

    class Meta:
        db_table = "dbqueue_workflow_edge"
        verbose_name = "workflow edge"
        constraints = [
            models.UniqueConstraint(fields=["parent", "child"], name="dbqueue_edge_pair"),
            models.CheckConstraint(condition=~Q(parent=models.F("child")), name="dbqueue_edge_not_self"),
        ]
        # Release: the edges of a parent (the unique pair's index); readiness: a child's edges, read
        # from the highest parent down (parents end roughly in id order, so the first read is undone).
        # ``done`` is in no index: marking an edge done is a HOT update, no index entry written.
        indexes = [models.Index(fields=["child", "parent"], name="dbqueue_edge_child")]

    def __str__(self) -> str:
        return f"{self.parent_id} -> {self.child_id}"


class JobStep(models.Model):
    """The result of one durable step of a job (``context.step``), stored as the step finished."""

    id = models.BigAutoField(primary_key=True)
    # The job row's id (a retry from FailedJob moves the steps to its new row).
    job_id = models.BigIntegerField()
    name = models.CharField(max_length=200)
    # JSON, with the arguments' encoder (dates, decimals, model references).
    result = models.TextField(default="null")
    finished_at = models.DateTimeField()

    objects = QueueDatabaseManager()

    class Meta:
        db_table = "dbqueue_job_step"
        verbose_name = "job step"
        constraints = [models.UniqueConstraint(fields=["job_id", "name"], name="dbqueue_step_name")]
        indexes = [models.Index(fields=["finished_at"], name="dbqueue_step_finished")]

    def __str__(self) -> str:
        return f"job {self.job_id}: {self.name}"
