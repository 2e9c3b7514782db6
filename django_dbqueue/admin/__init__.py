"""The admin pages, a module each: jobs (with progress), failed jobs, finished jobs, batches, workflows,
schedules (and the stored ones), the queue overview and the dashboard (with its charts; the index lists
it as the job history, whose rows it charts). Django autodiscovers this package; it registers them."""

from django.contrib import admin

from ..models import (
    FailedJob,
    FinishedJob,
    Job,
    JobBatch,
    JobHistory,
    JobProgress,
    ScheduleState,
    StoredSchedule,
    Workflow,
)
from .batches import JobBatchAdmin
from .dashboard import DashboardAdmin
from .failed import FailedJobAdmin
from .finished import FinishedJobAdmin
from .jobs import JobAdmin, JobProgressAdmin
from .schedules import ScheduleStateAdmin, StoredScheduleAdmin
from .workflows import WorkflowAdmin

admin.site.register(Job, JobAdmin)
admin.site.register(FailedJob, FailedJobAdmin)
admin.site.register(FinishedJob, FinishedJobAdmin)
admin.site.register(JobProgress, JobProgressAdmin)
admin.site.register(ScheduleState, ScheduleStateAdmin)
admin.site.register(StoredSchedule, StoredScheduleAdmin)
admin.site.register(JobBatch, JobBatchAdmin)
admin.site.register(Workflow, WorkflowAdmin)
admin.site.register(JobHistory, DashboardAdmin)
