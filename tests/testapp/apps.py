import os

from django.apps import AppConfig


class TestAppConfig(AppConfig):
    name = "tests.testapp"
    label = "testapp"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        if os.environ.get("DBQUEUE_TEST_RECORD_SIGNALS"):
            # Worker processes of the partition tests record each success they report.
            from django_dbqueue.signals import job_succeeded

            job_succeeded.connect(_record_success, dispatch_uid="tests.record_success")
        if os.environ.get("DBQUEUE_TEST_SCHEDULES"):
            # Worker processes of the schedule tests: the schedules they tick.
            from . import periodic  # noqa: F401
        if os.environ.get("DBQUEUE_TEST_LIMITS"):
            # Worker processes of the limit tests: the jobs with concurrency keys and rate limits.
            from . import limit_jobs  # noqa: F401
        if os.environ.get("DBQUEUE_TEST_OUTAGE_JOBS"):
            # Worker processes of the pooled-worker outage test.
            from . import outage_jobs  # noqa: F401


def _record_success(sender: object, job: object, worker_id: str = "", **kwargs: object) -> None:
    from .models import Attempt

    Attempt.objects.create(key=f"succeeded:{job.pk}:{worker_id}"[:100], attempt=job.attempts)  # type: ignore[attr-defined]
