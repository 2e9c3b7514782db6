"""The queue's tables and their named querysets (``jobs``: the job and failed-job tables and
the vocabularies of a job's state, ``State`` and ``JobStatus``; ``tables``: the others, with
``BatchState``)."""

from .jobs import (
    ANALYZE_AFTER,
    CANCEL,
    CANCEL_HARD,
    CANCELLED_CLASS,
    DB_NOW,
    INVALID_ROW_CLASS,
    JOB_RECORDS,
    NO_CANCEL,
    RETRIED,
    STATUSES,
    UNIQUE_INDEX,
    FailedJob,
    FailedJobQuerySet,
    Job,
    JobQuerySet,
    JobStatus,
    State,
    check_rows,
    record_id,
    sql_names,
)
from .tables import (
    BATCH_STATES,
    BatchState,
    FlowLimit,
    JobBatch,
    JobBatchQuerySet,
    JobHistory,
    JobProgress,
    PausedQueue,
    QueueControl,
    QueueWorker,
    ScheduleState,
    TaskResultRecord,
    UniqueWindow,
)

__all__ = [
    "ANALYZE_AFTER", "BATCH_STATES", "CANCEL", "CANCELLED_CLASS", "CANCEL_HARD", "DB_NOW",
    "INVALID_ROW_CLASS", "JOB_RECORDS", "NO_CANCEL", "RETRIED", "STATUSES", "UNIQUE_INDEX",
    "BatchState", "FailedJob", "FailedJobQuerySet", "FlowLimit", "Job", "JobBatch",
    "JobBatchQuerySet", "JobHistory", "JobProgress", "JobQuerySet", "JobStatus",
    "PausedQueue", "QueueControl", "QueueWorker", "ScheduleState", "State", "TaskResultRecord",
    "UniqueWindow", "check_rows", "record_id", "sql_names",
]  # fmt: skip
