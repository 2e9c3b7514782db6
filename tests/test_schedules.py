"""Periodic jobs: tick times (DST, no database), ticks on the database, and real workers ticking together."""

from __future__ import annotations

import itertools
import signal
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta
from zoneinfo import ZoneInfo

import pytest
from django.core.exceptions import ImproperlyConfigured

from django_dbqueue import payload, schedules
from django_dbqueue.checks import check_schedules
from django_dbqueue.db import DbNow
from django_dbqueue.models import FailedJob, Job, ScheduleState
from django_dbqueue.schedules import Missed, Schedule, periodic
from django_dbqueue.ticker import Ticker
from tests.conftest import wait_until
from tests.testapp import jobs
from tests.testapp.models import Run

BERLIN, NEW_YORK = ZoneInfo("Europe/Berlin"), ZoneInfo("America/New_York")


def local_ticks(schedule: Schedule, after: datetime, count: int) -> list[str]:
    """The next ``count`` ticks, as wall-clock times with their UTC offset in the schedule's zone."""
    ticks = schedule.ticks(after)
    return [next(ticks).astimezone(schedule.zone).strftime("%m-%d %H:%M%z") for _ in range(count)]


# -- time, without a database -----------------------------------------------------


@pytest.mark.parametrize(
    ("zone", "day_before", "expected"),
    [
        # Spring forward: 02:00 jumps to 03:00, so 02:30 does not exist; it runs at 03:00, once.
        ("Europe/Berlin", datetime(2026, 3, 28, 12), ["03-29 03:00+0200", "03-30 02:30+0200"]),
        ("America/New_York", datetime(2026, 3, 7, 12), ["03-08 03:00-0400", "03-09 02:30-0400"]),
    ],
)
def test_a_fixed_time_in_the_skipped_spring_hour_runs_once_right_after_the_jump(zone, day_before, expected):
    schedule = Schedule(name="report", job_name="report", cron="30 2 * * *", timezone=zone)
    assert local_ticks(schedule, day_before.replace(tzinfo=ZoneInfo(zone)), 2) == expected


@pytest.mark.parametrize(
    ("zone", "cron", "day_before", "expected"),
    [
        # Fall back: 02:00-03:00 (Berlin), 01:00-02:00 (New York) happen twice; a fixed time runs at the first.
        ("Europe/Berlin", "30 2 * * *", datetime(2026, 10, 24, 12), ["10-25 02:30+0200", "10-26 02:30+0100"]),
        ("America/New_York", "30 1 * * *", datetime(2026, 10, 31, 12), ["11-01 01:30-0400", "11-02 01:30-0500"]),
    ],
)
def test_a_fixed_time_in_the_repeated_autumn_hour_runs_once(zone, cron, day_before, expected):
    schedule = Schedule(name="report", job_name="report", cron=cron, timezone=zone)
    assert local_ticks(schedule, day_before.replace(tzinfo=ZoneInfo(zone)), 2) == expected


def test_a_wildcard_hour_schedule_follows_real_time_through_the_repeated_hour():
    schedule = Schedule(name="sync", job_name="sync", cron="*/30 * * * *", timezone="Europe/Berlin")
    start = datetime(2026, 10, 25, 1, 50, tzinfo=BERLIN)
    assert local_ticks(schedule, start, 5) == [
        "10-25 02:00+0200",
        "10-25 02:30+0200",
        "10-25 02:00+0100",
        "10-25 02:30+0100",
        "10-25 03:00+0100",
    ]
    ticks = schedule.ticks(start)
    assert [(next(ticks) - start) for _ in range(3)][-1] == timedelta(minutes=70)  # 30 real minutes apart


def test_new_york_hourly_ticks_are_one_real_hour_apart_across_both_transitions():
    schedule = Schedule(name="hourly", job_name="hourly", cron="@hourly", timezone="America/New_York")
    for start in (datetime(2026, 3, 8, 0, 30, tzinfo=NEW_YORK), datetime(2026, 11, 1, 0, 30, tzinfo=NEW_YORK)):
        ticks = schedule.ticks(start)
        moments = [next(ticks) for _ in range(4)]
        assert all(b - a == timedelta(hours=1) for a, b in itertools.pairwise(moments))


def test_interval_ticks_fall_on_multiples_of_the_interval():
    schedule = Schedule(name="beat", job_name="beat", every=15)
    ticks = schedule.ticks(datetime(2026, 1, 1, 12, 0, 7, 500, tzinfo=UTC))
    assert [next(ticks).strftime("%H:%M:%S") for _ in range(3)] == ["12:00:15", "12:00:30", "12:00:45"]


def test_missed_ticks_run_once_for_the_latest_by_default_and_not_at_all_with_skip():
    once = Schedule(name="r", job_name="r", cron="0 * * * *", timezone="UTC")
    due, now = datetime(2026, 1, 1, tzinfo=UTC), datetime(2026, 1, 1, 5, 20, tzinfo=UTC)  # 6 ticks missed
    assert once.plan(due, now) == (datetime(2026, 1, 1, 5, tzinfo=UTC), datetime(2026, 1, 1, 6, tzinfo=UTC), 5)
    skip = Schedule(name="r", job_name="r", cron="0 * * * *", timezone="UTC", missed=Missed.SKIP)
    assert skip.plan(due, now) == (None, datetime(2026, 1, 1, 6, tzinfo=UTC), 6)
    # A tick a few seconds late (busy workers, a worker killed mid-tick) is on time: it runs, and so does the next.
    assert skip.plan(due, due + timedelta(seconds=3)) == (due, datetime(2026, 1, 1, 1, tzinfo=UTC), 0)


def test_declarations_refuse_bad_options_with_the_reason():
    with pytest.raises(ImproperlyConfigured, match="give a cron expression or every=seconds"):
        periodic(jobs.record, "* * * * *", every=5)
    with pytest.raises(ImproperlyConfigured, match="every must be a whole number of seconds, at least 1"):
        periodic(jobs.record, every=0.5)
    with pytest.raises(ImproperlyConfigured, match="missed must be 'once' or 'skip'"):
        periodic(jobs.record, "* * * * *", missed="all")
    with pytest.raises(ImproperlyConfigured, match="argument 'key' is of type set"):
        periodic(jobs.record, "* * * * *", kwargs={"key": {1}})
    assert schedules.all_schedules() == {}


def test_two_schedules_of_one_job_need_their_own_names(declared):
    declared(periodic(jobs.record, "0 9 * * *", args=["morning"]))
    with pytest.raises(ImproperlyConfigured, match=r"Two schedules are named 'tests\.testapp\.jobs\.record'"):
        periodic(jobs.record, "0 18 * * *", args=["evening"])
    declared(periodic(jobs.record, "0 18 * * *", args=["evening"], name="evening"))


def test_the_checks_report_a_bad_expression_an_unknown_zone_and_an_unregistered_job(declared):
    declared(periodic(jobs.record, "61 * * * *", args=("k",), name="bad-minute"))
    declared(periodic(jobs.record, "@daily", args=("k",), tz="Europe/Berln", name="bad-zone"))
    declared(periodic("tests.no_such_job", every=60, name="no-job"))
    declared(periodic(jobs.record, "@daily", args=("k",), tz="Europe/Berlin", name="fine"))
    messages = {(message.id, message.msg.split(":")[0]) for message in check_schedules()}
    assert messages == {
        ("dbqueue.E011", "Schedule 'bad-minute' has a bad cron expression"),
        ("dbqueue.E012", "Schedule 'bad-zone' has an unknown time zone"),
        ("dbqueue.E013", "Schedule 'no-job' names the job 'tests.no_such_job', which is not registered."),
    }
    assert all(message.hint for message in check_schedules())


# -- ticks on the database ------------------------------------------------------------


@pytest.fixture
def declared() -> Iterator[Callable[[Schedule], Schedule]]:
    """Keep schedules declared by a test in this process for that test only."""
    names: list[str] = []

    def keep(schedule: Schedule) -> Schedule:
        names.append(schedule.name)
        return schedule

    yield keep
    for name in names:
        schedules.unschedule(name)


def make_due(name: str, *, ago: float = 0.5) -> None:
    """Move the schedule's next tick ``ago`` seconds into the past, as if that time had passed."""
    row = ScheduleState.objects.annotate(db_now=DbNow()).get(name=name)
    ScheduleState.objects.filter(pk=row.pk).update(
        next_tick=(row.db_now - timedelta(seconds=ago)).replace(microsecond=0)
    )


def look(*declared_schedules: Schedule) -> None:
    """One look of a ticker over ``declared_schedules``, as a worker's ticker thread makes it."""
    by_name = {schedule.name: schedule for schedule in declared_schedules}
    schedules.sync(by_name)
    Ticker("test").look(by_name)


def ticks_run() -> int:
    return Job.objects.filter(name=jobs.record_tick.name).count()


# Ticks and time zones behave alike on every Django: run with one (scripts/test).
pytestmark = pytest.mark.one_django
pytestmark_db = pytest.mark.django_db(transaction=True)


@pytestmark_db
def test_a_new_schedule_gets_its_next_tick_from_the_database_clock_and_runs_when_due(declared):
    hourly = declared(periodic(jobs.record_tick, "@hourly", name="hourly", tick_argument="tick"))
    look(hourly)
    state = ScheduleState.objects.annotate(db_now=DbNow()).get(name="hourly")
    assert state.db_now < state.next_tick <= state.db_now + timedelta(hours=1) and state.next_tick.minute == 0
    assert ticks_run() == 0
    make_due("hourly")
    look(hourly)
    state.refresh_from_db()
    assert ticks_run() == 1 and state.runs == 1 and state.last_job_id == Job.objects.get().pk
    assert state.next_tick > state.last_tick


@pytestmark_db
def test_missed_ticks_after_downtime_run_once_by_default_and_never_with_skip(declared):
    # Yearly, so the latest missed tick (January 1st) is never on time whenever the test runs.
    once = declared(periodic(jobs.record_tick, "0 0 1 1 *", name="once", tick_argument="tick"))
    skip = declared(periodic(jobs.record_tick, "0 0 1 1 *", name="skip", tick_argument="tick", missed="skip"))
    look(once, skip)
    make_due("once", ago=730 * 86400)  # no worker ticked for two years
    make_due("skip", ago=730 * 86400)
    look(once, skip)
    assert ticks_run() == 1
    assert Job.objects.get().pk == ScheduleState.objects.get(name="once").last_job_id
    states = {}
    for name in ("once", "skip"):
        states[name] = ScheduleState.objects.annotate(db_now=DbNow()).get(name=name)
        assert states[name].next_tick > states[name].db_now
    assert states["once"].skipped == states["skip"].skipped - 1 >= 2


@pytestmark_db
def test_a_disabled_schedule_does_not_tick_and_does_not_catch_up_when_enabled_again(declared):
    minutely = declared(periodic(jobs.record_tick, "* * * * *", name="minutely", tick_argument="tick"))
    look(minutely)
    assert schedules.set_enabled(["minutely"], False) == 1
    make_due("minutely", ago=600)
    look(minutely)
    assert ticks_run() == 0
    assert schedules.set_enabled(["minutely"], True) == 1
    look(minutely)
    state = ScheduleState.objects.annotate(db_now=DbNow()).get(name="minutely")
    assert ticks_run() == 0 and state.next_tick > state.db_now and state.enabled


@pytestmark_db
def test_a_schedule_removed_from_code_stops_ticking_and_keeps_its_row(declared):
    kept = declared(periodic(jobs.record_tick, every=60, name="kept", tick_argument="tick"))
    removed = declared(periodic(jobs.record_tick, every=60, name="removed", tick_argument="tick"))
    look(kept, removed)
    make_due("kept")
    make_due("removed")
    look(kept, removed)
    assert ticks_run() == 2
    schedules.unschedule("removed")  # the next deploy's code has no "removed"
    make_due("kept")
    make_due("removed")
    look(kept)
    assert ticks_run() == 3
    stale = ScheduleState.objects.get(name="removed")
    assert (
        stale.runs == 1 and schedules.is_stale(stale) and not schedules.is_stale(ScheduleState.objects.get(name="kept"))
    )


@pytestmark_db
def test_a_changed_expression_takes_effect_without_a_manual_step(declared):
    declared(periodic(jobs.record_tick, "0 3 * * *", name="nightly", tick_argument="tick", tz="UTC"))
    look(schedules.get("nightly"))
    schedules.unschedule("nightly")
    changed = declared(periodic(jobs.record_tick, "15 4 * * *", name="nightly", tick_argument="tick", tz="UTC"))
    look(changed)
    state = ScheduleState.objects.get(name="nightly")
    assert state.expression == "15 4 * * *" and (state.next_tick.hour, state.next_tick.minute) == (4, 15)


@pytestmark_db
def test_without_overlap_no_tick_is_enqueued_while_the_last_run_waits(declared):
    report = declared(periodic(jobs.record_tick, every=60, name="report", tick_argument="tick", overlap=False))
    look(report)
    make_due("report")
    look(report)
    assert ticks_run() == 1
    make_due("report")
    look(report)
    assert ticks_run() == 1 and ScheduleState.objects.get(name="report").skipped == 1
    Job.objects.all().delete()  # the run succeeded
    make_due("report")
    look(report)
    assert ticks_run() == 1 and ScheduleState.objects.get(name="report").runs == 2


@pytestmark_db
def test_run_now_enqueues_one_extra_run_and_leaves_the_ticks_alone(declared):
    report = declared(periodic(jobs.record_tick, "@daily", name="daily", tick_argument="tick"))
    look(report)
    before = ScheduleState.objects.get(name="daily").next_tick
    handle = schedules.run_now("daily")
    state = ScheduleState.objects.get(name="daily")
    assert state.last_job_id == handle.id and state.runs == 1 and state.next_tick == before
    with pytest.raises(LookupError, match="No schedule is declared under the name 'nope'"):
        schedules.run_now("nope")


@pytestmark_db
def test_a_due_tick_is_enqueued_once_when_two_tickers_race_for_it(declared):
    beat = declared(periodic(jobs.record_tick, every=60, name="beat", tick_argument="tick"))
    look(beat)
    make_due("beat")
    state = ScheduleState.objects.get(name="beat")
    assert schedules.tick(beat, state.pk, state.next_tick) is schedules.Outcome.ENQUEUED
    # A second ticker that read the same row before the first moved it on.
    assert schedules.tick(beat, state.pk, state.next_tick) is schedules.Outcome.TAKEN
    assert ticks_run() == 1


# -- real workers ---------------------------------------------------------------------


def tick_seconds() -> list[int]:
    """The ticks recorded by the every-second schedule, as Unix seconds."""
    keys = Run.objects.filter(key__startswith="tick:s:").values_list("key", flat=True)
    return sorted(int(datetime.fromisoformat(key.removeprefix("tick:s:")).timestamp()) for key in keys)


def assert_each_tick_once(seconds: list[int]) -> None:
    # Run.key is unique, so a tick enqueued twice would fail to insert and end in FailedJob.
    assert not FailedJob.objects.exists(), FailedJob.objects.first().error
    assert seconds == list(range(seconds[0], seconds[-1] + 1)), f"ticks lost: {seconds}"


SCHEDULED = {"DBQUEUE_TEST_SCHEDULES": "every-second"}


def stop_all(processes) -> None:
    for process in processes:
        process.signal(signal.SIGTERM)
    for process in processes:
        assert process.wait(timeout=30) == 0, process.output()


@pytestmark_db
@pytest.mark.acceptance
def test_four_workers_tick_an_every_second_schedule_exactly_once_per_tick(worker_process):
    workers = [worker_process("--sleep", "0.05", env=SCHEDULED) for _ in range(4)]
    for process in workers:
        process.wait_for_output("ticker started")
    wait_until(lambda: len(tick_seconds()) >= 22, 60, "fewer than 22 ticks were run in 60 s")
    stop_all(workers)
    seconds = tick_seconds()
    assert_each_tick_once(seconds)
    state = ScheduleState.objects.get(name="every-second")
    assert state.runs == len(seconds) + Job.objects.filter(name=jobs.record_tick.name).count()
    tickers = sum("schedule ticked" in process.output() for process in workers)
    assert tickers > 1, "one worker did all the ticking"


@pytestmark_db
@pytest.mark.acceptance
def test_a_worker_killed_mid_tick_loses_no_tick_and_doubles_none(worker_process, tmp_path):
    marker = tmp_path / "paused"
    others = [worker_process("--sleep", "0.05", env=SCHEDULED) for _ in range(2)]
    for process in others:
        process.wait_for_output("ticker started")
    wait_until(lambda: len(tick_seconds()) >= 2, 30, "the workers did not tick")
    # This one holds the first tick it enqueues inside its transaction, until it is killed.
    victim = worker_process("--sleep", "0.05", env={**SCHEDULED, "DBQUEUE_TEST_TICK_PAUSE": str(marker)})
    wait_until(marker.exists, 30, "the victim never won a tick")
    victim.signal(signal.SIGKILL)
    victim.wait(timeout=10)
    _, kwargs = payload.arguments(payload.decode(marker.read_text()))
    killed_tick = int(kwargs["tick"].timestamp())
    started = len(tick_seconds())
    wait_until(lambda: len(tick_seconds()) >= started + 5, 30, "ticking did not go on after the kill")
    stop_all(others)
    seconds = tick_seconds()
    assert_each_tick_once(seconds)
    # Its tick was rolled back with its transaction, and enqueued by another worker.
    assert "schedule ticked" not in victim.output()
    assert seconds[0] < killed_tick < seconds[-1]


@pytest.mark.acceptance
def test_a_worker_with_a_bad_expression_refuses_to_start(worker_process):
    process = worker_process(env={"DBQUEUE_TEST_SCHEDULES": "bad-expression"})
    assert process.wait(timeout=30) != 0
    output = process.output()
    assert "dbqueue.E011" in output and "Schedule 'bad-expression' has a bad cron expression: Bad minute" in output


def test_the_schedule_check_is_registered():
    from django.core import checks

    assert check_schedules in checks.registry.registry.get_checks(include_deployment_checks=False)


def test_a_schedule_without_a_zone_uses_settings_time_zone(declared):
    schedule = declared(periodic(jobs.record_tick, "@daily", tick_argument="tick", name="zone-default"))
    assert schedule.timezone_name == "Europe/Paris"


# -- operations: the command and the admin ----------------------------------------------


@pytestmark_db
def test_queue_schedules_lists_declared_new_and_stale_schedules_and_runs_one_now(declared):
    import io

    from django.core.management import call_command
    from django.core.management.base import CommandError

    daily = declared(periodic(jobs.record_tick, "30 2 * * *", name="daily", tick_argument="tick"))
    gone = declared(periodic(jobs.record_tick, every=60, name="gone", tick_argument="tick"))
    look(daily, gone)
    schedules.unschedule("gone")
    declared(periodic(jobs.record_tick, "@hourly", name="fresh", tick_argument="tick"))
    out = io.StringIO()
    call_command("queue_schedules", stdout=out)
    lines = {line.split()[0]: line.split()[1:] for line in out.getvalue().splitlines()[1:4]}
    assert lines["daily"][:6] == ["30", "2", "*", "*", "*", "enabled"]
    assert lines["gone"][:3] == ["every", "60s", "stale"] and lines["fresh"][:2] == ["@hourly", "new"]
    assert "Stale: 1 schedule no longer declared in this code" in out.getvalue()

    out = io.StringIO()
    call_command("queue_schedules", "--run", "daily", stdout=out)
    assert out.getvalue().startswith(f"Enqueued {jobs.record_tick.name} as job {Job.objects.get().pk}.")
    with pytest.raises(CommandError, match="No schedule is declared under the name 'gone'"):
        call_command("queue_schedules", "--run", "gone")


@pytestmark_db
def test_the_admin_lists_schedules_with_their_last_outcome_and_runs_one_only_with_permission(declared, client):
    from django.contrib.auth.models import Permission, User
    from django.urls import reverse

    report = declared(periodic(jobs.record_tick, "@daily", name="report", tick_argument="tick"))
    look(report)
    url = reverse("admin:django_dbqueue_schedulestate_changelist")
    viewer = User.objects.create_user("viewer", password="pw", is_staff=True)
    viewer.user_permissions.add(
        Permission.objects.get(codename="view_schedulestate"), Permission.objects.get(codename="change_schedulestate")
    )
    client.force_login(viewer)
    page = client.get(url).content.decode()
    assert "report" in page and "run_selected_now" not in page and "disable_selected" in page
    response = client.post(
        url, {"action": "run_selected_now", "_selected_action": [str(ScheduleState.objects.get().pk)]}
    )
    assert not Job.objects.exists() and response.status_code == 302  # refused: no such action for this user

    viewer.user_permissions.add(Permission.objects.get(codename="run_schedule"))
    viewer = User.objects.get(pk=viewer.pk)
    client.force_login(viewer)
    pk = str(ScheduleState.objects.get().pk)
    client.post(url, {"action": "run_selected_now", "_selected_action": [pk]}, follow=True)
    assert Job.objects.count() == 1
    row = client.get(url).content.decode()
    assert '<td class="field-last_outcome">waiting</td>' in row
    Job.objects.all().delete()
    assert '<td class="field-last_outcome">succeeded</td>' in client.get(url).content.decode()
    client.post(url, {"action": "disable_selected", "_selected_action": [pk]}, follow=True)
    assert not ScheduleState.objects.get().enabled


@pytestmark_db
def test_a_schedule_keeps_the_options_of_the_definition_it_was_declared_with(declared):
    from django_dbqueue import periodic as exported

    urgent = declared(exported(jobs.record_tick.using(queue="urgent"), every=60, name="urgent", tick_argument="tick"))
    look(urgent)
    make_due("urgent")
    look(urgent)
    assert Job.objects.get().queue == "urgent"
