"""The queue's tables and their named querysets (``jobs``: the job and failed-job
tables, the one vocabulary of a job's ``State``; ``tables``: the others)."""

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
    UNIQUE_INDEX,
    FailedJob,
    FailedJobManager,
    FailedJobQuerySet,
    Job,
    JobManager,
    JobQuerySet,
    LeaseOver,
    State,
    bounds_condition,
    check_rows,
    record_id,
    sql_names,
)
from .tables import (
    PRUNE_CHUNK,
    FlowLimit,
    FlowLimitManager,
    JobBatch,
    JobHistory,
    JobProgress,
    PausedQueue,
    QueueControl,
    QueueDatabaseManager,
    QueueWorker,
    ScheduleState,
    TaskResultRecord,
    UniqueWindow,
)

__all__ = [
    "ANALYZE_AFTER", "CANCEL", "CANCELLED_CLASS", "CANCEL_HARD", "DB_NOW", "INVALID_ROW_CLASS",
    "JOB_RECORDS", "NO_CANCEL", "PRUNE_CHUNK", "RETRIED", "UNIQUE_INDEX", "FailedJob",
    "FailedJobManager", "FailedJobQuerySet", "FlowLimit", "FlowLimitManager", "Job", "JobBatch",
    "JobHistory", "JobManager", "JobProgress", "JobQuerySet", "LeaseOver", "PausedQueue",
    "QueueControl", "QueueDatabaseManager", "QueueWorker", "ScheduleState", "State",
    "TaskResultRecord", "UniqueWindow", "bounds_condition", "check_rows",
    "record_id", "sql_names",
]  # fmt: skip
