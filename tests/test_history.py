"""The run history: upserts that add, buckets by minute, pruning that folds."""

from __future__ import annotations

import time
from datetime import UTC, datetime, timedelta

import pytest

from django_dbqueue import history
from django_dbqueue.history import EVER, Recorder, Tally
from django_dbqueue.models import JobHistory

# Counting and folding do not depend on Django's version: scripts/test runs these with one.
pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.one_django]


def test_flushes_add_to_the_minute_rows_and_never_overwrite():
    recorder = Recorder()
    for _ in range(3):
        recorder.started("default", "a")
        recorder.ended("default", "a", "succeeded", 0.003)
    recorder.started("default", "a")
    recorder.ended("default", "a", "failed", 7.0)
    assert recorder.flush() == 1
    recorder.started("default", "a")
    recorder.ended("default", "a", "retried", 0.2)
    recorder.flush()
    total = history.totals(JobHistory.objects.all())[None]
    assert (total.started, total.succeeded, total.failed, total.retried) == (5, 3, 1, 1)
    assert total.bins[0] == 3 and total.bins[5] == 1 and total.bins[10] == 1 and sum(total.bins) == 5
    assert total.run_time == pytest.approx(7.209)
    assert JobHistory.objects.count() <= 2  # one per minute the test spanned


def test_a_failed_flush_keeps_the_counts_for_the_next_one(monkeypatch):
    recorder = Recorder()
    recorder.started("default", "a")

    def refuse(*args, **kwargs):
        raise history.transaction.TransactionManagementError("database away")

    monkeypatch.setattr(history, "add", refuse)
    with pytest.raises(history.transaction.TransactionManagementError):
        recorder.flush()
    monkeypatch.undo()
    recorder.started("default", "a")
    assert recorder.flush() == 1
    assert history.totals(JobHistory.objects.all())[None].started == 2


def test_prune_folds_old_rows_into_one_total_per_name_so_sums_never_go_down():
    now = time.time()
    old = datetime.fromtimestamp(now - now % 60, tz=UTC) - timedelta(hours=5)
    history.add(
        {
            (old, "default", "a"): Tally(started=4, succeeded=4),
            (old - timedelta(minutes=1), "default", "a"): Tally(started=1, failed=1),
        }
    )
    history.add({(old, "default", "b"): Tally(started=2, succeeded=2)})
    recent = Recorder()
    recent.started("default", "a")
    recent.flush()
    before = history.totals(JobHistory.objects.all(), by="name")
    assert history.prune(1) == 3
    assert history.prune(1) == 0
    after = history.totals(JobHistory.objects.all(), by="name")
    assert {name: (t.started, t.succeeded, t.failed) for name, t in after.items()} == {
        name: (t.started, t.succeeded, t.failed) for name, t in before.items()
    }
    assert set(JobHistory.objects.filter(bucket=EVER).values_list("name", flat=True)) == {"a", "b"}
    # The windows read for the dashboard never include the folded totals.
    assert history.totals(history.rows_since(EVER))[None].started == 1
