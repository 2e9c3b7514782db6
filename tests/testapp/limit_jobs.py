"""Jobs of the concurrency and rate limit tests (tests/test_limits.py).

Not autodiscovered: their queues would show in the other tests' system checks,
and a worker switches every queue named by a limited job to the flow claim.
The worker processes of those tests import this module (DBQUEUE_TEST_LIMITS,
see apps.py); the tests register its jobs for their own duration.

Each run records one ``Run`` row (its key is unique: a second run would fail
to insert) whose note holds, as JSON, when the run started and ended (this
host's clock), its attempt and given-back count, and when its job was
reserved (the database's clock).
"""

import json
import os
import time
from typing import Any

from django_dbqueue import JobContext, job
from django_dbqueue.models import Job

from .models import Attempt, Run

KEYS_QUEUE = "limits-keys"
RATE_QUEUE = "limits-rate"
# Limited as a whole by DBQUEUE["RATE_LIMITS"] in the workers (DBQUEUE_TEST_RATE_LIMITS).
QUEUE_RATE_QUEUE = "limits-queue-rate"
JOB_RATE = "20/s"
# The longest keyed_until_released holds its slot when nobody releases it: longer than the
# saturated-key test holds it (a second worker's start, up to 30 s, then up to 60 s for the
# other keys' jobs), so a slow machine fails no assertion there; a failing test waits for it.
HOLD_AT_MOST = 120.0


def first_argument(key: str, *args: Any, **kwargs: Any) -> str:
    return key


def account_key(account: dict[str, Any], *args: Any, **kwargs: Any) -> str:
    """Raises KeyError for an account without an id: the bad key callable of the tests."""
    return f"account:{account['id']}"


def _record(context: JobContext, key: str, started: float) -> None:
    reserved_at = Job.objects.filter(pk=context.job_id).values_list("reserved_at", flat=True).first()
    note = {
        "started": started,
        "ended": time.time(),
        "attempt": context.attempt,
        "given_back": context.given_back,
        "reserved_at": reserved_at.timestamp() if reserved_at else None,
    }
    Run.objects.create(key=key, note=json.dumps(note), pid=os.getpid())


@job(queue=KEYS_QUEUE, takes_context=True, concurrency_key=first_argument)
def keyed(context: JobContext, key: str, n: int, seconds: float = 0.02) -> None:
    started = time.time()
    time.sleep(seconds)
    _record(context, f"{key}:{n}", started)


@job(queue=KEYS_QUEUE, takes_context=True, concurrency_key=first_argument)
def keyed_until_released(context: JobContext, key: str, n: int) -> None:
    """Hold a slot of ``key`` (shared with ``keyed``) until the test stores the run ``release:<key>``."""
    started = time.time()
    Attempt.objects.create(key=f"{key}:{n}", attempt=context.attempt)
    while not Run.objects.filter(key=f"release:{key}").exists() and time.time() < started + HOLD_AT_MOST:
        time.sleep(0.05)
    _record(context, f"{key}:{n}", started)


@job(queue=RATE_QUEUE, takes_context=True, rate_limit=JOB_RATE)
def rated(context: JobContext, n: int) -> None:
    _record(context, f"rated:{n}", time.time())


@job(queue=QUEUE_RATE_QUEUE, takes_context=True)
def in_rated_queue(context: JobContext, n: int) -> None:
    _record(context, f"in-rated-queue:{n}", time.time())


@job(queue=KEYS_QUEUE, concurrency_key=account_key)
def per_account(account: dict[str, Any]) -> None:
    pass


@job(queue=RATE_QUEUE, rate_limit="10/s", rate_key=account_key)
def rated_per_account(account: dict[str, Any]) -> None:
    pass


DEFINITIONS = [keyed, keyed_until_released, rated, in_rated_queue, per_account, rated_per_account]
