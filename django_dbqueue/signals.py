"""Django signals for job events.

Receivers get ``job`` (the ``Job`` row) and the keywords listed. A receiver
that raises is logged and never changes what happened to the job.
"""

from django.dispatch import Signal

# A job row was inserted (it becomes visible when the transaction commits).
job_enqueued = Signal()
# A worker is about to run a job: ``job``, ``worker_id``.
job_started = Signal()
# A job succeeded and was deleted: ``job``, ``worker_id``, ``duration``, ``result``.
job_succeeded = Signal()
# A job raised and was released to run again: ``job``, ``worker_id``, ``duration``, ``exception``, ``delay``.
job_released = Signal()
# A job moved to FailedJob: ``job``, ``failed_job``, ``worker_id``, ``exception`` (may be None).
job_failed = Signal()
# A job was cancelled and moved to FailedJob: ``job_id``, ``failed_job``. Sent for a
# waiting or delayed job by whoever cancelled it, and for a running one by its worker
# (which sends ``job_failed`` too, with the ``JobCancelled`` exception).
job_cancelled = Signal()
# A queue was paused (``pauses.pause``): ``queue``. Sent by whoever paused it, once the pause is stored.
queue_paused = Signal()
# A paused queue was resumed (``pauses.resume``): ``queue``.
queue_resumed = Signal()
# A batch finished: every member ended (batches.py): ``batch_id``. Sent once the
# transaction that ended its last member commits; again if a retry reopened it.
batch_finished = Signal()
