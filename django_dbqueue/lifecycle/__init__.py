"""Every change of a job's state after its claim, each a named function.

The worker, the admin, the commands and the Tasks backend call these and
nothing else to change a job row (the claim itself is ``claims``). Each
change that ends a reservation is a compare-and-set on ``(id, attempts)``:
``attempts`` grows by one at every reservation and is never reset, so it names
the reservation, and a worker whose job was reclaimed and reserved by someone
else changes nothing.

Features react to a change in one declared way: ``REACTIONS`` (in
``reactions``), each a job column, the outcomes it reacts to and a function run
in the transaction that ended rows carrying that column (concurrency slots,
batch counters). Rows that concern none of them cost no transaction and no
query more than the change itself. ``changes`` holds the changes of one job,
``retry`` the retry from ``FailedJob``.
"""

from .changes import (
    RECLAIMED_ERROR,
    cancel,
    cancel_batch,
    cancel_requests,
    delete,
    delete_many,
    delete_returning,
    delete_sql,
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
from .reactions import (
    CALLBACKS,
    REACTIONS,
    count_members,
    finish_batch,
    finished_by_members,
    members_ended,
    reacts,
    running,
    sweep,
    unblock,
)
from .retry import retry

__all__ = [
    "CALLBACKS", "REACTIONS", "RECLAIMED_ERROR", "cancel", "cancel_batch", "cancel_requests",
    "count_members", "delete", "delete_many", "delete_returning", "delete_sql", "delete_unreserved",
    "delete_waiting", "extend", "extend_many", "fail", "finish_batch", "finished_by_members",
    "members_ended", "move_aside", "move_unreadable", "reacts", "reclaim_expired", "reclaim_worker", "release",
    "retry", "run_now", "running", "skip_member", "sweep", "unblock",
]  # fmt: skip
