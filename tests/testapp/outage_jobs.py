"""Jobs of the pooled-worker outage test (tests/test_outage_pool.py).

Not autodiscovered (their queue would show in the other tests' system checks):
the worker processes of that test import this module (DBQUEUE_TEST_OUTAGE_JOBS,
see apps.py); the test registers its jobs for its own duration.

A run appends its number to the file ``DBQUEUE_TEST_RUNS_FILE`` names, not to the
database, so a run is counted whatever became of the database meanwhile: a
number written twice is a job that ran twice.
"""

import os
import time

from django_dbqueue import JobContext, job
from django_dbqueue.models import Job

OUTAGE_QUEUE = "outage-pool"


# A timeout, so a pooled worker arms its last resort for every run; a retry_after
# longer than the test's outage, so no reservation expires during it.
@job(queue=OUTAGE_QUEUE, timeout=20, retry_after=300, tries=5)
def drain_step(n: int, seconds: float) -> None:
    """Read the database (in an outage the read fails and the job is given back
    before it did anything), sleep ``seconds``, then count the run."""
    Job.objects.filter(pk=0).exists()
    time.sleep(seconds)
    with open(os.environ["DBQUEUE_TEST_RUNS_FILE"], "a") as runs:
        runs.write(f"{n}\n")


@job(queue=OUTAGE_QUEUE, takes_context=True, timeout=2, retry_after=300, tries=1)
def steps_until_stopped(context: JobContext) -> None:
    """Run in short steps, past the timeout, until asked to stop; touch no database."""
    started = time.monotonic()
    while time.monotonic() < started + 120:
        time.sleep(0.05)
        context.check_cancelled()


DEFINITIONS = [drain_step, steps_until_stopped]
