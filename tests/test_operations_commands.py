"""The operator commands (queue_failed, queue_retry, queue_forget, queue_flush,
queue_prune_failed, queue_clear, queue_monitor, queue_restart) and the
operations functions behind them.

Failed jobs are made the way a worker makes them: enqueue, reserve, fail.
"""

from __future__ import annotations

import io
from datetime import timedelta
from typing import Any

import pytest
from django.core.management import call_command, load_command_class
from django.core.management.base import CommandError
from django.db.models.signals import pre_delete
from django.db.utils import ConnectionDoesNotExist
from django.test import override_settings
from django.utils import timezone

from django_dbqueue import claims, lifecycle, operations
from django_dbqueue.exceptions import FailedJobsNotFound
from django_dbqueue.management import output
from django_dbqueue.models import FailedJob, Job, QueueWorker
from django_dbqueue.operations import QueueStats
from django_dbqueue.signals import job_enqueued
from tests.conftest import run_worker, wait_until
from tests.testapp import jobs
from tests.testapp.models import Run

db = pytest.mark.django_db

COMMANDS = [
    "queue_failed",
    "queue_retry",
    "queue_forget",
    "queue_flush",
    "queue_prune_failed",
    "queue_clear",
    "queue_monitor",
    "queue_restart",
]


def fail(
    definition: Any = jobs.record,
    *args: Any,
    queue: str = "default",
    exception_class: str = "builtins.ValueError",
    hours_ago: float | None = None,
) -> FailedJob:
    """Enqueue a job, reserve it and fail it, as a worker would; optionally backdate it."""
    job = definition.using(queue=queue).enqueue(*(args or ("key",)))
    reserved = claims.reserve([queue])
    assert reserved is not None and reserved.pk == job.pk, "another job was waiting in the queue"
    failed = lifecycle.fail(reserved, error=f"Traceback ...\n{exception_class}: boom", exception_class=exception_class)
    assert failed is not None
    if hours_ago is not None:
        FailedJob.objects.filter(pk=failed.pk).update(failed_at=timezone.now() - timedelta(hours=hours_ago))
    return failed


def run(name: str, *args: str, **options: Any) -> str:
    """Run a command; return its stdout."""
    out = io.StringIO()
    call_command(name, *args, stdout=out, stderr=io.StringIO(), **options)
    return out.getvalue()


def error_of(name: str, *args: str, **options: Any) -> str:
    with pytest.raises(CommandError) as info:
        run(name, *args, **options)
    return str(info.value)


def help_of(name: str) -> str:
    return load_command_class("django_dbqueue", name).create_parser("manage.py", name).format_help()


class Terminal(io.StringIO):
    """A stdin that answers the confirmation and claims to be a terminal."""

    def isatty(self) -> bool:
        return True


# -- every command -------------------------------------------------------------


@pytest.mark.parametrize("name", COMMANDS)
def test_every_command_has_a_help_text(name):
    assert load_command_class("django_dbqueue", name).help


@pytest.mark.parametrize(
    ("name", "default"),
    [
        ("queue_failed", "(default: 50)"),
        ("queue_flush", "(default: delete all)"),
        ("queue_prune_failed", "(required, no default)"),
        ("queue_clear", "(default: default)"),
        ("queue_monitor", "(default: no limit)"),
    ],
)
def test_help_shows_the_defaults(name, default):
    assert default in " ".join(help_of(name).split())


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["queue_failed", "--limit", "0"], "'0' must be at least 1"),
        (["queue_failed", "--limit", "many"], "'many' is not a whole number"),
        (["queue_failed", "--queue", " "], "a queue name cannot be empty"),
        (["queue_failed", "--queue", "e mails"], "may hold only letters, digits and _ . : -"),
        (["queue_retry", "--queue", "emails!"], "may hold only letters, digits and _ . : -"),
        (["queue_monitor", "--queue", "ok", "not/ok"], "the queue name 'not/ok' may hold only letters"),
        (["queue_retry", "5-x"], "'5-x' is not an id or a range like 5-9"),
        (["queue_retry", "9-5"], "'9-5' is a range that ends before it starts"),
        (["queue_retry", "3,,4"], "'' is not an id or a range like 5-9"),
        (["queue_retry", "1-2000000"], "spans more than a million ids"),
        (["queue_forget", "all"], "'all' is not an id or a range like 5-9"),
        (["queue_forget"], "the following arguments are required: ID"),
        (["queue_flush", "--hours", "0"], "'0' must be more than 0 hours"),
        (["queue_flush", "--hours", "soon"], "'soon' is not a number of hours"),
        (["queue_prune_failed"], "the following arguments are required: --hours"),
        (["queue_prune_failed", "--hours", "-1"], "'-1' must be more than 0 hours"),
        (["queue_prune_failed", "--hours", "nan"], "'nan' must be more than 0 hours"),
        (["queue_prune_failed", "--hours", "1e9"], "is more than 876000 hours"),
        (["queue_monitor", "--max", "-1"], "'-1' must be at least 0"),
        (["queue_clear", "--queue", "x" * 101], "is 101 characters long; at most 100"),
    ],
)
def test_a_bad_argument_is_refused_with_a_clear_message(args, message):
    # No database: argparse refuses the input before the command runs.
    assert message in error_of(*args)


# -- queue_failed --------------------------------------------------------------


@db
def test_failed_lists_the_failed_jobs_newest_first():
    old = fail(jobs.record, "old", hours_ago=2)
    new = fail(jobs.always_fail, "new", queue="emails", exception_class="builtins.KeyError")
    lines = run("queue_failed").splitlines()
    assert lines[0].split() == ["id", "queue", "name", "failed", "at", "exception", "class"]
    assert [line.split()[0] for line in lines[1:]] == [str(new.pk), str(old.pk)]
    queue, name = lines[1].split()[1:3]
    # The name is shortened from the left when the ids (which grow over a test run) widen the table.
    assert queue == "emails" and name.endswith("testapp.jobs.always_fail")
    assert lines[1].endswith("  KeyError")  # builtins. is left out
    assert lines[2].endswith("  ValueError")
    assert timezone.localtime(new.failed_at).strftime("%Y-%m-%d %H:%M") in lines[1]


@db
def test_failed_says_so_when_there_are_none():
    assert run("queue_failed").strip() == "No failed jobs."


@db
def test_failed_filters_by_queue_and_by_name():
    mail = fail(jobs.record, "a", queue="emails")
    other = fail(jobs.always_fail, "b", queue="emails")
    fail(jobs.record, "c")
    by_queue = run("queue_failed", "--queue", "emails")
    assert {line.split()[0] for line in by_queue.splitlines()[1:]} == {str(mail.pk), str(other.pk)}
    by_both = run("queue_failed", "--queue", "emails", "--name", "tests.testapp.jobs.record")
    assert [line.split()[0] for line in by_both.splitlines()[1:]] == [str(mail.pk)]
    assert run("queue_failed", "--name", "no.such.job").strip() == "No failed jobs."


@db
def test_failed_shows_at_most_limit_jobs_and_says_how_many_there_are():
    for index in range(4):
        fail(jobs.record, f"k{index}", hours_ago=index)
    lines = run("queue_failed", "--limit", "2").splitlines()
    assert len(lines) == 4  # header, two jobs, the note
    assert lines[-1] == "2 of 4 failed jobs shown; --limit shows more."


@db
def test_failed_shortens_long_names_and_exception_classes_to_fit_80_columns():
    queue = "transactional-emails-for-the-very-important-customers"
    exception = "myproject.integrations.payments.exceptions.PaymentProviderUnreachableError"
    fail(jobs.sleep_then_record, "k", 0, queue=queue, exception_class=exception)
    text = run("queue_failed")
    assert all(len(line) <= 80 for line in text.splitlines()), text
    row = text.splitlines()[1]
    assert row.startswith(" ") or row.split()[1].startswith("transactional-")
    assert "transactional-" in row and row.endswith("Error") and row.count("...") == 3


# -- queue_retry ---------------------------------------------------------------


@db
def test_retry_puts_the_listed_ids_ranges_and_lists_back_as_fresh_jobs():
    failed = [fail(jobs.record, f"k{index}") for index in range(6)]
    ids = [row.pk for row in failed]
    out = run("queue_retry", str(ids[0]), f"{ids[2]}-{ids[3]}", f"{ids[4]},{ids[0]}")
    assert "4 job(s) were put back on the queue." in out
    assert set(FailedJob.objects.values_list("pk", flat=True)) == {ids[1], ids[5]}
    retried = Job.objects.order_by("id")
    assert [job.attempts for job in retried] == [0, 0, 0, 0]
    assert sorted(job.payload for job in retried) == sorted(failed[i].payload for i in (0, 2, 3, 4))


@db
def test_a_retried_job_runs_again():
    failed = fail(jobs.record, "again")
    run("queue_retry", str(failed.pk))
    run_worker()
    assert Run.objects.filter(key="again").exists()
    assert not Job.objects.exists() and not FailedJob.objects.exists()


@db
def test_retry_of_an_id_that_does_not_exist_names_it_and_retries_nothing():
    failed = fail(jobs.record, "k")
    message = error_of("queue_retry", str(failed.pk), str(failed.pk + 1), f"{failed.pk + 5}-{failed.pk + 7}")
    assert message == (
        f"Nothing was retried: no failed job has the ids {failed.pk + 1}, {failed.pk + 5}-{failed.pk + 7}."
    )
    assert FailedJob.objects.filter(pk=failed.pk).exists() and not Job.objects.exists()


@db
def test_retry_without_a_selection_says_what_to_pass():
    assert error_of("queue_retry") == (
        "Say which failed jobs to retry: ids (queue_retry 3 5-9 12,14), a selection (--queue QUEUE, --name NAME, "
        "--error-contains TEXT, --since WHEN, --until WHEN), or all."
    )


@pytest.mark.parametrize("args", [["3", "all"], ["3", "--queue", "emails"], ["all", "--name", "x"]])
def test_retry_refuses_two_kinds_of_selection(args):
    assert "one kind of selection at a time" in error_of("queue_retry", *args)


@db
def test_retry_by_queue_by_name_and_by_both():
    emails_record = fail(jobs.record, "a", queue="emails")
    emails_other = fail(jobs.always_fail, "b", queue="emails")
    default_record = fail(jobs.record, "c")
    assert "1 job(s)" in run("queue_retry", "--queue", "emails", "--name", "tests.testapp.jobs.record", "--force")
    assert set(FailedJob.objects.values_list("pk", flat=True)) == {emails_other.pk, default_record.pk}
    assert "1 job(s)" in run("queue_retry", "--name", "tests.testapp.jobs.record", "--force")
    assert "1 job(s)" in run("queue_retry", "--queue", "emails", "--force")
    assert not FailedJob.objects.exists()
    assert sorted(Job.objects.values_list("payload", flat=True)) == sorted(
        row.payload for row in (emails_record, emails_other, default_record)
    )
    assert sorted(Job.objects.values_list("queue", flat=True)) == ["default", "emails", "emails"]


@db
def test_retry_all_puts_every_failed_job_back():
    for index in range(3):
        fail(jobs.record, f"k{index}", queue=f"q{index}")
    assert run("queue_retry", "all", "--force").strip() == "3 job(s) were put back on the queue."
    assert Job.objects.count() == 3 and not FailedJob.objects.exists()


@db
def test_retry_says_so_when_nothing_matches():
    fail(jobs.record, "k")
    assert "No failed job matched" in run("queue_retry", "--queue", "typo")
    assert FailedJob.objects.count() == 1


# -- queue_forget --------------------------------------------------------------


@db
def test_forget_deletes_the_listed_failed_jobs():
    first, second, third = (fail(jobs.record, f"k{index}") for index in range(3))
    assert run("queue_forget", str(first.pk), f"{second.pk}").strip() == "2 failed job(s) were deleted."
    assert list(FailedJob.objects.values_list("pk", flat=True)) == [third.pk]
    assert not Job.objects.exists()


@db
def test_forget_of_an_id_that_does_not_exist_names_it_and_deletes_nothing():
    failed = fail(jobs.record, "k")
    message = error_of("queue_forget", str(failed.pk), str(failed.pk + 10))
    assert message == f"Nothing was deleted: no failed job has the id {failed.pk + 10}."
    assert FailedJob.objects.filter(pk=failed.pk).exists()


# -- queue_flush and queue_prune_failed ---------------------------------------


@db
def test_flush_deletes_every_failed_job():
    for index in range(3):
        fail(jobs.record, f"k{index}", hours_ago=index)
    assert run("queue_flush", "--force").strip() == "3 failed job(s) were deleted."
    assert not FailedJob.objects.exists()


@db
def test_flush_with_hours_keeps_the_recent_failed_jobs():
    fail(jobs.record, "old", hours_ago=5)
    recent = fail(jobs.record, "recent", hours_ago=1)
    assert run("queue_flush", "--hours", "2", "--force").strip() == "1 failed job(s) older than 2 hours were deleted."
    assert list(FailedJob.objects.values_list("pk", flat=True)) == [recent.pk]


@db
def test_flush_asks_first_and_deletes_on_yes():
    fail(jobs.record, "old", hours_ago=5)
    recent = fail(jobs.record, "recent", hours_ago=1)
    out = run("queue_flush", "--hours", "2", stdin=Terminal("yes\n"))
    assert out.startswith("Delete 1 failed job older than 2 hours? [y/N] ")
    assert "1 failed job(s) older than 2 hours were deleted." in out
    assert list(FailedJob.objects.values_list("pk", flat=True)) == [recent.pk]


@pytest.mark.parametrize("answer", ["n\n", "\n", "", "maybe\n"])
@db
def test_flush_deletes_nothing_unless_the_answer_is_yes(answer):
    fail(jobs.record, "a")
    fail(jobs.record, "b")
    out = run("queue_flush", stdin=Terminal(answer))
    assert "Delete 2 failed jobs? [y/N]" in out
    assert out.rstrip().endswith("Nothing was deleted.")
    assert FailedJob.objects.count() == 2


@pytest.mark.parametrize(
    ("args", "stdin", "why"),
    [(["--no-input"], Terminal("y\n"), "--no-input was given"), ([], io.StringIO("y\n"), "stdin is not a terminal")],
)
@db
def test_flush_without_a_terminal_or_with_no_input_needs_force(args, stdin, why):
    fail(jobs.record, "a")
    message = error_of("queue_flush", *args, stdin=stdin)
    assert message == (f"Deleting 1 failed job needs a confirmation, and {why}: pass --force to delete without asking.")
    assert FailedJob.objects.count() == 1


@db
def test_flush_with_no_failed_job_asks_nothing():
    fail(jobs.record, "recent")
    assert (
        run("queue_flush", "--hours", "1", "--no-input").strip()
        == "No failed jobs older than 1 hours: nothing to delete."
    )
    assert FailedJob.objects.count() == 1


@db
def test_flush_deletes_only_the_failed_jobs_it_counted():
    first = fail(jobs.record, "counted")
    counted = operations.prunable()
    later = fail(jobs.record, "failed after the count")
    assert counted.count == 1 and operations.prune_failed(counted=counted) == 1
    assert list(FailedJob.objects.values_list("pk", flat=True)) == [later.pk]
    assert not FailedJob.objects.filter(pk=first.pk).exists()


@db
def test_prune_failed_deletes_the_failed_jobs_older_than_hours():
    fail(jobs.record, "old", hours_ago=30)
    fail(jobs.record, "older", hours_ago=50)
    recent = fail(jobs.record, "recent")
    assert run("queue_prune_failed", "--hours", "24").strip() == ("2 failed job(s) older than 24 hours were deleted.")
    assert list(FailedJob.objects.values_list("pk", flat=True)) == [recent.pk]
    assert run("queue_prune_failed", "--hours", "0.5").strip() == ("0 failed job(s) older than 0.5 hours were deleted.")


# -- queue_clear ---------------------------------------------------------------


@db
def test_clear_with_force_deletes_waiting_and_delayed_jobs_and_keeps_reserved_ones():
    jobs.record.enqueue("reserved")
    reserved = claims.reserve(["default"])
    jobs.record.enqueue("waiting")
    jobs.record.using(delay=3600).enqueue("delayed")
    other = jobs.record.using(queue="emails").enqueue("other queue")
    out = run("queue_clear", "--force")
    assert out.strip() == "2 jobs deleted from queue 'default'."
    assert reserved is not None
    assert set(Job.objects.values_list("pk", flat=True)) == {reserved.pk, other.pk}


@db
def test_clear_clears_the_queue_named_by_the_queue_setting_by_default():
    jobs.record.using(queue="emails").enqueue("a")
    jobs.record.using(queue="default").enqueue("b")
    with override_settings(DBQUEUE={"QUEUE": "emails"}):
        assert "1 job deleted from queue 'emails'." in run("queue_clear", "--force")
    assert list(Job.objects.values_list("queue", flat=True)) == ["default"]


@db
def test_clear_asks_first_and_deletes_on_yes():
    jobs.record.using(queue="emails").enqueue("a")
    jobs.record.using(queue="emails").enqueue("b")
    out = run("queue_clear", "--queue", "emails", stdin=Terminal("y\n"))
    assert out.startswith("Delete 2 jobs from queue 'emails'? [y/N] ")
    assert "2 jobs deleted from queue 'emails'." in out
    assert not Job.objects.exists()


@pytest.mark.parametrize("answer", ["n\n", "\n", "", "maybe\n"])
@db
def test_clear_deletes_nothing_unless_the_answer_is_yes(answer):
    jobs.record.enqueue("a")
    out = run("queue_clear", stdin=Terminal(answer))
    assert "Delete 1 job from queue 'default'? [y/N]" in out
    assert out.rstrip().endswith("Nothing was deleted.")
    assert Job.objects.count() == 1


@pytest.mark.parametrize(
    ("args", "stdin", "why"),
    [(["--no-input"], Terminal("y\n"), "--no-input was given"), ([], io.StringIO("y\n"), "stdin is not a terminal")],
)
@db
def test_clear_without_a_terminal_or_with_no_input_needs_force(args, stdin, why):
    jobs.record.enqueue("a")
    message = error_of("queue_clear", *args, stdin=stdin)
    assert message == (
        f"Deleting 1 job from queue 'default' needs a confirmation, and {why}: pass --force to delete without asking."
    )
    assert Job.objects.count() == 1


@db
def test_clear_of_an_empty_queue_asks_nothing():
    jobs.record.using(queue="emails").enqueue("a")
    out = run("queue_clear", "--no-input")
    assert out.strip() == "Queue 'default' has no waiting or delayed jobs."
    assert Job.objects.count() == 1


# -- queue_monitor -------------------------------------------------------------


@db
def test_monitor_shows_each_queue_sizes_and_the_age_of_its_oldest_waiting_job():
    jobs.record.enqueue("reserved")
    claims.reserve(["default"])
    old = jobs.record.enqueue("waiting for two hours")
    Job.objects.filter(pk=old.pk).update(available_at=timezone.now() - timedelta(hours=2, minutes=5))
    jobs.record.using(delay=3600).enqueue("delayed")
    fail(jobs.record, "failed", queue="emails")
    lines = run("queue_monitor").splitlines()
    assert lines[0].split() == ["queue", "waiting", "delayed", "blocked", "reserved", "failed", "oldest", "waiting"]
    assert lines[1].split() == ["default", "1", "1", "0", "1", "0", "2h"]
    assert lines[2].split() == ["emails", "0", "0", "0", "0", "1", "-"]
    assert len(lines) == 3


@db
def test_monitor_says_so_when_there_are_no_jobs():
    assert run("queue_monitor").strip() == "No jobs."


@db
def test_monitor_shows_only_the_named_queues_in_order_even_empty_ones():
    jobs.record.using(queue="emails").enqueue("a")
    jobs.record.using(queue="reports").enqueue("b")
    lines = run("queue_monitor", "--queue", "reports", "idle", "--queue", "reports").splitlines()
    assert [line.split()[:2] for line in lines[1:]] == [["reports", "1"], ["idle", "0"]]


@db
def test_monitor_with_max_fails_naming_the_queues_over_it():
    for index in range(3):
        jobs.record.using(queue="emails").enqueue(f"e{index}")
    jobs.record.using(queue="reports", delay=60).enqueue("r")
    jobs.record.enqueue("d")
    claims.reserve(["default"])
    jobs.record.enqueue("d2")
    message = error_of("queue_monitor", "--max", "1")
    assert message == "Over 1 job (waiting, delayed and reserved): default (2), emails (3)"


@db
def test_monitor_with_max_exits_0_when_every_queue_is_within_it():
    jobs.record.enqueue("a")
    out = run("queue_monitor", "--max", "1")
    assert out.splitlines()[-1] == "Every queue holds at most 1 job."


@db
def test_monitor_fits_80_columns_with_a_long_queue_name():
    jobs.record.using(queue="q" * 100).enqueue("a")
    assert all(len(line) <= 80 for line in run("queue_monitor").splitlines())


# -- queue_restart -------------------------------------------------------------


@db
def test_restart_records_a_new_marker_and_says_what_workers_do():
    assert operations.restart_marker() is None
    out = run("queue_restart")
    first = operations.restart_marker()
    assert first is not None
    assert "Restart requested at" in out and "finishes its current job and exits" in out
    assert "--concurrency the supervisor exits too" in " ".join(out.split())
    assert all(len(line) <= 80 for line in out.splitlines())
    run("queue_restart")
    second = operations.restart_marker()
    assert second is not None and second > first


# -- operations functions ------------------------------------------------------


@db
def test_retry_failed_ids_retries_all_or_nothing():
    first, second = fail(jobs.record, "a"), fail(jobs.record, "b")
    with pytest.raises(FailedJobsNotFound) as info:
        operations.retry_failed_ids([first.pk, second.pk + 1, second.pk + 2])
    assert info.value.ids == [second.pk + 1, second.pk + 2]
    assert FailedJob.objects.count() == 2 and not Job.objects.exists()
    assert operations.retry_failed_ids([first.pk, second.pk]) == 2
    assert not FailedJob.objects.exists() and Job.objects.count() == 2


@db
def test_retry_failed_ids_handles_a_range_of_a_million_ids():
    failed = fail(jobs.record, "a")
    start = failed.pk
    with pytest.raises(FailedJobsNotFound, match=rf"ids {start + 1}-{start + 999_999}$"):
        operations.retry_failed_ids(operations.parse_ids([f"{start}-{start + 999_999}"]))
    assert operations.retry_failed_ids(operations.parse_ids([f"{start}-{start}"])) == 1


@db
def test_retry_failed_ids_of_more_ids_than_a_statement_takes_does_not_hit_the_variable_limit():
    # Every other id: no two consecutive, so no range shortens them. 250,001 is
    # over SQLite's limit (250,000 here) and PostgreSQL's (65,535).
    failed = [fail(jobs.record, f"k{index}") for index in range(3)]
    absent = [failed[-1].pk + 2 * step for step in range(1, 250_002)]
    with pytest.raises(FailedJobsNotFound) as info:
        operations.retry_failed_ids([row.pk for row in failed] + absent)
    assert len(info.value.ids) == 250_001 and str(info.value).endswith("and 249991 more")
    with pytest.raises(FailedJobsNotFound):
        operations.delete_failed_ids([row.pk for row in failed] + absent)
    assert FailedJob.objects.count() == 3 and not Job.objects.exists()
    assert operations.retry_failed_ids([row.pk for row in failed]) == 3


def test_pk_conditions_keep_each_statement_under_the_parameter_limit():
    ids = [2 * step for step in range(2500)] + list(range(10_000, 20_000))
    conditions = operations._pk_conditions(ids, most=1000)
    assert len(conditions) == 3

    def parameters(condition):
        return sum(
            parameters(child) if hasattr(child, "children") else (len(child[1]) if child[0] == "pk__in" else 2)
            for child in condition.children
        )

    assert [parameters(condition) for condition in conditions] == [1000, 1000, 502]


@db
def test_retry_failed_retries_a_chunk_per_transaction_and_reports_progress():
    failed = [fail(jobs.record, f"k{index}") for index in range(5)]
    seen: list[int] = []
    assert operations.retry_failed(FailedJob.objects.all(), chunk_size=2, progress=seen.append) == 5
    assert seen == [2, 4, 5]
    assert not FailedJob.objects.exists()
    assert sorted(Job.objects.values_list("payload", flat=True)) == sorted(row.payload for row in failed)


@db
def test_retry_failed_keeps_to_its_selection():
    emails = [fail(jobs.record, f"e{index}", queue="emails") for index in range(3)]
    other = fail(jobs.record, "d")
    assert operations.retry_failed(operations.failed_jobs(queue="emails"), chunk_size=2) == 3
    assert list(FailedJob.objects.values_list("pk", flat=True)) == [other.pk]
    assert sorted(Job.objects.values_list("payload", flat=True)) == sorted(row.payload for row in emails)


@pytest.mark.django_db(transaction=True)
def test_an_interrupted_retry_leaves_each_job_retried_or_still_failed():
    failed = [fail(jobs.record, f"k{index}") for index in range(7)]

    def interrupt_after_two_chunks(done: int) -> None:
        if done >= 4:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        operations.retry_failed(FailedJob.objects.all(), chunk_size=2, progress=interrupt_after_two_chunks)
    assert Job.objects.count() == 4 and FailedJob.objects.count() == 3
    retried = list(Job.objects.values_list("payload", flat=True))
    still_failed = list(FailedJob.objects.values_list("payload", flat=True))
    assert sorted(retried + still_failed) == sorted(row.payload for row in failed)
    assert operations.retry_failed(FailedJob.objects.all(), chunk_size=2) == 3
    assert Job.objects.count() == 7 and not FailedJob.objects.exists()


@db
def test_retry_on_a_terminal_draws_a_progress_line_and_a_summary(monkeypatch):
    monkeypatch.setattr(operations, "RETRY_CHUNK", 2)
    for index in range(5):
        fail(jobs.record, f"k{index}")
    terminal = Terminal()
    call_command("queue_retry", "all", "--force", stdout=terminal)
    out = terminal.getvalue()
    assert "\rRetrying: 5 / 5 (100%)" in out
    lines = out.split("\n")
    assert lines[-3].startswith("Retried 5 of 5 in ") and lines[-2] == "5 job(s) were put back on the queue."
    assert Job.objects.count() == 5 and not FailedJob.objects.exists()


@db
def test_retry_off_a_terminal_prints_only_the_summary():
    for index in range(3):
        fail(jobs.record, f"k{index}")
    assert run("queue_retry", "all", "--force") == "3 job(s) were put back on the queue.\n"


@pytest.mark.django_db(transaction=True)
def test_an_interrupted_retry_command_says_how_many_were_retried_and_that_the_rest_are_still_failed(monkeypatch):
    monkeypatch.setattr(operations, "RETRY_CHUNK", 2)
    for index in range(5):
        fail(jobs.record, f"k{index}")
    retried: list[int] = []

    def interrupt_the_second_chunk(sender: Any, job: Job, **kwargs: Any) -> None:
        retried.append(job.pk)
        if len(retried) == 3:
            raise KeyboardInterrupt  # like Ctrl-C, after the second chunk committed

    job_enqueued.connect(interrupt_the_second_chunk, sender=FailedJob)
    try:
        message = error_of("queue_retry", "all", "--force")
    finally:
        job_enqueued.disconnect(interrupt_the_second_chunk, sender=FailedJob)
    assert message == (
        "Interrupted: 4 of 5 job(s) were put back on the queue; the other 1 are still failed jobs "
        "(run the command again to retry them)."
    )
    assert Job.objects.count() == 4 and FailedJob.objects.count() == 1


# -- live workers and unserved queues ------------------------------------------


def worker_row(worker_id: str, queues: str, seen_seconds_ago: float = 0) -> QueueWorker:
    now = timezone.now()
    return QueueWorker.objects.create(
        worker_id=worker_id,
        hostname="host",
        pid=1,
        queues=queues,
        started_at=now - timedelta(hours=1),
        last_seen_at=now - timedelta(seconds=seen_seconds_ago),
    )


@db
def test_live_workers_are_those_seen_within_max_age_and_serve_their_queues():
    live = worker_row("w1", "high,default")
    worker_row("w2", "emails", seen_seconds_ago=120)
    assert list(operations.live_workers()) == [live]
    assert operations.served_queues() == {"high", "default"}
    assert operations.served_queues(max_age=300) == {"high", "default", "emails"}


@db
def test_monitor_warns_about_queues_with_waiting_jobs_and_no_live_worker():
    jobs.record.using(queue="emails").enqueue("a")
    jobs.record.using(queue="emails").enqueue("b")
    jobs.record.enqueue("c")
    jobs.record.using(queue="reports", delay=3600).enqueue("d")
    worker_row("w1", "default")
    worker_row("w2", "emails", seen_seconds_ago=120)
    out, err = io.StringIO(), io.StringIO()
    call_command("queue_monitor", stdout=out, stderr=err)
    assert err.getvalue().splitlines() == [
        "Queue 'emails' has 2 waiting jobs and no live worker serving it (none seen in the last 30 s): "
        "start one with queue_work --queue emails."
    ]
    assert len(out.getvalue().splitlines()) == 4


@db
def test_monitor_warns_about_nothing_when_every_waiting_queue_is_served():
    jobs.record.using(queue="emails").enqueue("a")
    worker_row("w1", "default,emails")
    err = io.StringIO()
    call_command("queue_monitor", "--max", "5", stdout=io.StringIO(), stderr=err)
    assert err.getvalue() == ""


@db
def test_monitor_keeps_its_exit_status_when_it_warns():
    jobs.record.using(queue="emails").enqueue("a")
    err = io.StringIO()
    call_command("queue_monitor", "--max", "1", stdout=io.StringIO(), stderr=err)
    assert "Queue 'emails' has 1 waiting job and no live worker" in err.getvalue()


@db
def test_queue_overview_reads_the_read_database():
    jobs.record.enqueue("a")
    with override_settings(DBQUEUE={"READ_DATABASE": "nowhere"}), pytest.raises(ConnectionDoesNotExist):
        operations.queue_overview()
    with override_settings(DBQUEUE={"READ_DATABASE": "replica"}):
        assert operations.read_alias() == "replica"
    assert operations.read_alias() == "default"
    assert [(item.queue, item.waiting) for item in operations.queue_overview()] == [("default", 1)]


@db
def test_delete_failed_ids_deletes_all_or_nothing():
    first, second = fail(jobs.record, "a"), fail(jobs.record, "b")
    with pytest.raises(FailedJobsNotFound):
        operations.delete_failed_ids([first.pk, second.pk + 1])
    assert FailedJob.objects.count() == 2
    assert operations.delete_failed_ids([first.pk]) == 1
    assert list(FailedJob.objects.values_list("pk", flat=True)) == [second.pk]


@db
def test_prune_failed_deletes_by_age_or_everything():
    fail(jobs.record, "old", hours_ago=10)
    fail(jobs.record, "new")
    assert operations.prune_failed(5) == 1
    assert operations.prune_failed() == 1
    assert not FailedJob.objects.exists()


@db
def test_failed_jobs_filters_and_orders_newest_first():
    old = fail(jobs.record, "a", queue="emails", hours_ago=1)
    new = fail(jobs.record, "b", queue="emails")
    fail(jobs.always_fail, "c", queue="emails")
    fail(jobs.record, "d")
    found = operations.failed_jobs(queue="emails", name="tests.testapp.jobs.record")
    assert list(found) == [new, old]


@db
def test_clear_queue_spares_reserved_jobs_other_queues_and_jobs_enqueued_after_the_count():
    jobs.record.enqueue("reserved")
    reserved = claims.reserve(["default"])
    jobs.record.enqueue("waiting")
    jobs.record.using(delay=60).enqueue("delayed")
    jobs.record.using(queue="emails").enqueue("other")
    counted = operations.clearable("default")
    assert counted.count == 2
    later = jobs.record.enqueue("enqueued after the count")
    assert operations.clear_queue(counted) == 2
    assert reserved is not None
    assert set(Job.objects.filter(queue="default").values_list("pk", flat=True)) == {reserved.pk, later.pk}
    assert operations.clear_queue(operations.clearable("nothing here")) == 0


@db
def test_clear_queue_spares_reserved_jobs_when_a_delete_signal_receiver_is_connected():
    # A receiver makes Django select the rows and delete them by id.
    def receiver(**kwargs: Any) -> None:
        pass

    jobs.record.enqueue("reserved")
    reserved = claims.reserve(["default"])
    jobs.record.enqueue("waiting")
    pre_delete.connect(receiver)
    try:
        assert operations.clear_queue(operations.clearable("default")) == 1
    finally:
        pre_delete.disconnect(receiver)
    assert reserved is not None and list(Job.objects.values_list("pk", flat=True)) == [reserved.pk]


@db
def test_queue_overview_of_keeps_the_order_asked_and_gives_zeros_to_unknown_queues():
    jobs.record.using(queue="emails").enqueue("a")
    stats = operations.queue_overview_of(["none", "emails", "none"])
    assert [(item.queue, item.waiting) for item in stats] == [("none", 0), ("emails", 1)]


def test_queues_over_compares_waiting_delayed_and_reserved_with_the_limit():
    stats = [QueueStats("a", waiting=1, delayed=1, reserved=1, failed=50), QueueStats("b", waiting=2)]
    assert [item.queue for item in operations.queues_over(stats, 2)] == ["a"]
    assert operations.queues_over(stats, 3) == []


@pytest.mark.parametrize(
    ("ids", "text"),
    [
        ([3], "3"),
        ([7, 5, 6, 3, 5], "3, 5-7"),
        (list(range(1, 40, 2)), "1, 3, 5, 7, 9, 11, 13, 15, 17, 19 and 10 more"),
    ],
)
def test_format_ids_writes_ranges_as_parse_ids_reads_them(ids, text):
    assert operations.format_ids(ids) == text
    if "more" not in text:
        assert operations.parse_ids([text]) == sorted(set(ids))


# -- output helpers (no database) ----------------------------------------------


@pytest.mark.parametrize(
    ("text", "width", "short"),
    [
        ("builtins.ValueError", 30, "builtins.ValueError"),
        ("builtins.ValueError", 15, "...ValueError"),
        ("tests.testapp.jobs.always_fail", 22, "...jobs.always_fail"),
        ("pkg.AVeryLongExceptionClassName", 12, "...ClassName"),
        ("transactional-emails", 12, "transacti..."),
    ],
)
def test_shorten_keeps_the_end_of_a_dotted_name_and_the_start_of_other_text(text, width, short):
    assert output.shorten(text, width) == short
    assert len(short) <= width


def test_table_shrinks_the_widest_text_columns_to_fit_and_right_aligns_numbers():
    rows = [["7", "n" * 70, "e" * 50], ["1234", "short", "x"]]
    lines = output.table(["id", "name", "error"], rows, shrink=(1, 2), right=(0,))
    assert all(len(line) <= output.WIDTH for line in lines)
    assert lines[1].startswith("   7  nnn") and lines[2].startswith("1234  short")


@pytest.mark.parametrize(
    ("seconds", "text"),
    [(None, "-"), (0, "0s"), (3.7, "3s"), (59, "59s"), (240, "4m"), (7300, "2h"), (3 * 86400 + 5, "3d")],
)
def test_age_is_written_in_its_largest_whole_unit(seconds, text):
    assert output.age(seconds) == text


# -- acceptance: real worker processes -----------------------------------------


@pytest.mark.acceptance
@pytest.mark.django_db(transaction=True)
def test_restart_makes_a_running_worker_exit_0(worker_process):
    process = worker_process("--sleep", "0.05")
    # The worker reads the marker before it says it started: a restart right after counts.
    process.wait_for_output("worker started")
    run("queue_restart")
    assert process.wait(timeout=15) == 0, process.output()
    assert "reason=restart" in process.output()


@pytest.mark.acceptance
@pytest.mark.django_db(transaction=True)
def test_restart_makes_a_supervised_pool_exit_0(worker_process):
    process = worker_process("--sleep", "0.05", "--concurrency", "2")
    wait_until(lambda: process.output().count("worker started") == 2, 30, "the worker processes never started")
    run("queue_restart")
    assert process.wait(timeout=15) == 0, process.output()
    output_text = process.output()
    assert output_text.count("reason=restart") == 2, output_text
    assert "supervisor stopped" in output_text
