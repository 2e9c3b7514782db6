"""Stored schedules (made at runtime): checked on save, ticked by the same tickers as those in code,
edited while workers run; the admin (and its history) and queue_schedules."""

from __future__ import annotations

import io
import signal
from datetime import UTC, datetime

import pytest
from django.contrib.admin.models import ADDITION, CHANGE, LogEntry
from django.core.exceptions import ValidationError
from django.core.management import call_command
from django.core.management.base import CommandError
from django.test import Client
from django.urls import reverse

from django_dbqueue import cron, schedules
from django_dbqueue.models import MAX_JITTER, FailedJob, Job, ScheduleState, StoredSchedule
from django_dbqueue.schedules import Schedule
from django_dbqueue.ticker import CHANGED_RETRY, Ticker
from tests.conftest import wait_until
from tests.test_schedules import make_due
from tests.testapp import jobs
from tests.testapp.models import Run

pytestmark = pytest.mark.one_django
transactional = pytest.mark.django_db(transaction=True)


def row(**fields: object) -> StoredSchedule:
    values = {"name": "nightly", "job_name": jobs.record_tick.name, "cron": "0 3 * * *", "timezone": "UTC"}
    values |= {"tick_argument": "tick", "kwargs": {"schedule": "n"}}
    return StoredSchedule(**(values | fields))


def reasons(schedule: StoredSchedule) -> dict[str, list[str]]:
    with pytest.raises(ValidationError) as caught:
        schedules.save_stored(schedule)
    return caught.value.message_dict


def test_a_jitter_is_a_fixed_offset_of_each_schedule_within_its_bound():
    offsets = {cron.offset(f"report-{n}", 60) for n in range(1000)}
    assert min(offsets) >= 0 and max(offsets) <= 60 and len(offsets) > 50
    assert cron.offset("report-1", 60) == cron.offset("report-1", 60) and cron.offset("report-1", 0) == 0
    hourly = Schedule(name="r", job_name="r", cron="0 * * * *", timezone="UTC", offset=37)
    ticks = hourly.ticks(datetime(2026, 1, 1, 12, 0, 30, tzinfo=UTC))
    assert [next(ticks).strftime("%H:%M:%S") for _ in range(2)] == ["12:00:37", "13:00:37"]
    assert hourly.expression == "0 * * * * +37s"


@pytest.mark.django_db
def test_a_bad_cron_a_bad_zone_an_unknown_job_and_wrong_arguments_are_refused_on_save_with_the_reason():
    assert reasons(row(cron="61 * * * *"))["cron"] == ["bad cron expression: Bad minute in '61 * * * *'"]
    assert reasons(row(timezone="Europe/Berln"))["timezone"] == ["'Europe/Berln' is not a time zone known to zoneinfo"]
    assert reasons(row(job_name="tests.no_such_job"))["job_name"] == [
        "no job is registered under the name 'tests.no_such_job'"
    ]
    assert "an unexpected keyword argument 'shedule'" in reasons(row(kwargs={"shedule": "n"}))["__all__"][0]
    assert "missing the required argument 'tick'" in reasons(row(tick_argument=""))["__all__"][0]
    assert "must be a JSON list" in reasons(row(args={"a": 1}))["args"][0]
    assert reasons(row(jitter=MAX_JITTER + 1))["jitter"]
    assert not StoredSchedule.objects.exists()


@pytest.mark.django_db
def test_queue_schedules_creates_edits_lists_and_deletes_a_stored_schedule_and_refuses_bad_input():
    out = io.StringIO()
    name = jobs.record_tick.name
    call_command(
        "queue_schedules", "create", "nightly", "--job", name, "--cron", "0 3 * * *", "--tz", "UTC",
        "--kwargs", '{"schedule": "n"}', "--tick-argument", "tick", stdout=out,
    )  # fmt: skip
    assert "Stored the schedule nightly: 0 3 * * * (enabled)." in out.getvalue()
    with pytest.raises(CommandError, match="Nothing was changed: cron: bad cron expression: Bad minute"):
        call_command("queue_schedules", "edit", "nightly", "--cron", "61 * * * *")
    with pytest.raises(CommandError, match="timezone: 'Mars/Olympus' is not a time zone"):
        call_command("queue_schedules", "edit", "nightly", "--tz", "Mars/Olympus")
    with pytest.raises(CommandError, match="job_name: no job is registered under the name 'nope'"):
        call_command("queue_schedules", "edit", "nightly", "--job", "nope")
    with pytest.raises(CommandError, match=r"cannot take these arguments: .*unexpected keyword argument 'x'"):
        call_command("queue_schedules", "edit", "nightly", "--kwargs", '{"x": 1}')
    with pytest.raises(CommandError, match="is not JSON"):
        call_command("queue_schedules", "edit", "nightly", "--args", "[1,")
    with pytest.raises(CommandError, match="a schedule is stored under the name 'nightly'"):
        call_command("queue_schedules", "create", "nightly", "--job", name, "--cron", "@daily")
    assert StoredSchedule.objects.get().cron == "0 3 * * *"
    call_command("queue_schedules", "edit", "nightly", "--cron", "15 4 * * *", "--disable", stdout=out)
    stored = StoredSchedule.objects.get()
    assert stored.cron == "15 4 * * *" and not stored.enabled
    out = io.StringIO()
    call_command("queue_schedules", stdout=out)
    line = out.getvalue().splitlines()[1].split()
    assert line[0] == "nightly" and line[1:6] == ["15", "4", "*", "*", "*"] and line[-1] == "stored"
    call_command("queue_schedules", "delete", "nightly", stdout=out)
    assert not StoredSchedule.objects.exists()
    with pytest.raises(CommandError, match="no schedule is stored under the name 'nightly'"):
        call_command("queue_schedules", "delete", "nightly")


@transactional
def test_an_edited_expression_moves_the_next_tick_and_the_old_time_no_longer_fires():
    stored = schedules.save_stored(row())
    old, new = Ticker("old"), Ticker("new")
    read = old._stored(())
    assert read is not None and set(read) == {"nightly"}
    state = ScheduleState.objects.get(name="nightly")
    assert (state.next_tick.hour, state.next_tick.minute) == (3, 0)
    stored.cron = "15 4 * * *"
    schedules.save_stored(stored)
    state.refresh_from_db()
    assert state.expression == "15 4 * * *" and (state.next_tick.hour, state.next_tick.minute) == (4, 15)
    make_due("nightly")
    # A worker that has not read the edit leaves the row to those that have, and reads it first.
    assert old.look(read) == CHANGED_RETRY and not Job.objects.exists() and old._next_check == 0
    edited = new._stored(())
    assert edited is not None
    new.look(edited)
    assert Job.objects.count() == 1
    state.refresh_from_db()
    assert (state.next_tick.hour, state.next_tick.minute) == (4, 15)
    # Deleted: no worker ticks it again, and its row stays, stale, with its history.
    schedules.delete_stored(["nightly"])
    make_due("nightly")
    new.look(edited)
    state.refresh_from_db()
    assert Job.objects.count() == 1 and state.runs == 1 and schedules.is_stale(state)


@transactional
def test_the_admin_creates_and_edits_a_stored_schedule_and_its_history_records_each_change(admin_user):
    client = Client()
    client.force_login(admin_user)
    add = reverse("admin:django_dbqueue_storedschedule_add")
    form = {
        "name": "nightly", "job_name": jobs.record_tick.name, "args": "[]", "kwargs": '{"schedule": "n"}',
        "tick_argument": "tick", "cron": "61 * * * *", "timezone": "UTC", "queue": "", "jitter": "0", "enabled": "on",
    }  # fmt: skip
    page = client.post(add, form).content.decode()
    assert "bad cron expression: Bad minute" in page and not StoredSchedule.objects.exists()
    page = client.post(add, {**form, "cron": "0 3 * * *", "kwargs": '{"x": 1}'}).content.decode()
    assert "unexpected keyword argument" in page and not StoredSchedule.objects.exists()
    assert client.post(add, {**form, "cron": "0 3 * * *"}).status_code == 302
    stored = StoredSchedule.objects.get()
    change = reverse("admin:django_dbqueue_storedschedule_change", args=[stored.pk])
    assert client.post(change, {**form, "cron": "15 4 * * *"}).status_code == 302
    assert ScheduleState.objects.get(name="nightly").expression == "15 4 * * *"
    entries = list(LogEntry.objects.filter(object_id=str(stored.pk)).order_by("pk"))
    assert [entry.action_flag for entry in entries] == [ADDITION, CHANGE]
    assert "Cron" in entries[1].get_change_message()


@transactional
def test_a_user_without_the_add_permission_cannot_store_a_schedule(django_user_model):
    user = django_user_model.objects.create_user("viewer", password="pw", is_staff=True)
    client = Client()
    client.force_login(user)
    response = client.post(reverse("admin:django_dbqueue_storedschedule_add"), {"name": "x"})
    assert response.status_code == 403 and not StoredSchedule.objects.exists()


@transactional
@pytest.mark.acceptance
def test_a_schedule_stored_through_the_admin_fires_in_running_workers_once_per_tick(worker_process, admin_user):
    workers = [worker_process("--sleep", "0.05") for _ in range(4)]
    for process in workers:
        process.wait_for_output("ticker started")
    client = Client()
    client.force_login(admin_user)
    form = {
        "name": "every-second", "job_name": jobs.record_tick.name, "args": "[]", "kwargs": '{"schedule": "st"}',
        "tick_argument": "tick", "cron": "* * * * * *", "timezone": "UTC", "queue": "", "jitter": "0", "enabled": "on",
    }  # fmt: skip
    assert client.post(reverse("admin:django_dbqueue_storedschedule_add"), form).status_code == 302
    ticks = Run.objects.filter(key__startswith="tick:st:")
    # Seen within one version check of the workers, plus a tick.
    wait_until(ticks.exists, 10, "no worker ticked the stored schedule within 10 s")
    wait_until(lambda: ticks.count() >= 12, 60, "fewer than 12 ticks in 60 s")
    for process in workers:
        process.signal(signal.SIGTERM)
    for process in workers:
        assert process.wait(timeout=30) == 0, process.output()
    # Run.key is unique: a tick enqueued twice would fail to insert and end in FailedJob.
    assert not FailedJob.objects.exists(), FailedJob.objects.first().error
    seconds = sorted(
        int(datetime.fromisoformat(key.removeprefix("tick:st:")).timestamp())
        for key in ticks.values_list("key", flat=True)
    )
    assert seconds == list(range(seconds[0], seconds[-1] + 1)), f"ticks lost: {seconds}"
    assert sum("stored schedules read" in process.output() for process in workers) == 4
