"""The claim and the compare-and-set state changes, on the real database."""

import datetime as dt
import math
import re
import time

import pytest
from django.db import connection
from django.db.models import F
from django.test.utils import CaptureQueriesContext

from django_dbqueue import claims, lifecycle
from django_dbqueue.handles import JobStatus as HandleStatus
from django_dbqueue.models import DB_NOW, FailedJob, Job, JobStatus, State
from tests.testapp import jobs

pytestmark = pytest.mark.django_db


def expire(job: Job, seconds: int = 3600) -> None:
    """Move a reservation into the past, as if its worker had died long ago."""
    Job.objects.filter(pk=job.pk).update(reserved_at=F("reserved_at") - dt.timedelta(seconds=seconds))


def test_reserve_bumps_attempts_and_sets_reserved_at_and_the_worker():
    row = jobs.add.enqueue(1, 2)
    job = claims.reserve(["default"], worker_id="host:1:abc")
    assert job is not None and job.pk == row.pk
    stored = Job.objects.get(pk=row.pk)
    assert (stored.attempts, stored.reserved_by) == (1, "host:1:abc")
    assert stored.reserved_at is not None and stored.reserved_at == job.reserved_at
    assert claims.reserve(["default"]) is None


def test_reserve_takes_the_first_non_empty_queue_in_the_list():
    low = jobs.add.using(queue="low").enqueue(1, 1)
    high = jobs.add.using(queue="high").enqueue(2, 2)
    assert claims.reserve(["high", "low"]).pk == high.pk
    assert claims.reserve(["high", "low"]).pk == low.pk
    assert claims.reserve(["high", "low"]) is None


def test_reserve_takes_higher_priority_first_then_oldest():
    first = jobs.add.enqueue(1, 1)
    second = jobs.add.enqueue(2, 2)
    urgent = jobs.add.using(priority=10).enqueue(3, 3)
    order = [claims.reserve(["default"]).pk for _ in range(3)]
    assert order == [urgent.pk, first.pk, second.pk]


def test_reserve_many_hands_out_distinct_rows_up_to_the_limit():
    rows = [jobs.add.enqueue(i, i) for i in range(5)]
    first = claims.reserve_many(["default"], limit=3)
    second = claims.reserve_many(["default"], limit=3)
    assert [job.pk for job in first] == [row.pk for row in rows[:3]]
    assert [job.pk for job in second] == [row.pk for row in rows[3:]]
    assert Job.objects.reserved().count() == 5


def test_the_busy_path_does_not_look_for_expired_reservations():
    jobs.add.enqueue(1, 1)
    with CaptureQueriesContext(connection) as queries:
        claims.reserve(["default"])
    # The reclaim reads reserved rows: ``reserved_at IS NOT NULL``.
    assert not any('reserved_at" IS NOT NULL' in query["sql"].replace("`", '"') for query in queries.captured_queries)


def test_an_expired_reservation_is_reclaimed_and_reserved_again_with_attempts_counted():
    row = jobs.add.enqueue(1, 2)
    first = claims.reserve(["default"], worker_id="dead")
    assert claims.reserve(["default"]) is None  # not expired yet
    expire(first)
    second = claims.reserve(["default"], worker_id="alive")
    assert second is not None and second.pk == row.pk
    assert (second.attempts, second.reserved_by) == (2, "alive")


def test_a_reclaimed_job_that_used_its_tries_moves_to_failed_job():
    row = jobs.add.using(tries=1).enqueue(1, 2)
    expire(claims.reserve(["default"]))
    assert claims.reserve(["default"]) is None
    failed = FailedJob.objects.get()
    assert (failed.job_id, failed.name, failed.attempts) == (row.pk, "tests.add", 1)
    assert failed.exception_class == "django_dbqueue.exceptions.MaxAttemptsExceeded"
    assert "attempted too many times or ran too long" in failed.error
    assert not Job.objects.exists()


def test_a_late_delete_release_or_fail_does_not_touch_the_new_reservation():
    jobs.add.enqueue(1, 2)
    stale = claims.reserve(["default"], worker_id="slow")
    expire(stale)
    current = claims.reserve(["default"], worker_id="fast")
    assert current.attempts == stale.attempts + 1

    assert lifecycle.delete(stale) is False
    assert lifecycle.release(stale, delay=0) is False
    assert lifecycle.fail(stale, error="late", exception_class="x") is None
    stored = Job.objects.get()
    assert (stored.attempts, stored.reserved_by) == (current.attempts, "fast")
    assert stored.reserved_at is not None and not FailedJob.objects.exists()

    assert lifecycle.delete(current) is True
    assert not Job.objects.exists()


def test_release_makes_the_job_available_after_its_delay():
    jobs.add.enqueue(1, 2)
    job = claims.reserve(["default"])
    assert lifecycle.release(job, delay=3600)
    stored = Job.objects.get()
    assert stored.reserved_at is None and stored.reserved_by == ""
    assert Job.objects.delayed().count() == 1 and claims.reserve(["default"]) is None
    lifecycle.release(stored, delay=0)
    assert claims.reserve(["default"]).attempts == 2


def test_fail_moves_the_job_to_failed_job_in_one_transaction():
    row = jobs.add.enqueue(1, 2).job
    job = claims.reserve(["default"])
    failed = lifecycle.fail(job, error="Traceback...\nValueError: no", exception_class="builtins.ValueError")
    assert failed is not None
    failed.refresh_from_db()
    assert (failed.job_id, failed.payload, failed.error_summary) == (row.pk, row.payload, "ValueError: no")
    assert failed.created_at == row.created_at and failed.failed_at >= row.created_at
    assert not Job.objects.exists()


def test_reclaim_worker_releases_a_dead_workers_jobs_at_once():
    jobs.add.enqueue(1, 2)
    jobs.add.using(tries=1).enqueue(3, 4)
    jobs.add.enqueue(5, 6)
    held = claims.reserve_many(["default"], limit=2, worker_id="dead")
    claims.reserve(["default"], worker_id="alive")
    count = lifecycle.reclaim_worker("dead", error_for=lambda elapsed: f"died after {elapsed:.0f} s")
    assert count == 2
    assert Job.objects.waiting().get().pk == held[0].pk
    assert re.fullmatch(r"died after \d+ s", FailedJob.objects.get().error)
    assert Job.objects.reserved().get().reserved_by == "alive"


def test_a_delete_signal_receiver_does_not_split_the_compare_and_set_delete():
    """With a receiver, QuerySet.delete() would SELECT then DELETE by id, racing a new reservation."""
    from django.db.models.signals import post_delete

    def audit(**kwargs):
        pass

    post_delete.connect(audit)
    try:
        jobs.add.enqueue(1, 2)
        job = claims.reserve(["default"])
        with CaptureQueriesContext(connection) as queries:
            assert lifecycle.delete(job) is True
        statements = [q["sql"] for q in queries.captured_queries]
        assert len(statements) == 1 and statements[0].startswith("DELETE")
        assert "attempts" in statements[0]
    finally:
        post_delete.disconnect(audit)


def test_every_state_names_the_same_rows_in_sql_and_on_a_row_read_with_the_database_clock():
    waiting = jobs.add.enqueue(1, 1)
    delayed = jobs.add.using(delay=3600).enqueue(2, 2)
    blocked = jobs.add.enqueue(3, 3)
    Job.objects.filter(pk=blocked.pk).update(blocked=True)
    reserved, expired = jobs.add.using(priority=5).enqueue(4, 4), jobs.add.using(priority=6).enqueue(5, 5)
    claims.reserve_many(["default"], limit=2)
    expire(Job.objects.get(pk=expired.pk))
    expected = {
        State.WAITING: waiting.pk,
        State.DELAYED: delayed.pk,
        State.BLOCKED: blocked.pk,
        State.RESERVED: reserved.pk,
        State.EXPIRED: expired.pk,
    }
    for state, pk in expected.items():
        assert list(Job.objects.get_queryset().in_state(state).values_list("pk", flat=True)) == [pk]
        row = Job.objects.annotate(**DB_NOW).get(pk=pk)
        assert row.state(row.db_now) is state
    assert [str(state.label) for state in State] == ["waiting", "delayed", "blocked", "reserved", "reservation expired"]


def test_each_state_reads_as_a_handle_status():
    assert [(status.value, status.finished) for status in JobStatus] == [
        (status.value, status.finished) for status in HandleStatus
    ]
    assert {state: state.status for state in State} == {
        State.WAITING: JobStatus.WAITING,
        State.DELAYED: JobStatus.DELAYED,
        State.BLOCKED: JobStatus.WAITING,
        State.RESERVED: JobStatus.RUNNING,
        State.EXPIRED: JobStatus.RUNNING,
    }


# -- finishing a batch and claiming the next ---------------------------------------


def test_finish_and_reserve_deletes_the_batch_that_ran_and_claims_from_the_next_non_empty_queue():
    ran = [jobs.add.using(queue="high").enqueue(i, i) for i in range(2)]
    claimed = claims.reserve_many(["high"], limit=2, worker_id="host:1:abc")
    waiting = jobs.add.using(queue="low").enqueue(9, 9)
    deleted, following = claims.finish_and_reserve(claimed, ["high", "low"], limit=5, worker_id="host:1:abc")
    assert deleted == {row.pk for row in ran}
    assert [job.pk for job in following] == [waiting.pk]
    assert following[0].attempts == 1 and following[0].reserved_by == "host:1:abc"
    assert list(Job.objects.values_list("pk", flat=True)) == [waiting.pk]


def test_finish_and_reserve_leaves_a_row_whose_reservation_is_no_longer_the_batchs():
    jobs.add.enqueue(1, 1)
    jobs.add.enqueue(2, 2)
    first, second = claims.reserve_many(["default"], limit=2, worker_id="host:1:abc")
    Job.objects.filter(pk=second.pk).update(attempts=F("attempts") + 1, reserved_by="host:2:def")
    deleted, following = claims.finish_and_reserve([first, second], ["default"], limit=5)
    assert deleted == {first.pk} and following == []
    assert list(Job.objects.values_list("pk", flat=True)) == [second.pk]


def test_finish_and_reserve_reclaims_expired_reservations_when_every_queue_is_empty():
    jobs.add.enqueue(1, 1)
    jobs.add.enqueue(2, 2)
    ran, abandoned = claims.reserve_many(["default"], limit=2, worker_id="host:1:abc")
    expire(abandoned)
    deleted, following = claims.finish_and_reserve([ran], ["default"], limit=5, worker_id="host:3:ghi")
    assert deleted == {ran.pk}
    assert [(job.pk, job.attempts, job.reserved_by) for job in following] == [(abandoned.pk, 2, "host:3:ghi")]


def test_the_hook_before_a_reclaim_runs_only_when_nothing_could_be_claimed():
    calls: list[str] = []
    jobs.add.enqueue(1, 1)
    claimed = claims.reserve_many(["default"], limit=1, before_reclaim=lambda: calls.append("reserve"))
    assert len(claimed) == 1 and calls == []
    deleted, following = claims.finish_and_reserve(
        claimed, ["default"], limit=1, before_reclaim=lambda: calls.append("finish")
    )
    assert deleted == {claimed[0].pk} and following == [] and calls == ["finish"]
    assert claims.reserve_many(["default"], limit=1, before_reclaim=lambda: calls.append("idle")) == []
    assert calls == ["finish", "idle"]


@pytest.fixture(params=[False, True], ids=["one scan", "priority walk"])
def walk(request, monkeypatch):
    """On PostgreSQL, claim with the one-scan statement or the priority walk (elsewhere: the one claim)."""
    from django_dbqueue import claims

    monkeypatch.setattr(claims.plain, "walks", lambda queue: request.param)
    monkeypatch.setattr(claims.plain, "timed", lambda queue, walk, seconds: None)
    return request.param


def test_both_postgresql_statements_claim_by_priority_then_age_and_skip_delayed_rows(walk):
    delayed = [jobs.add.using(priority=10, delay=3600).enqueue(i, i) for i in range(3)]
    low = [jobs.add.using(priority=-5).enqueue(i, i) for i in range(2)]
    middle = [jobs.add.enqueue(i, i) for i in range(2)]
    high = jobs.add.using(priority=5).enqueue(0, 0)
    claimed = claims.reserve_many(["default"], limit=3)
    assert [job.pk for job in claimed] == [high.pk, middle[0].pk, middle[1].pk]
    done, more = claims.finish_and_reserve(claimed, ["default"], limit=10)
    assert done == {job.pk for job in claimed}
    assert [job.pk for job in more] == [row.pk for row in low]
    assert claims.reserve(["default"]) is None
    assert Job.objects.delayed().count() == len(delayed)


def test_both_postgresql_statements_skip_blocked_rows(walk):
    blocked = jobs.add.enqueue(1, 1)
    Job.objects.filter(pk=blocked.pk).update(blocked=True)
    free = jobs.add.enqueue(2, 2)
    assert claims.reserve(["default"]).pk == free.pk
    assert claims.reserve(["default"]) is None


def test_a_queue_claims_with_the_statement_its_claims_measured_faster_and_probes_the_other(monkeypatch):
    from django_dbqueue import claims

    monkeypatch.setattr(claims.plain, "_picks", {})
    slow, fast = claims.plain.SLOW_CLAIM * 2, claims.plain.SLOW_CLAIM / 2
    # A cheap one scan never walks, and one slow claim (a cold first one, a checkpoint) does not change that.
    claims.plain.timed("default", False, fast)
    assert not claims.plain.walks("default")
    claims.plain.timed("default", False, slow)
    assert not claims.plain.walks("default")
    # Scans slow on average: the walk is tried, and kept while it is faster.
    for _ in range(5):
        claims.plain.timed("default", False, slow)
    assert claims.plain.walks("default")
    claims.plain.timed("default", True, fast)
    assert claims.plain.walks("default") and claims.plain.walks("default") and not claims.plain.walks("other")
    # Once the walk measures slower than the scan, the scan is back.
    for _ in range(10):
        claims.plain.timed("default", True, slow * 3)
    assert not claims.plain.walks("default")
    # Every PROBE_EVERY seconds one claim takes the other statement, to keep its average current;
    # a probe weighs more: two that find the walk cheap bring it back.
    pick = claims.plain._picks["default"]
    for walks_after in (False, True):
        pick.probe_at = 0.0
        assert claims.plain.walks("default")
        assert pick.probe_at > time.monotonic() + claims.plain.PROBE_EVERY / 2
        claims.plain.timed("default", True, 0.0)
        assert claims.plain.walks("default") is walks_after


def _claimed(priority: int, *offsets: int) -> list[Job]:
    at = dt.datetime(2026, 1, 1, tzinfo=dt.UTC)
    return [Job(priority=priority, available_at=at + dt.timedelta(seconds=offset)) for offset in offsets]


def test_slow_full_claims_make_the_next_start_from_where_the_last_began(monkeypatch):
    plain = claims.plain
    monkeypatch.setattr(plain, "_picks", {})
    # Cheap full claims keep the full statement, even after a full claim of one priority.
    plain.timed("default", plain.SCAN, plain.SLOW_CLAIM / 2)
    plain.noted("default", _claimed(0, 1, 2, 3), 3)
    assert plain.shape("default") == (plain.SCAN, None)
    # Slow on average (a snapshot holds the dead head of the index): the next claims are bounded
    # by where the last full claim began.
    for _ in range(20):
        plain.timed("default", plain.SCAN, plain.BOUNDED_AFTER * 4)
    plain.noted("default", _claimed(0, 5, 6, 7), 3)
    assert plain.shape("default") == (plain.FROM_BOUND, (0, _claimed(0, 5)[0].available_at))
    # A bounded claim's time is not the full statements' average.
    plain.timed("default", plain.FROM_BOUND, 0.0)
    assert plain._picks["default"].slow()
    plain.noted("default", _claimed(0, 8, 9, 10), 3)
    assert plain.shape("default")[1] == (0, _claimed(0, 8)[0].available_at)
    # Every FULL_EVERY seconds one claim is full (jobs behind the bound, higher priorities).
    plain._picks["default"].full_at = 0.0
    assert plain.shape("default") in ((plain.SCAN, None), (plain.WALK, None))
    assert plain._picks["default"].full_at > time.monotonic() + plain.FULL_EVERY / 2
    assert plain.shape("default")[0] == plain.FROM_BOUND
    # A claim that came back short, or with two priorities, drops the bound.
    plain.noted("default", _claimed(0, 11), 3)
    assert plain.shape("default")[1] is None
    plain.noted("default", _claimed(0, 12, 13, 14), 3)
    assert plain.shape("default")[0] == plain.FROM_BOUND
    plain.noted("default", [*_claimed(5, 1), *_claimed(0, 2, 3)], 3)
    assert plain.shape("default")[1] is None


def test_a_bound_that_claims_no_faster_than_the_full_statement_is_dropped_and_not_taken_again(monkeypatch):
    # Claims slowed by the machine (four processes on two cores) rather than by a dead index head:
    # bounded claims take as long, so the bound only holds back the jobs behind it.
    plain = claims.plain
    monkeypatch.setattr(plain, "_picks", {})
    for _ in range(20):
        plain.timed("default", plain.SCAN, plain.BOUNDED_AFTER * 2)
    plain.noted("default", _claimed(0, 1, 2, 3), 3)
    assert plain.shape("default")[0] == plain.FROM_BOUND  # tried: nothing measured yet
    for _ in range(5):
        plain.timed("default", plain.FROM_BOUND, plain.BOUNDED_AFTER * 2)
    assert plain._picks["default"].helps() is False
    plain.noted("default", _claimed(0, 4, 5, 6), 3)
    assert plain.shape("default") in ((plain.SCAN, None), (plain.WALK, None))
    plain.noted("default", _claimed(0, 7, 8, 9), 3)
    assert plain.shape("default")[1] is None, "the bound came back before RETRY_BOUND"
    # RETRY_BOUND later (the load or the index may have changed): tried again, and kept while it helps.
    plain._picks["default"].retry_at = 0.0
    plain.noted("default", _claimed(0, 10, 11, 12), 3)
    assert plain.shape("default")[0] == plain.FROM_BOUND
    plain.timed("default", plain.FROM_BOUND, plain.BOUNDED_AFTER / 10)
    plain.noted("default", _claimed(0, 13, 14, 15), 3)
    assert plain._picks["default"].helps() and plain.shape("default")[0] == plain.FROM_BOUND


@pytest.mark.django_db(transaction=True)
@pytest.mark.skipif(connection.vendor != "postgresql", reason="the one-statement claim and its shapes are PostgreSQL's")
def test_claims_under_an_old_snapshot_take_the_bounded_shape_and_still_claim_every_job_once(monkeypatch, caplog):
    import psycopg

    from django_dbqueue import enqueue_many

    plain = claims.plain
    monkeypatch.setattr(plain, "_picks", {})
    monkeypatch.setattr(plain, "_warned", {})
    monkeypatch.setattr(plain, "BOUNDED_AFTER", 0.0)  # any full claim counts as slow,
    monkeypatch.setattr(plain, "HELPS", math.inf)  # any bounded claim as faster: 300 jobs leave a short dead head
    monkeypatch.setattr(plain, "FULL_EVERY", 0.1)
    shapes: list[int] = []
    shape = plain.shape

    def spied(queue: str) -> tuple[int, object]:
        picked = shape(queue)
        shapes.append(picked[0])
        return picked

    monkeypatch.setattr(plain, "shape", spied)
    enqueue_many([jobs.add.bind(i, 0) for i in range(300)], handles=False)
    settings = connection.settings_dict
    with psycopg.connect(
        host=settings["HOST"], port=settings["PORT"], user=settings["USER"], dbname=settings["NAME"]
    ) as old:
        old.execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
        old.execute("SELECT txid_current()")
        session = old.info.backend_pid
        time.sleep(1.1)  # the warning names a transaction open for a second or more
        claimed: list[int] = []
        urgent = None
        done: list[Job] = []
        while True:
            _, batch = claims.finish_and_reserve(done, ["default"], limit=10)
            if not batch:
                break
            claimed += [job.pk for job in batch]
            done = batch
            if len(claimed) == 100:
                # Behind the bound: a higher priority, and a time before every waiting job's.
                urgent = jobs.add.using(priority=9).enqueue(0, 0)
                late = jobs.add.enqueue(0, 1)
                Job.objects.filter(pk=late.pk).update(available_at=F("available_at") - dt.timedelta(hours=1))
                urgent_at = len(claimed)
            time.sleep(0.02)
        old.rollback()
    assert plain.FROM_BOUND in shapes and plain.SCAN in shapes
    assert len(claimed) == len(set(claimed)) == 302 and not Job.objects.filter(reserved_at__isnull=True).exists()
    # The job of a higher priority waited for the next full claim (FULL_EVERY: 5 claims of 10 a
    # 0.02 s apart, or fewer on a slow machine), not for the bounded claims' end.
    assert urgent is not None and urgent_at <= claimed.index(urgent.pk) < urgent_at + 70
    # The worker's log names the transaction that holds the dead rows, once.
    warnings = [r.getMessage() for r in caplog.records if "start from where the last began" in r.getMessage()]
    assert len(warnings) == 1
    assert re.search(rf"; a transaction open for \d+ s by session {session} \(", warnings[0]), warnings
