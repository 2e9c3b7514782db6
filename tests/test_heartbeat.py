"""The heartbeat: extending a reservation by compare-and-set, from a thread with its own connection."""

from __future__ import annotations

import datetime as dt
import logging
import threading
import time

import pytest
from django.db.models import F

from django_dbqueue import claims, lifecycle
from django_dbqueue.heartbeat import ERROR_RETRY, Heartbeat, beat_interval
from django_dbqueue.models import Job
from tests.conftest import wait_until
from tests.testapp import jobs

pytestmark = pytest.mark.django_db(transaction=True)


def reserved(worker_id: str = "host:1:aaa", **options: int) -> Job:
    jobs.add.using(**options).enqueue(1, 2)
    job = claims.reserve(["default"], worker_id=worker_id)
    assert job is not None
    return job


def age(job: Job, seconds: int = 3600) -> None:
    Job.objects.filter(pk=job.pk).update(reserved_at=F("reserved_at") - dt.timedelta(seconds=seconds))


def test_the_interval_is_a_third_of_retry_after_and_never_tiny():
    assert beat_interval(60) == 20
    assert beat_interval(2) == pytest.approx(2 / 3)
    assert beat_interval(0) == 0.25


def test_extend_moves_the_holders_reservation_to_now():
    job = reserved()
    age(job)
    assert lifecycle.extend(job, worker_id="host:1:aaa")
    assert Job.objects.expired() == [] and lifecycle.reclaim_expired() == 0


def test_extend_changes_nothing_for_another_worker_or_a_later_reservation():
    job = reserved()
    age(job)
    assert not lifecycle.extend(job, worker_id="host:2:bbb")
    assert lifecycle.release(job)
    assert not lifecycle.extend(job, worker_id="host:1:aaa")  # released: nobody holds it
    again = claims.reserve(["default"], worker_id="host:1:aaa")
    assert again is not None and again.attempts == 2
    age(again)
    assert not lifecycle.extend(job, worker_id="host:1:aaa")  # the first reservation is over
    assert [expired.pk for expired in Job.objects.expired()] == [job.pk]


def test_an_extended_reservation_can_still_be_failed_by_compare_and_set_on_reserved_at():
    # SQLite stores DbNow() with 3 decimals; the reclaim compares reserved_at with 6.
    job = reserved()
    assert lifecycle.extend(job, worker_id="host:1:aaa")
    stored = Job.objects.get(pk=job.pk)
    assert lifecycle.fail(stored, error="x", exception_class="X", reserved_at=stored.reserved_at) is not None


def test_a_heartbeat_extends_until_stopped_then_its_thread_ends():
    job = reserved(retry_after=60)
    age(job)
    before = threading.active_count()
    heartbeat = Heartbeat("host:1:aaa", interval=0.05)
    heartbeat.hold([job])
    wait_until(lambda: heartbeat.beats >= 3, 10, "the heartbeat never beat")
    heartbeat.stop()
    assert threading.active_count() == before
    assert Job.objects.expired() == []
    beats = heartbeat.beats
    time.sleep(0.2)
    assert heartbeat.beats == beats


def test_one_beat_extends_every_job_the_worker_holds_and_none_it_dropped():
    first, second, third = (reserved(retry_after=60) for _ in range(3))
    for job in (first, second, third):
        age(job)
    with Heartbeat("host:1:aaa", interval=0.05) as heartbeat:
        heartbeat.hold([first, second, third])
        heartbeat.drop(third)
        wait_until(lambda: heartbeat.beats >= 1, 10, "the heartbeat never beat")
    assert [job.pk for job in Job.objects.expired()] == [third.pk]


def test_a_job_claimed_with_a_short_retry_after_wakes_a_heartbeat_that_waits_for_a_long_one():
    slow = reserved(retry_after=600)
    with Heartbeat("host:1:aaa") as heartbeat:
        heartbeat.hold([slow])  # its first beat is 200 s away
        time.sleep(0.1)
        quick = reserved(retry_after=1)
        heartbeat.hold([quick])
        time.sleep(1.5)
        assert heartbeat.beats >= 2
    assert Job.objects.expired() == []


def test_a_heartbeat_drops_a_job_whose_reservation_is_no_longer_its_own_and_goes_on(caplog):
    job = reserved()
    with caplog.at_level(logging.WARNING, logger="django_dbqueue"):
        heartbeat = Heartbeat("host:1:aaa", interval=0.05)
        heartbeat.hold([job])
        wait_until(lambda: heartbeat.beats >= 1, 10, "the heartbeat never beat")
        Job.objects.filter(pk=job.pk).update(reserved_by="host:9:zzz", attempts=F("attempts") + 1)
        wait_until(lambda: heartbeat.held() == [], 10, "the heartbeat kept the job")
        assert heartbeat.lost == 1
        other = reserved()
        age(other)
        heartbeat.hold([other])
        wait_until(lambda: Job.objects.expired() == [], 10, "the heartbeat stopped beating")
        heartbeat.stop()
    assert any("is no longer this worker's" in record.getMessage() for record in caplog.records)


def test_a_failed_beat_brings_the_next_one_sooner_but_the_lease_still_counts_from_the_last_good_one():
    job = reserved(retry_after=6)
    heartbeat = Heartbeat("host:1:aaa")
    heartbeat.hold([job])
    heartbeat.stop()  # beats by hand from here
    # The last beat that reached the database was 5.5 s ago, of a 6 s lease (1 s margin): not safe any more.
    last_good = time.monotonic() - 5.5
    heartbeat._held[job.pk] = (job, last_good)
    assert not heartbeat.lease_safe(job)
    # A beat fails (the database is out of reach): the next comes ERROR_RETRY seconds from now...
    heartbeat._retry_soon([job])
    assert heartbeat._next_beat() == pytest.approx(time.monotonic() + ERROR_RETRY, abs=0.5)
    # ...and the reservation is no fresher for it: a row found gone after this may be another worker's doing.
    assert not heartbeat.lease_safe(job)
    assert heartbeat._held[job.pk][1] == last_good


def test_a_short_job_never_opens_a_heartbeat_connection():
    job = reserved()
    with Heartbeat("host:1:aaa") as heartbeat:
        heartbeat.hold([job])
        heartbeat.drop(job)
    assert heartbeat.beats == 0
