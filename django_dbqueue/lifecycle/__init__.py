"""Every change of a job's state after its claim, each a named function (``changes``, ``retry``).

The worker, the admin, the commands and the Tasks backend change job rows only through
these. A change that ends a reservation is a compare-and-set on ``(id, attempts)``, which
names the reservation. Features react to changes through ``reactions.REACTIONS`` only.
"""

from .changes import (
    cancel,
    cancel_batch,
    cancel_requests,
    cancel_unreserved,
    delete,
    delete_many,
    delete_unreserved,
    delete_waiting,
    extend,
    extend_many,
    fail,
    move_aside,
    move_unreadable,
    reclaim_expired,
    reclaim_worker,
    release,
    run_now,
    skip_member,
)
from .dependencies import WORKFLOW_ENDED_CHANNEL, cancel_workflow, prune_workflows, release_children
from .failed import cancel_unstarted
from .reactions import (
    BATCH_ENDED_CHANNEL,
    CALLBACKS,
    REACTIONS,
    finish_batch,
    finished_by_members,
    members_ended,
    sweep,
    unblock,
)
from .retry import retry

__all__ = [
    "BATCH_ENDED_CHANNEL",
    "CALLBACKS",
    "REACTIONS",
    "WORKFLOW_ENDED_CHANNEL",
    "cancel",
    "cancel_batch",
    "cancel_requests",
    "cancel_unreserved",
    "cancel_unstarted",
    "cancel_workflow",
    "delete",
    "delete_many",
    "delete_unreserved",
    "delete_waiting",
    "extend",
    "extend_many",
    "fail",
    "finish_batch",
    "finished_by_members",
    "members_ended",
    "move_aside",
    "move_unreadable",
    "prune_workflows",
    "reclaim_expired",
    "reclaim_worker",
    "release",
    "release_children",
    "retry",
    "run_now",
    "skip_member",
    "sweep",
    "unblock",
]  # fmt: skip
