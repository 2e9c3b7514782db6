from datetime import datetime
from typing import Any

from django.core.management.base import CommandError

from django_dbqueue import workflows
from django_dbqueue.db import DbNow
from django_dbqueue.management import options
from django_dbqueue.management.base import QueueCommand
from django_dbqueue.management.output import age, plural
from django_dbqueue.models import NodeState, Workflow
from django_dbqueue.states import WorkflowState


def _ago(moment: datetime | None, clock: datetime) -> str:
    return f"{age((clock - moment).total_seconds())} ago" if moment is not None else "-"


def _row(row: Any) -> list[str]:
    handle = workflows.WorkflowHandle(row)
    counts = handle.counts
    total = sum(counts.values())
    done = total - counts.get(NodeState.PENDING, 0)
    failed = counts.get(NodeState.FAILED, 0)
    cancelled = counts.get(NodeState.CANCELLED, 0)
    ids = [str(row.pk), row.name or "-", str(handle.state.value)]
    return [*ids, f"{done}/{total}", str(failed), str(cancelled), _ago(row.created_at, row.clock)]


class Command(QueueCommand):
    help = (
        "See and act on workflows: list them (newest first), show one's nodes, retry one from its "
        "failed nodes, cancel one."
    )

    def add_arguments(self, parser: Any) -> None:
        actions = parser.add_subparsers(
            dest="action", required=True, metavar="{list,show,retry,cancel}", help="What to do (each has its --help)."
        )
        listing = actions.add_parser("list", help="The workflows, newest first: state, nodes done of all.")
        listing.add_argument(
            "--state",
            choices=list(WorkflowState.values),
            help="Only the workflows in this state (default: every state).",
        )
        self.add_limit(listing, "workflows")
        workflow_id = options.whole_number(1, options.MAX_ID)
        for name, text in (
            ("show", "A workflow's nodes: status, parents, error."),
            ("retry", "Put a workflow's failed and cancelled nodes back; each runs once its parents succeed."),
            ("cancel", "Cancel a workflow's nodes that have not started; running ones are asked to stop."),
        ):
            action = actions.add_parser(name, help=text)
            action.add_argument("id", type=workflow_id, metavar="ID", help="A workflow id (see queue_workflows list).")

    def handle(self, *args: Any, **opts: Any) -> None:
        action = opts["action"]
        if action == "list":
            self._list(opts["state"], opts["limit"])
            return
        handle = self._find(opts["id"])
        {"show": self._show, "retry": self._retry, "cancel": self._cancel}[action](handle)

    def _find(self, pk: int) -> workflows.WorkflowHandle:
        try:
            return workflows.get_workflow(pk)
        except Workflow.DoesNotExist:
            raise CommandError(f"No workflow has the id {pk} (see queue_workflows list).") from None

    def _list(self, state: str | None, limit: int) -> None:
        selected = Workflow.objects.order_by("-created_at", "-id")
        if state is not None:
            selected = selected.in_state(state)
        headers = ["id", "name", "state", "done", "failed", "cancelled", "created"]
        # Ages are read against the database's clock, the one that wrote the times.
        self.listing(
            selected.annotate(clock=DbNow()), limit, "workflows", headers, _row, shrink=(1,), right=(0, 3, 4, 5)
        )

    def _show(self, handle: workflows.WorkflowHandle) -> None:
        nodes = handle.nodes()
        done = sum(1 for node in nodes if node.status in ("succeeded", "failed", "cancelled"))
        name = handle.name or "(unnamed)"
        title = f"Workflow {handle.id} {name}: {handle.state.value}, {done}/{len(nodes)} nodes done"
        self.stdout.write(self.style.MIGRATE_HEADING(title))
        rows = [
            [
                node.name,
                node.job_name,
                node.status,
                ", ".join(f"{parent} (anyway)" if parent in node.run_anyway else parent for parent in node.parents)
                or "-",
            ]
            for node in nodes
        ]
        self.table(["node", "job", "status", "after"], rows, shrink=(0, 1, 3))
        # Errors in full, below the table: cut to a column they would lose what matters.
        errors = [node for node in nodes if node.error]
        if errors:
            self.stdout.write("")
            self.stdout.write(self.style.MIGRATE_HEADING("Errors:"))
            for node in errors:
                self.stdout.write(f"{node.name}: {self.style.ERROR(node.error)}")

    def _retry(self, handle: workflows.WorkflowHandle) -> None:
        count = len(handle.retry())
        if count:
            self.success(f"Workflow {handle.id}: {plural(count, 'node')} put back; each runs once its parents succeed.")
        else:
            self.warning(f"Workflow {handle.id} has no failed or cancelled nodes to retry.")

    def _cancel(self, handle: workflows.WorkflowHandle) -> None:
        cancelled = workflows.cancel(handle.id)
        if cancelled is None:
            self.warning(f"Workflow {handle.id} was cancelled already.")
        else:
            self.success(
                f"Workflow {handle.id} was cancelled: {plural(cancelled, 'node')} that had not started "
                "cancelled; running nodes are asked to stop."
            )
