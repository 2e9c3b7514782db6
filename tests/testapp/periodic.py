"""Schedules of the test worker processes, imported only when DBQUEUE_TEST_SCHEDULES names a set of them
(the other tests' workers tick nothing)."""

import os
from pathlib import Path

from django_dbqueue.schedules import periodic
from django_dbqueue.signals import job_enqueued

from . import jobs

SCHEDULES = os.environ.get("DBQUEUE_TEST_SCHEDULES", "")

if SCHEDULES == "every-second":
    periodic(jobs.record_tick, every=1, name="every-second", kwargs={"schedule": "s"}, tick_argument="tick")
elif SCHEDULES == "bad-expression":
    periodic(jobs.record_tick, "61 * * * *", name="bad-expression", tick_argument="tick")

PAUSE = os.environ.get("DBQUEUE_TEST_TICK_PAUSE")


def _pause_mid_tick(sender: object, job: object, **kwargs: object) -> None:
    """Hold the first tick this worker enqueues inside its transaction, and say so in a file: the test kills it."""
    if PAUSE and getattr(job, "name", "") == jobs.record_tick.name:
        Path(PAUSE).write_text(str(getattr(job, "payload", "")))
        import time

        time.sleep(60)


if PAUSE:
    job_enqueued.connect(_pause_mid_tick, dispatch_uid="tests.pause_mid_tick")
