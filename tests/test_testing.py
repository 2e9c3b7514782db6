"""The test helpers (django_dbqueue.testing): each feature run through them, inside ``TestCase``
(the jobs live in the test's open transaction) and ``TransactionTestCase``; the pytest fixtures
with ``db`` and ``transactional_db``; immediate mode; the assertions' messages."""

from __future__ import annotations

import importlib
import tomllib
from pathlib import Path
from typing import Any

import django
import pytest
from django.conf import settings
from django.db import connection, transaction
from django.test import TestCase, TransactionTestCase, override_settings

from django_dbqueue import batch, chain, enqueue, enqueue_many, get_batch, get_progress
from django_dbqueue.checks import check_settings
from django_dbqueue.models import FailedJob, Job, QueueWorker
from django_dbqueue.pytest_plugin import dbqueue, dbqueue_immediate  # noqa: F401 (the plugin's fixtures)
from django_dbqueue.signals import batch_finished
from django_dbqueue.testing import (
    JobsTestMixin,
    assert_enqueued,
    assert_not_enqueued,
    enqueued_jobs,
    run_jobs,
)
from tests.testapp import jobs
from tests.testapp.models import Attempt, Order, Run


class Features(JobsTestMixin):
    """Each feature through the helpers; run as a ``TestCase`` and as a ``TransactionTestCase``."""

    def test_a_chain_with_a_failed_step_runs_its_failure_callback_and_stops(self) -> None:
        chain(jobs.step.bind("c", 1), jobs.failing_step.bind("c", 2), jobs.step.bind("c", 3)).on_failure(
            jobs.record.bind("c-failed")
        ).enqueue()

        ran = self.run_jobs()

        assert [(run.name, run.outcome) for run in ran] == [
            ("tests.testapp.jobs.step", "succeeded"),
            ("tests.testapp.jobs.failing_step", "failed"),
            ("tests.testapp.jobs.record", "succeeded"),
        ]
        assert ran.failed[0].args == ("c", 2)
        assert "step 2 of c broke" in ran.failed[0].error
        assert set(Run.objects.values_list("key", flat=True)) == {"c-1", "c-failed"}
        assert FailedJob.objects.get().name == "tests.testapp.jobs.failing_step"

    def test_a_chain_writes_its_progress_where_the_test_reads_it(self) -> None:
        steps = chain(jobs.step.bind("p", 1), jobs.step.bind("p", 2))
        steps.enqueue()

        self.run_jobs().assert_succeeded()

        progress = get_progress(steps.progress_key)
        assert progress is not None and progress["finished"] is True

    def test_a_batch_runs_its_members_then_its_callbacks(self) -> None:
        handle = (
            batch(jobs.record.bind("b-1"), jobs.always_fail.bind("b-2"), name="nightly")
            .then(jobs.record.bind("b-then"))
            .on_failure(jobs.record.bind("b-failure"))
            .on_finish(jobs.record.bind("b-finish"))
            .enqueue()
        )
        finished: list[int] = []

        def on_finished(sender: Any, batch_id: int, **kwargs: Any) -> None:
            finished.append(batch_id)

        batch_finished.connect(on_finished)
        try:
            ran = self.run_jobs()
        finally:
            batch_finished.disconnect(on_finished)

        assert sorted(Run.objects.values_list("key", flat=True)) == ["b-1", "b-failure", "b-finish"]
        assert [run.outcome for run in ran.of(jobs.always_fail)] == ["released", "failed"]
        assert get_batch(handle.id).state == "failed"
        # batch_finished is sent on commit: run_jobs runs the on_commit callbacks a TestCase never fires.
        assert finished == [handle.id]

    def test_a_retry_runs_at_once_when_its_backoff_is_skipped(self) -> None:
        jobs.fail_with_backoff.enqueue()  # backoff [5, 60], 4 tries

        ran = self.run_jobs()

        assert [(run.outcome, run.attempt) for run in ran] == [
            ("released", 1),
            ("released", 2),
            ("released", 3),
            ("failed", 4),
        ]
        assert [run.delay for run in ran.released] == [5, 60, 60]

    def test_a_retry_waits_for_its_backoff_when_it_is_honoured(self) -> None:
        jobs.fail_once.using(backoff=1).enqueue("honoured")

        ran = self.run_jobs(backoff="honour")

        assert [(run.outcome, run.attempt) for run in ran] == [("released", 1), ("succeeded", 2)]
        assert list(Attempt.objects.order_by("attempt").values_list("attempt", flat=True)) == [1, 2]

    def test_a_delayed_job_waits_unless_asked_for(self) -> None:
        jobs.record.using(delay=3600).enqueue("later")

        assert self.run_jobs() == []
        self.assertEnqueued(jobs.record, "later")
        assert self.run_jobs(delayed=True).names() == ["tests.testapp.jobs.record"]
        assert Run.objects.filter(key="later").exists()

    def test_a_unique_job_is_enqueued_once_until_it_ran(self) -> None:
        unique = jobs.record.using(unique=True)
        first = unique.enqueue("u")
        second = unique.enqueue("u")

        assert second.enqueued is False and second.id == first.id
        self.assertEnqueued(jobs.record, "u", count=1)
        assert [run.outcome for run in self.run_jobs()] == ["succeeded"]
        assert unique.enqueue("u").enqueued is True

    def test_results_are_kept_and_read_through_the_handle(self) -> None:
        with override_settings(DBQUEUE={**settings.DBQUEUE, "RESULTS": True}):
            handle = jobs.add.enqueue(2, 3)
            ran = self.run_jobs("default")

        assert ran[0].result == 5
        handle.refresh()
        assert handle.finished and handle.result == 5

    @pytest.mark.skipif(django.VERSION < (6, 0), reason="django.tasks arrived in Django 6.0")
    def test_a_django_task_is_asserted_and_run_by_its_own_path(self) -> None:
        from tests.testapp.tasks import add_numbers

        result = add_numbers.enqueue(2, 3)

        self.assertEnqueued(add_numbers, 2, 3)
        self.assertNotEnqueued(add_numbers, 2, 4)
        ran = self.run_jobs()
        assert [(run.name, run.args, run.outcome) for run in ran] == [
            ("tests.testapp.tasks.add_numbers", (2, 3), "succeeded")
        ]
        result.refresh()
        assert result.return_value == 5

    def test_run_jobs_stops_with_an_error_when_jobs_still_wait_after_max_jobs(self) -> None:
        for n in range(5):
            jobs.add.enqueue(n, n)
        with self.assertRaisesRegex(RuntimeError, r"after max_jobs=3 runs, with jobs still waiting in \['default'\]"):
            self.run_jobs(max_jobs=3)
        assert len(self.enqueued_jobs(name=jobs.add)) == 2

    def test_a_job_whose_query_fails_leaves_the_tests_transaction_usable(self) -> None:
        jobs.refused_query.enqueue("refused")  # tries=2; on PostgreSQL the query aborts the transaction

        ran = self.run_jobs()

        assert [run.outcome for run in ran] == ["released", "failed"]
        assert "dbqueue_no_such_table" in ran[-1].error
        assert FailedJob.objects.get().name == "tests.testapp.jobs.refused_query"

    def test_the_worker_leaves_no_row_behind(self) -> None:
        jobs.record.enqueue("w")
        self.run_jobs()
        assert not QueueWorker.objects.exists()


class InTestCase(Features, TestCase):
    """The jobs live in the test's open transaction, on the test's connection."""

    def test_jobs_run_in_the_tests_own_transaction(self) -> None:
        assert connection.in_atomic_block
        jobs.record.enqueue("in-transaction")
        self.run_jobs()
        assert Run.objects.filter(key="in-transaction").exists()


class InTransactionTestCase(Features, TransactionTestCase):
    """Every statement commits, as in production."""


# -- assertions without running ---------------------------------------------------------


@pytest.mark.django_db
def test_assert_enqueued_binds_arguments_to_the_signature_and_compares_models_by_pk() -> None:
    order = Order.objects.create(number="A-1")
    jobs.touch_order.enqueue(order)
    jobs.record.enqueue(key="k")  # record(key, note="")

    assert_enqueued(jobs.touch_order, order)
    assert_enqueued(jobs.record, "k", "")
    assert_enqueued("tests.testapp.jobs.record", "k", queue="default")
    assert_not_enqueued(jobs.record, "other")
    assert_not_enqueued(jobs.add)
    (found,) = enqueued_jobs(name=jobs.touch_order)
    assert (found.args[0].label, found.args[0].pk, found.state) == ("testapp.order", order.pk, "waiting")


@pytest.mark.django_db
def test_a_failed_assertion_names_the_call_and_lists_what_was_enqueued() -> None:
    jobs.record.enqueue("a")

    with pytest.raises(AssertionError) as error:
        assert_enqueued(jobs.record, "b", queue="default")
    assert str(error.value).startswith("expected tests.testapp.jobs.record('b') enqueued on queue 'default'; ")
    assert "enqueued: tests.testapp.jobs.record('a') on 'default' (job " in str(error.value)

    with pytest.raises(AssertionError, match=r"expected tests.testapp.jobs.record\(\.\.\.\) not enqueued; found "):
        assert_not_enqueued(jobs.record)
    with pytest.raises(AssertionError, match=r"1 time\(s\), found 0"):
        assert_enqueued(jobs.add, 1, 2, count=1)
    with pytest.raises(TypeError, match="expected a job"):
        assert_enqueued(42)


@pytest.mark.django_db
def test_assert_succeeded_lists_the_runs_that_did_not() -> None:
    jobs.always_fail.enqueue("x")
    ran = run_jobs()
    with pytest.raises(AssertionError, match=r"2 of 2 run\(s\) did not succeed:\n.*always_fail\('x'\).*x always fails"):
        ran.assert_succeeded()


@pytest.mark.django_db
def test_backoff_takes_skip_or_honour_only() -> None:
    with pytest.raises(ValueError, match="must be 'skip' or 'honour', not 'wait'"):
        run_jobs(backoff="wait")  # type: ignore[arg-type]


# -- the pytest fixtures --------------------------------------------------------------


@pytest.mark.django_db
def test_the_fixture_runs_jobs_in_the_tests_transaction(dbqueue) -> None:  # noqa: F811
    jobs.record.enqueue("fixture")
    dbqueue.assert_enqueued(jobs.record, "fixture")
    assert dbqueue.run_jobs().names() == ["tests.testapp.jobs.record"]
    dbqueue.assert_not_enqueued(jobs.record)


@pytest.mark.django_db(transaction=True)
def test_the_fixture_runs_jobs_with_transactional_db(dbqueue) -> None:  # noqa: F811
    jobs.fail_once.enqueue("fixture-tx")
    assert [run.outcome for run in dbqueue.drain()] == ["released", "succeeded"]


# -- immediate mode -------------------------------------------------------------------


@pytest.mark.django_db
def test_immediate_mode_runs_a_job_at_its_enqueue_in_a_test_case(dbqueue_immediate) -> None:  # noqa: F811
    jobs.record.enqueue("now")
    assert Run.objects.filter(key="now").exists()
    assert not Job.objects.exists()


@pytest.mark.django_db
def test_immediate_mode_runs_what_a_job_enqueues_and_its_retries(dbqueue_immediate) -> None:  # noqa: F811
    chain(jobs.step.bind("i", 1), jobs.step.bind("i", 2)).enqueue()
    jobs.fail_once.enqueue("retried")
    assert set(Run.objects.values_list("key", flat=True)) == {"i-1", "i-2", "retried"}


@pytest.mark.django_db(transaction=True)
def test_immediate_mode_waits_for_the_enqueues_transaction_to_commit(dbqueue_immediate) -> None:  # noqa: F811
    with transaction.atomic():
        jobs.record.enqueue("committed")
        assert not Run.objects.filter(key="committed").exists()
    assert Run.objects.filter(key="committed").exists()

    with pytest.raises(RuntimeError), transaction.atomic():
        jobs.record.enqueue("rolled-back")
        raise RuntimeError("rollback")
    assert not Run.objects.filter(key="rolled-back").exists()


@pytest.mark.django_db(transaction=True)
def test_immediate_mode_runs_batches_and_streamed_enqueue_many_once_they_commit(dbqueue_immediate) -> None:  # noqa: F811
    batch(jobs.record.bind("m-1"), jobs.record.bind("m-2")).on_finish(jobs.record.bind("m-done")).enqueue()
    enqueue_many((jobs.record.bind(f"s-{n}") for n in range(5)), batch_size=2)  # three batches, one transaction

    keys = set(Run.objects.values_list("key", flat=True))
    assert keys == {"m-1", "m-2", "m-done", *(f"s-{n}" for n in range(5))}
    assert not Job.objects.exists()


@pytest.mark.django_db
def test_immediate_mode_in_a_test_case_runs_at_a_captured_commit(
    dbqueue_immediate,  # noqa: F811
    django_capture_on_commit_callbacks: Any,
) -> None:
    with transaction.atomic():
        jobs.record.enqueue("deferred")
    assert not Run.objects.filter(key="deferred").exists()  # a TestCase never commits

    with django_capture_on_commit_callbacks(execute=True), transaction.atomic():
        jobs.record.enqueue("captured")
    assert Run.objects.filter(key="captured").exists()


@pytest.mark.django_db
def test_immediate_mode_is_off_by_default() -> None:
    jobs.record.enqueue("queued")
    assert not Run.objects.exists()
    assert_enqueued(jobs.record, "queued")


@pytest.mark.django_db
def test_immediate_mode_without_the_helpers_says_what_to_import(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(enqueue, "_run_stored", None)
    immediate = {**settings.DBQUEUE, "IMMEDIATE": True}
    with (
        override_settings(DBQUEUE=immediate),
        pytest.raises(Exception, match=r"django_dbqueue.testing was not imported"),
    ):
        jobs.record.enqueue("nobody")


def test_the_immediate_setting_must_be_a_bool() -> None:
    with override_settings(DBQUEUE={"IMMEDIATE": "yes"}):
        messages = check_settings()
    assert [message.id for message in messages] == ["dbqueue.E003"]
    assert "IMMEDIATE" in messages[0].msg and "a bool" in messages[0].msg


def test_the_plugin_is_registered_for_pytest_and_holds_the_fixtures() -> None:
    pyproject = tomllib.loads((Path(__file__).resolve().parent.parent / "pyproject.toml").read_text())
    plugin = importlib.import_module(pyproject["project"]["entry-points"]["pytest11"]["django_dbqueue"])
    assert {"dbqueue", "dbqueue_immediate"} <= set(vars(plugin))
