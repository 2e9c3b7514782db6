"""The batch commands (queue_batches, queue_retry_batch, queue_cancel_batch,
queue_prune_batches), on batches enqueued with ``batch(...)`` and run by a
worker in this process."""

from __future__ import annotations

import io
from datetime import timedelta

import pytest
from django.core.management import call_command, load_command_class
from django.core.management.base import CommandError
from django.utils import timezone

from django_dbqueue import batch, claims, get_batch
from django_dbqueue.models import BatchState, FailedJob, Job, JobBatch
from tests.conftest import run_worker
from tests.testapp import jobs

db = pytest.mark.django_db(transaction=True)
# Thin commands over batches.py: scripts/test runs these with one Django.
pytestmark = pytest.mark.one_django

COMMANDS = ["queue_batches", "queue_retry_batch", "queue_cancel_batch", "queue_prune_batches"]


def run(name: str, *args: str) -> str:
    """Run a command; return its stdout."""
    out = io.StringIO()
    call_command(name, *args, stdout=out, stderr=io.StringIO())
    return out.getvalue()


def error_of(name: str, *args: str) -> str:
    with pytest.raises(CommandError) as info:
        run(name, *args)
    return str(info.value)


def help_of(name: str) -> str:
    return " ".join(load_command_class("django_dbqueue", name).create_parser("manage.py", name).format_help().split())


def enqueue(prefix: str, count: int, *, failing: int = 0, name: str = "") -> int:
    """Enqueue a batch of ``count`` members, the first ``failing`` of which fail; return its id."""
    members = [jobs.member.bind(f"{prefix}{i}", fail=i < failing) for i in range(count)]
    return batch(*members, name=name).enqueue().id


def counts(batch_id: int) -> tuple[int, int, int, int]:
    row = JobBatch.objects.get(pk=batch_id)
    return row.total, row.pending, row.failed, row.cancelled


def listed(text: str) -> list[list[str]]:
    """The rows of the queue_batches table, split into cells (the names used here have no spaces)."""
    return [line.split() for line in text.splitlines()[1:]]


def one_of_each_state() -> dict[str, int]:
    """A batch in each state: ``{state: batch id}``."""
    ids = {"finished": enqueue("ok", 2, name="finished"), "failed": enqueue("bad", 2, failing=1, name="failed")}
    run_worker()
    ids["cancelling"] = enqueue("held", 2, name="cancelling")
    held = claims.reserve(["default"])  # a worker holds one member: it is left to finish
    assert held is not None and held.batch_id == ids["cancelling"]
    ids["running"] = enqueue("run", 2, name="running")
    ids["cancelled"] = enqueue("gone", 2, name="cancelled")
    get_batch(ids["cancelling"]).cancel()
    get_batch(ids["cancelled"]).cancel()
    assert {state: get_batch(pk).state for state, pk in ids.items()} == {state: state for state in ids}
    return ids


# -- every command -------------------------------------------------------------


@pytest.mark.parametrize("name", COMMANDS)
def test_every_batch_command_has_a_help_text(name):
    assert load_command_class("django_dbqueue", name).help


@pytest.mark.parametrize(
    ("name", "default"),
    [
        ("queue_batches", "(default: 50)"),
        ("queue_batches", "(default: every state)"),
        ("queue_batches", "(default: every name)"),
        ("queue_prune_batches", "(required, no default)"),
    ],
)
def test_help_shows_the_defaults(name, default):
    assert default in help_of(name)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["queue_batches", "--limit", "0"], "'0' must be at least 1"),
        (["queue_batches", "--limit", "many"], "'many' is not a whole number"),
        (["queue_batches", "--state", "done"], "argument --state: invalid choice: 'done'"),
        (["queue_retry_batch"], "the following arguments are required: ID"),
        (["queue_retry_batch", "x"], "'x' is not a whole number"),
        (["queue_retry_batch", "0"], "'0' must be at least 1"),
        (["queue_retry_batch", "9" * 20], "must be at most 9223372036854775807"),
        (["queue_cancel_batch"], "the following arguments are required: ID"),
        (["queue_cancel_batch", "3-5"], "'3-5' is not a whole number"),
        (["queue_cancel_batch", "-1"], "'-1' must be at least 1"),
        (["queue_prune_batches"], "the following arguments are required: --hours"),
        (["queue_prune_batches", "--hours", "0"], "'0' must be more than 0 hours"),
        (["queue_prune_batches", "--hours", "soon"], "'soon' is not a number of hours"),
        (["queue_prune_batches", "--hours", "1e9"], "is more than 876000 hours"),
    ],
)
def test_a_bad_argument_is_refused_with_a_clear_message(args, message):
    # No database: argparse refuses the input before the command runs.
    assert message in error_of(*args)


# -- queue_batches -------------------------------------------------------------


@db
def test_batches_lists_each_batch_newest_first_with_its_counts():
    old = enqueue("a", 4, failing=1, name="thumbnails")
    run_worker()
    new = enqueue("b", 3, name="reports")
    lines = run("queue_batches").splitlines()
    assert lines[0].split() == ["id", "name", "state", "done", "%", "failed", "cancelled", "created", "finished"]
    rows = listed("\n".join(lines))
    assert rows[0][:7] == [str(new), "reports", "running", "0/3", "0%", "0", "0"]
    assert rows[0][8:] == ["ago", "-"]  # created a moment ago, not finished
    assert rows[1][:7] == [str(old), "thumbnails", "failed", "4/4", "100%", "1", "0"]
    assert rows[1][8] == "ago" and rows[1][10:] == ["ago"]
    assert all(len(line) <= 79 for line in lines)


@db
def test_batches_says_so_when_there_are_none():
    assert run("queue_batches").strip() == "No batches."


@db
def test_batches_ages_are_read_against_the_database_clock():
    pk = enqueue("a", 1)
    JobBatch.objects.filter(pk=pk).update(created_at=timezone.now() - timedelta(hours=3, minutes=5))
    assert listed(run("queue_batches"))[0][7:] == ["3h", "ago", "-"]


@db
def test_batches_percent_is_rounded_down_so_100_means_every_member_ended():
    pk = enqueue("a", 3)
    JobBatch.objects.filter(pk=pk).update(total=2000, pending=1)  # 99.95% ended
    assert listed(run("queue_batches"))[0][3:5] == ["1999/2000", "99%"]


@db
def test_batches_filters_by_state_and_by_name():
    ids = one_of_each_state()
    for state, pk in ids.items():
        assert [row[0] for row in listed(run("queue_batches", "--state", state))] == [str(pk)], state
    both = listed(run("queue_batches", "--state", "running", "cancelling"))
    assert {row[0] for row in both} == {str(ids["running"]), str(ids["cancelling"])}
    assert [row[0] for row in listed(run("queue_batches", "--name", "failed"))] == [str(ids["failed"])]
    assert run("queue_batches", "--name", "no such batch").strip() == "No batches."


@db
def test_each_state_filter_selects_exactly_the_batches_in_that_state():
    one_of_each_state()
    assert set(BatchState.values) == {"running", "finished", "failed", "cancelling", "cancelled"}
    for state in BatchState:
        expected = {row.pk for row in JobBatch.objects.all() if row.state == state}
        assert set(JobBatch.objects.in_state(state).values_list("pk", flat=True)) == expected, state
        listed_ids = {row[0] for row in listed(run("queue_batches", "--state", state.value))}
        assert listed_ids == {str(pk) for pk in expected}, state


@db
def test_batches_shows_at_most_limit_batches_and_says_how_many_there_are():
    ids = [enqueue(f"k{index}-", 1) for index in range(4)]
    lines = run("queue_batches", "--limit", "2").splitlines()
    assert len(lines) == 4  # header, two batches, the note
    assert [line.split()[0] for line in lines[1:3]] == [str(ids[3]), str(ids[2])]
    assert lines[-1] == "2 of 4 batches shown; --limit shows more."


@db
def test_batches_shortens_a_long_name_to_fit_80_columns():
    enqueue("a", 1, name="nightly-thumbnails-for-every-product-photo-uploaded-today")
    text = run("queue_batches")
    assert all(len(line) <= 80 for line in text.splitlines()), text
    assert "nightly-" in text and "..." in text


# -- queue_retry_batch -----------------------------------------------------------


@db
def test_retry_batch_puts_the_failed_members_back_and_reopens_the_batch():
    failing = enqueue("a", 4, failing=2)
    clean = enqueue("b", 2)
    run_worker()
    assert counts(failing) == (4, 0, 2, 0)
    lines = run("queue_retry_batch", str(failing), str(clean)).splitlines()
    assert lines == [
        f"Batch {failing}: 2 failed members put back on the queue.",
        f"Batch {clean} has no failed members: nothing to retry.",
    ]
    assert counts(failing) == (4, 2, 0, 0) and get_batch(failing).state == "running"
    assert Job.objects.filter(batch_id=failing).count() == 2
    assert not FailedJob.objects.exists()
    run_worker()  # they fail again: the batch finishes failed again
    assert counts(failing) == (4, 0, 2, 0) and get_batch(failing).state == "failed"


@db
def test_retry_batch_of_an_unknown_id_names_it_and_retries_nothing():
    pk = enqueue("a", 2, failing=2)
    run_worker()
    message = error_of("queue_retry_batch", str(pk), "999998", "999999")
    assert message == "Nothing was retried: no batch has the ids 999998-999999 (unknown, or pruned)."
    assert "no batch has the id 999999 " in error_of("queue_retry_batch", "999999", str(pk))
    assert FailedJob.objects.filter(batch_id=pk).count() == 2 and not Job.objects.exists()
    assert counts(pk) == (2, 0, 2, 0)


@db
def test_retry_batch_of_a_cancelled_batch_is_refused_and_retries_nothing():
    retryable = enqueue("b", 1, failing=1)
    run_worker()
    pk = enqueue("a", 3, failing=1)
    run_worker(max_jobs=1, batch=1)  # its failing member, enqueued first
    get_batch(pk).cancel()
    message = error_of("queue_retry_batch", str(retryable), str(pk))
    assert message == f"Nothing was retried: batch {pk} was cancelled, and members of a cancelled batch do not run."
    assert counts(pk) == (3, 0, 1, 2) and FailedJob.objects.filter(batch_id=pk).count() == 1
    assert counts(retryable) == (1, 0, 1, 0) and FailedJob.objects.filter(batch_id=retryable).count() == 1
    assert not Job.objects.exists()


@db
def test_retry_batch_says_when_a_member_stays_failed_because_its_unique_key_is_held():
    unique_member = jobs.member.using(unique=True)
    pk = batch(unique_member.bind("k", fail=True), jobs.member.bind("other", fail=True)).enqueue().id
    run_worker()
    unique_member.enqueue("k", fail=True)  # holds the key the failed member needs
    text = run("queue_retry_batch", str(pk)).strip()
    assert text == (
        f"Batch {pk}: 1 failed member put back on the queue; "
        "1 still failed (another job holds its unique key, or it failed again)."
    )
    assert counts(pk) == (2, 1, 1, 0)


# -- queue_cancel_batch ----------------------------------------------------------


@db
def test_cancel_batch_deletes_the_waiting_members_and_leaves_running_ones_to_finish():
    pk = enqueue("a", 4)
    other = enqueue("b", 2)
    held = claims.reserve(["default"])
    assert held is not None and held.batch_id == pk
    lines = run("queue_cancel_batch", str(pk), str(other)).splitlines()
    assert lines == [
        f"Batch {pk} cancelled: 3 waiting members deleted; 1 running member will finish.",
        f"Batch {other} cancelled: 2 waiting members deleted.",
    ]
    assert counts(pk) == (4, 1, 0, 3) and get_batch(pk).state == "cancelling"
    assert counts(other) == (2, 0, 0, 2) and get_batch(other).state == "cancelled"
    assert list(Job.objects.values_list("pk", flat=True)) == [held.pk]


@db
def test_cancel_batch_of_a_cancelled_or_finished_batch_says_there_is_nothing_to_cancel():
    done = enqueue("a", 1)
    run_worker()
    cancelled = enqueue("b", 1)
    get_batch(cancelled).cancel()
    lines = run("queue_cancel_batch", str(done), str(cancelled)).splitlines()
    assert lines == [
        f"Batch {done} has finished already: nothing to cancel.",
        f"Batch {cancelled} was cancelled already: nothing to cancel.",
    ]
    assert counts(done) == (1, 0, 0, 0) and counts(cancelled) == (1, 0, 0, 1)


@db
def test_cancel_batch_of_an_unknown_id_names_it_and_cancels_nothing():
    pk = enqueue("a", 3)
    message = error_of("queue_cancel_batch", str(pk), "999999")
    assert message == "Nothing was cancelled: no batch has the id 999999 (unknown, or pruned)."
    assert counts(pk) == (3, 3, 0, 0) and get_batch(pk).state == "running"
    assert Job.objects.filter(batch_id=pk).count() == 3


# -- queue_prune_batches ---------------------------------------------------------


@db
def test_prune_batches_deletes_the_batches_finished_more_than_hours_ago():
    old = enqueue("a", 2, failing=1)
    recent = enqueue("b", 1)
    run_worker()
    running = enqueue("c", 1)
    JobBatch.objects.filter(pk=old).update(finished_at=timezone.now() - timedelta(hours=30))
    JobBatch.objects.filter(pk=running).update(created_at=timezone.now() - timedelta(hours=30))
    assert run("queue_prune_batches", "--hours", "24").strip() == "Deleted 1 batch(es) finished more than 24 h ago."
    assert set(JobBatch.objects.values_list("pk", flat=True)) == {recent, running}
    assert FailedJob.objects.filter(batch_id=old).count() == 1  # failed members stay failed jobs
    assert run("queue_prune_batches", "--hours", "0.5").strip() == "Deleted 0 batch(es) finished more than 0.5 h ago."
