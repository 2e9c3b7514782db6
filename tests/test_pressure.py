"""Backing off the database (``DBQUEUE["PRESSURE"]``, pressure.py): the pause before each claim
doubles while claims are slow or sessions wait on locks, halves when they are not, and shows in
the worker's row; off, the worker has no back-off at all."""

from __future__ import annotations

import logging
import threading
import time

import pytest
from django.db import connection, connections, transaction
from django.test import override_settings

from django_dbqueue import pressure
from django_dbqueue.checks import check_settings
from django_dbqueue.pressure import FIRST_PAUSE, Limits, Pressure
from tests.conftest import run_worker
from tests.testapp import jobs
from tests.testapp.models import Order, Run

SLOW = 0.050  # seconds: a claim over a 10 ms threshold
QUICK = 0.001


def back_off(claim_ms: float = 10, max_pause: float = 0.08, lock_waits: int | None = None) -> Pressure:
    return Pressure(Limits(claim_ms, lock_waits, max_pause), "test-worker")


def test_slow_claims_double_the_pause_up_to_its_most_and_quick_ones_halve_it_to_none(caplog):
    watched = back_off()
    with caplog.at_level(logging.INFO, logger="django_dbqueue"):
        pauses = []
        for _ in range(5):
            watched.claimed(SLOW)
            pauses.append(watched.pause)
        assert pauses == [FIRST_PAUSE, 0.02, 0.04, 0.08, 0.08]
        assert watched.text() == "backing-off=80ms"
        # The moving average falls below 10 ms after a few quick claims; then the pause halves.
        while watched.claim_ms is not None and watched.claim_ms > 10:
            watched.claimed(QUICK)
        while watched.pause:
            watched.claimed(QUICK)
    assert watched.text() == ""
    lines = [record.getMessage() for record in caplog.records]
    assert sum("backing off the database" in line for line in lines) == 1, "logged when it starts, not per claim"
    assert sum("backing off ended" in line for line in lines) == 1


def test_one_slow_claim_among_quick_ones_does_not_start_a_back_off():
    watched = back_off()
    for _ in range(10):
        watched.claimed(QUICK)
    watched.claimed(SLOW)  # the average: 0.8 + 0.2 x (50 - 0.8) ~ 11 ms: over
    watched.claimed(QUICK)
    watched.claimed(QUICK)
    assert watched.claim_ms is not None and watched.claim_ms < 10
    assert watched.pause < FIRST_PAUSE


@pytest.mark.parametrize(
    "value",
    [
        {"CLAIM_MS": 0},
        {"CLAIM_MS": "25"},
        {"MAX_PAUSE": -1},
        {"LOCK_WAITS": 0},
        {"LOCK_WAITS": 2.5},
        {"CLAIM_MS": True},
        {"CLAIMS_MS": 25},
        [25],
    ],
)
def test_a_bad_pressure_setting_is_refused_by_the_settings_check(value):
    assert not pressure.valid(value)
    with override_settings(DBQUEUE={"PRESSURE": value}):
        [error] = check_settings()
    assert error.id == "dbqueue.E003" and "PRESSURE" in error.msg


def test_good_pressure_settings_pass():
    for value in (None, {}, {"CLAIM_MS": 5}, {"CLAIM_MS": 2.5, "LOCK_WAITS": 3, "MAX_PAUSE": 1}):
        assert pressure.valid(value)
        with override_settings(DBQUEUE={"PRESSURE": value}):
            assert check_settings() == []


@pytest.mark.django_db(transaction=True)
def test_a_worker_without_the_setting_has_no_back_off():
    jobs.record.enqueue("plain")
    worker, _ = run_worker()
    assert worker.pressure is None
    assert Run.objects.filter(key="plain").exists()


@pytest.mark.django_db(transaction=True)
@override_settings(DBQUEUE={"PRESSURE": {"CLAIM_MS": 0.000001, "MAX_PAUSE": 0.02}})
def test_a_worker_under_pressure_pauses_between_claims_says_so_and_still_runs_every_job(caplog):
    for n in range(5):
        jobs.record.enqueue(f"p{n}")
    with caplog.at_level(logging.INFO, logger="django_dbqueue"):
        worker, _ = run_worker(batch=1)
    assert sorted(Run.objects.values_list("key", flat=True)) == [f"p{n}" for n in range(5)]
    assert worker.pressure is not None and worker.pressure.pause == 0.02
    assert "backing-off=20ms" in worker._options_text()
    assert any("backing off the database" in record.getMessage() for record in caplog.records)


@pytest.mark.django_db(transaction=True)
@pytest.mark.skipif(connection.vendor == "sqlite", reason="SQLite's writers wait in turn: no lock waits to read")
def test_sessions_waiting_on_a_lock_start_a_back_off():
    order = Order.objects.create(number="A-1")
    locked, waiting_done = threading.Event(), threading.Event()

    def hold() -> None:
        with transaction.atomic():
            Order.objects.select_for_update().get(pk=order.pk)
            locked.set()
            waiting_done.wait(20)
        connections.close_all()

    def wait_for_lock() -> None:
        locked.wait(10)
        with transaction.atomic():
            Order.objects.select_for_update().get(pk=order.pk)  # waits for hold()
        connections.close_all()

    threads = [threading.Thread(target=hold), threading.Thread(target=wait_for_lock)]
    for thread in threads:
        thread.start()
    try:
        # InnoDB's lock tables are a cache that a read more often than every 0.1 s leaves stale.
        for _ in range(30):
            if pressure._read_lock_waits() == 1:
                break
            time.sleep(0.3)
        else:
            raise AssertionError("no session waited on the lock")
        watched = back_off(claim_ms=1000, lock_waits=1)
        watched.claimed(QUICK)
        assert watched.lock_waits == 1 and watched.pause == FIRST_PAUSE
    finally:
        waiting_done.set()
        for thread in threads:
            thread.join(20)
    time.sleep(0.3)  # past InnoDB's cache
    unlocked = back_off(claim_ms=1000, lock_waits=1)
    unlocked.claimed(QUICK)
    assert unlocked.lock_waits == 0 and unlocked.pause == 0


def test_the_worker_builds_its_back_off_from_the_setting():
    with override_settings(DBQUEUE={"PRESSURE": {"CLAIM_MS": 7}}):
        built = Pressure.configured("w")
    assert built is not None and built.limits == Limits(7.0, None, 2.0)
    assert Pressure.configured("w") is None
