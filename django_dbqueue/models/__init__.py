"""The queue's tables and their named querysets (``jobs``: the job and failed-job tables;
``tables``: the others); the vocabularies of states (``states``) are handed on with them."""

from ..states import STATUSES, BatchState, JobStatus, State
from .jobs import (
    ANALYZE_AFTER,
    CANCEL,
    CANCEL_HARD,
    CANCELLED_CLASS,
    DB_NOW,
    FINISHED_OUTCOMES,
    INVALID_ROW_CLASS,
    JOB_RECORDS,
    NO_CANCEL,
    RETRIED,
    UNIQUE_INDEX,
    FailedJob,
    FailedJobQuerySet,
    FinishedJob,
    Job,
    JobQuerySet,
    check_rows,
    record_id,
    sql_names,
)
from .tables import (
    BATCH_STATES,
    MAX_JITTER,
    FlowLimit,
    JobBatch,
    JobBatchQuerySet,
    JobHistory,
    JobProgress,
    JobReference,
    PausedQueue,
    QueueControl,
    QueueWorker,
    ScheduleState,
    StoredSchedule,
    TaskResultRecord,
    UniqueWindow,
)
from .workflows import JobStep, NodeState, Workflow, WorkflowEdge, WorkflowNode, WorkflowQuerySet, workflow_state

__all__ = [
    "ANALYZE_AFTER", "BATCH_STATES", "CANCEL", "CANCELLED_CLASS", "CANCEL_HARD", "DB_NOW",
    "FINISHED_OUTCOMES", "INVALID_ROW_CLASS", "JOB_RECORDS", "MAX_JITTER", "NO_CANCEL", "RETRIED", "STATUSES",
    "UNIQUE_INDEX",
    "BatchState", "FailedJob", "FailedJobQuerySet", "FinishedJob", "FlowLimit", "Job", "JobBatch",
    "JobBatchQuerySet", "JobHistory", "JobProgress", "JobQuerySet", "JobReference", "JobStatus", "JobStep",
    "NodeState", "PausedQueue", "QueueControl", "QueueWorker", "ScheduleState", "State", "StoredSchedule",
    "TaskResultRecord", "UniqueWindow", "Workflow", "WorkflowEdge", "WorkflowNode", "WorkflowQuerySet", "check_rows",
    "record_id", "sql_names", "workflow_state",
]  # fmt: skip
