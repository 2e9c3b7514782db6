"""queue_work's options: parsing, errors, and the stop options."""

import io
import logging

import pytest
from django.conf import settings
from django.core.management import call_command
from django.core.management.base import CommandError
from django.test import override_settings

from django_dbqueue.models import Job
from tests.testapp import jobs
from tests.testapp.models import Run


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--queue", "high,,low"], "has an empty queue name"),
        (["--queue", "a,a"], "names a queue twice"),
        (["--sleep", "soon"], "'soon' is not seconds"),
        (["--tries", "0"], "'0' must be at least 1"),
        (["--timeout", "-5"], "'-5' must be at least 0"),
        (["--backoff", "1,x"], "is not seconds, or a comma-separated list of seconds"),
        (["--backoff", "-1"], "has a negative delay"),
        (["--memory", "lots"], "'lots' is not whole megabytes"),
        (["--concurrency", "0"], "'0' must be at least 1"),
        (["--batch", "0"], "'0' must be at least 1"),
        (["--batch", "many"], "'many' is not a whole number"),
        (["--queue", "high,two words"], "the queue name 'two words' may hold only letters, digits"),
        (["--queue", "q" * 101], "is 101 characters long; at most 100"),
        (["--tries", "32768"], "'32768' must be at most 32767"),
        (["--timeout", "2147483648"], "'2147483648' must be at most 2147483647"),
        (["--sleep", "1e300"], "'1e300' must be at most 2147483647"),
        (["--rest", "inf"], "'inf' is not seconds"),
        (["--max-time", "1e12"], "'1e12' must be at most"),
        (["--backoff", "10,inf"], "is not seconds, or a comma-separated list of seconds"),
        (["--backoff", "nan"], "is not seconds, or a comma-separated list of seconds"),
        (["--backoff", "10,3e9"], "'10,3e9' has a delay over 2147483647 seconds"),
    ],
)
def test_a_bad_option_is_refused_with_a_clear_message(args, message):
    with pytest.raises(CommandError) as info:
        call_command("queue_work", *args)
    assert message in str(info.value)


def test_once_and_concurrency_cannot_be_combined():
    with pytest.raises(CommandError, match="--once and --concurrency cannot be combined"):
        call_command("queue_work", "--once", "--concurrency", "2")


def test_help_shows_the_defaults():
    from django.core.management import load_command_class

    command = load_command_class("django_dbqueue", "queue_work")
    text = command.create_parser("manage.py", "queue_work").format_help()
    assert "(default: default)" in text and "(default: 3)" in text and "(default: 30)" in text


@pytest.mark.django_db
def test_stop_when_empty_runs_every_job_of_the_listed_queues():
    jobs.record.using(queue="high").enqueue("h")
    jobs.record.using(queue="low").enqueue("l")
    jobs.record.using(queue="other").enqueue("o")
    err = io.StringIO()
    call_command("queue_work", "--queue", "high,low", "--stop-when-empty", "--sleep", "0", stderr=err)
    assert set(Run.objects.values_list("key", flat=True)) == {"h", "l"}
    assert Job.objects.get().queue == "other"


@pytest.mark.django_db
def test_serving_a_queue_not_in_queues_warns_and_still_runs():
    jobs.record.enqueue("d")
    err = io.StringIO()
    with override_settings(DBQUEUE={**settings.DBQUEUE, "QUEUES": ["default", "emails"]}):
        call_command("queue_work", "--queue", "default,emials", "--stop-when-empty", "--sleep", "0", stderr=err)
    assert "This worker serves 'emials', not in DBQUEUE['QUEUES'] ('default', 'emails')" in err.getvalue()
    assert "dbqueue.W006" in err.getvalue()
    assert list(Run.objects.values_list("key", flat=True)) == ["d"]


@pytest.mark.django_db
def test_once_runs_one_job():
    jobs.record.enqueue("a")
    jobs.record.enqueue("b")
    call_command("queue_work", "--once", stderr=io.StringIO())
    assert Run.objects.count() == 1 and Job.objects.count() == 1


@pytest.mark.django_db
def test_max_time_stops_an_idle_worker(caplog):
    with caplog.at_level(logging.INFO, logger="django_dbqueue"):
        call_command("queue_work", "--max-time", "0.2", "--sleep", "0.05", stderr=io.StringIO())
    assert any("reason=max-time processed=0" in record.getMessage() for record in caplog.records)
