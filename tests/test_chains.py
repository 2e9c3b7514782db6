"""Chains, callbacks and progress."""

from __future__ import annotations

import datetime as dt
import json
import signal

import pytest
from django.test import Client

from django_dbqueue import chain, get_progress, lifecycle
from django_dbqueue.models import FailedJob, Job, JobProgress
from django_dbqueue.progress import progress_token
from tests.conftest import run_worker, wait_until
from tests.testapp import jobs
from tests.testapp.models import Attempt, Run

pytestmark = pytest.mark.django_db(transaction=True)


def run_keys() -> list[str]:
    return list(Run.objects.order_by("id").values_list("key", flat=True))


def test_a_three_step_chain_runs_in_order_each_step_once():
    pipeline = chain(jobs.step.bind("c", 1), jobs.step.bind("c", 2), jobs.step.bind("c", 3))
    pipeline.enqueue()
    run_worker()
    assert run_keys() == ["c-1", "c-2", "c-3"]
    assert not Job.objects.exists() and not FailedJob.objects.exists()
    progress = get_progress(pipeline.progress_key)
    assert progress is not None
    assert (progress["percent"], progress["finished"], progress["failed"]) == (100, True, False)


def test_the_next_step_is_enqueued_in_the_transaction_that_deletes_the_finished_one():
    pipeline = chain(jobs.step.bind("h", 1), jobs.step.bind("h", 2), jobs.step.bind("h", 3))
    first = pipeline.enqueue()
    run_worker(once=True)
    assert run_keys() == ["h-1"]
    second = Job.objects.get()
    assert second.pk != first.pk and second.name == jobs.step.name and second.attempts == 0
    envelope = json.loads(second.payload)
    assert envelope["args"] == ["h", 2]
    assert envelope["chain"] == {"id": pipeline.id, "step": 2, "total": 3}
    assert [step["args"] for step in envelope["next"]] == [["h", 3]]
    assert get_progress(pipeline.progress_key)["percent"] == 33.33


def test_a_failing_middle_step_stops_the_chain_and_keeps_the_rest_visible():
    pipeline = chain(jobs.step.bind("f", 1), jobs.failing_step.bind("f", 2), jobs.step.bind("f", 3)).on_failure(
        jobs.record.bind("f-cleanup")
    )
    pipeline.enqueue()
    run_worker()
    assert run_keys() == ["f-1", "f-cleanup"]
    failed = FailedJob.objects.get()
    assert failed.name == jobs.failing_step.name
    envelope = json.loads(failed.payload)
    assert [(step["name"], step["args"]) for step in envelope["next"]] == [(jobs.step.name, ["f", 3])]
    progress = get_progress(pipeline.progress_key)
    assert progress["failed"] and not progress["finished"]
    assert progress["error"] == "RuntimeError: step 2 of f broke"
    assert progress["percent"] == 33.33

    # Retrying the failed step resumes the chain from it.
    Run.objects.create(key="f-allow")
    lifecycle.retry(FailedJob.objects.filter(pk__in=[failed.pk]))
    run_worker()
    assert run_keys() == ["f-1", "f-cleanup", "f-allow", "f-2", "f-3"]
    assert not FailedJob.objects.exists() and not Job.objects.exists()
    assert get_progress(pipeline.progress_key)["finished"]


def test_then_callbacks_run_after_a_job_or_a_whole_chain_succeeds():
    jobs.step.bind("single", 1).then(jobs.record.bind("after-single")).enqueue()
    chain(jobs.step.bind("whole", 1), jobs.step.bind("whole", 2)).then(
        jobs.record.bind("after-chain-a"), jobs.record.bind("after-chain-b")
    ).enqueue()
    run_worker()
    keys = run_keys()
    assert keys.index("after-single") > keys.index("single-1")
    assert keys.index("after-chain-a") > keys.index("whole-2") and "after-chain-b" in keys


def test_callbacks_of_a_failed_job_are_not_enqueued():
    jobs.failing_step.bind("nope", 1).then(jobs.record.bind("never")).enqueue()
    run_worker()
    assert "never" not in run_keys() and FailedJob.objects.count() == 1


def test_a_jobs_progress_is_stored_under_its_id_and_marked_finished():
    row = jobs.progress_step.enqueue("p")
    run_worker()
    progress = get_progress(str(row.pk))
    assert (progress["percent"], progress["stage"], progress["finished"]) == (100, "finished", True)


def test_progress_of_a_failed_job_says_failed_and_is_not_rolled_back_with_the_job():
    row = jobs.progress_then_fail.enqueue("rolled-back")
    run_worker()
    assert not Run.objects.exists()  # the job's own transaction was rolled back
    progress = get_progress(str(row.pk))
    assert (progress["percent"], progress["failed"], progress["finished"]) == (30, True, False)
    assert progress["error"] == "ValueError: rolled-back gave up at 30%"


def test_percent_is_clamped_and_a_chain_step_reports_its_share_of_the_chain():
    from django_dbqueue.progress import Tracker

    assert Tracker(1, None).overall(150) == 100 and Tracker(1, None).overall(-5) == 0
    assert Tracker(1, {"id": "x", "step": 2, "total": 4}).overall(50) == pytest.approx(37.5)


def test_the_json_view_returns_progress_and_404_for_an_unknown_key():
    from django_dbqueue.progress import set_progress

    set_progress("chain:abc", 42, "resizing")
    response = Client().get("/queue/progress/chain:abc/", {"token": progress_token("chain:abc")})
    assert response.status_code == 200 and response["Cache-Control"] == "no-store"
    assert {k: response.json()[k] for k in ("key", "percent", "stage", "finished")} == {
        "key": "chain:abc",
        "percent": 42,
        "stage": "resizing",
        "finished": False,
    }
    assert Client().get("/queue/progress/404/", {"token": progress_token("404")}).status_code == 404


def test_queue_prune_progress_deletes_old_rows(capsys):
    from django.core.management import call_command
    from django.db.models import F

    from django_dbqueue.progress import set_progress

    set_progress("old", 10)
    set_progress("new", 10)
    JobProgress.objects.filter(key="old").update(updated_at=F("updated_at") - dt.timedelta(hours=5))
    call_command("queue_prune_progress", "--hours", "2")
    assert list(JobProgress.objects.values_list("key", flat=True)) == ["new"]
    assert "Deleted 1 progress row" in capsys.readouterr().out


@pytest.mark.acceptance
def test_progress_written_by_a_worker_process_is_read_by_this_process(worker_process):
    row = jobs.progress_step.enqueue("watched", 3)
    process = worker_process("--sleep", "0.05")
    wait_until(lambda: (get_progress(str(row.pk)) or {}).get("percent") == 50, 30, "progress never reached 50%")
    assert get_progress(str(row.pk))["stage"] == "halfway"
    wait_until(lambda: (get_progress(str(row.pk)) or {}).get("finished"), 30, "progress never finished")
    process.signal(signal.SIGTERM)
    assert process.wait(timeout=30) == 0


@pytest.mark.acceptance
def test_a_worker_killed_between_steps_loses_nothing_and_runs_no_step_twice(worker_process):
    chain(jobs.step.bind("k", 1), jobs.slow_step.bind("k", 2, 1.8), jobs.step.bind("k", 3)).enqueue()
    first = worker_process("--sleep", "0.05")
    wait_until(lambda: Attempt.objects.filter(key="k-2").exists(), 30, "step 2 never started")
    first.signal(signal.SIGKILL)
    first.wait(timeout=10)
    second = worker_process("--sleep", "0.1")
    wait_until(lambda: Run.objects.filter(key="k-3").exists(), 30, "the chain did not finish")
    second.signal(signal.SIGTERM)
    assert second.wait(timeout=30) == 0
    assert run_keys() == ["k-1", "k-2", "k-3"]
    assert list(Attempt.objects.order_by("attempt").values_list("attempt", flat=True)) == [1, 2]
    assert not Job.objects.exists() and not FailedJob.objects.exists()


def test_an_idle_worker_prunes_old_progress_when_configured(settings):
    import datetime as dt

    from django.db.models import F

    from django_dbqueue.progress import set_progress

    set_progress("stale", 10)
    set_progress("fresh", 10)
    JobProgress.objects.filter(key="stale").update(updated_at=F("updated_at") - dt.timedelta(hours=3))
    settings.DBQUEUE = {**settings.DBQUEUE, "PROGRESS_MAX_AGE": 2}
    run_worker(max_time=0.3, stop_when_empty=False, sleep=0.05)  # idle: no jobs
    assert list(JobProgress.objects.values_list("key", flat=True)) == ["fresh"]
