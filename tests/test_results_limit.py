"""A result too large for the result store fails the job that returned it (MAX_PAYLOAD_SIZE)."""

from __future__ import annotations

import pytest
from django.test import override_settings

from django_dbqueue import JobStatus, get_job, job
from django_dbqueue.models import FailedJob, Job, TaskResultRecord
from tests.conftest import run_worker
from tests.testapp.models import Run

pytestmark = pytest.mark.django_db(transaction=True)

LIMIT = {"MAX_PAYLOAD_SIZE": 2048}


@job(name="tests.results_limit.keep", results=True)
def keep(size: int) -> dict[str, str]:
    Run.objects.create(key=f"kept-{size}")
    return {"text": "é" * size}


@job(name="tests.results_limit.forget")
def forget(size: int) -> str:
    return "x" * size


@override_settings(DBQUEUE=LIMIT)
def test_a_kept_result_over_the_limit_fails_its_job_with_the_job_the_size_and_the_limit_named():
    handle = keep.enqueue(1500)
    run_worker()
    assert Run.objects.filter(key="kept-1500").exists()  # it ran once; it is not retried
    failed = FailedJob.objects.get(job_id=handle.id)
    assert failed.exception_class == "django_dbqueue.exceptions.PayloadTooLarge"
    # 1,500 two-byte characters and the dict around them.
    assert "the return value of tests.results_limit.keep" in failed.error
    assert f"(job {handle.id}) is 3,011 bytes as JSON, over DBQUEUE['MAX_PAYLOAD_SIZE'] (2,048 bytes)" in failed.error
    assert failed.attempts == 1
    waited = get_job(handle.id)
    assert waited.status is JobStatus.FAILED and waited.result is None
    record = TaskResultRecord.objects.get(job_id=handle.id)
    assert record.return_value is None and "over DBQUEUE['MAX_PAYLOAD_SIZE']" in record.errors[-1]["traceback"]
    assert not Job.objects.exists()


@override_settings(DBQUEUE=LIMIT)
def test_a_kept_result_within_the_limit_is_kept():
    handle = keep.enqueue(500)
    run_worker()
    assert get_job(handle.id).result == {"text": "é" * 500}
    assert not FailedJob.objects.exists()


@override_settings(DBQUEUE=LIMIT)
def test_a_result_that_is_not_kept_has_no_limit():
    handle = forget.enqueue(10_000)
    run_worker()
    assert get_job(handle.id).status is JobStatus.SUCCEEDED
    assert not FailedJob.objects.exists()


@override_settings(DBQUEUE={"MAX_PAYLOAD_SIZE": None})
def test_without_a_payload_limit_a_kept_result_has_none_either():
    handle = keep.enqueue(5000)
    run_worker()
    assert get_job(handle.id).result == {"text": "é" * 5000}
