"""Faults with real ``queue_work`` processes: long jobs, a restarted server, killed connections, bad input.

Every test bounds its waits; every process is killed at teardown.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import re
import shutil
import signal
import subprocess
import time
from collections import defaultdict
from contextlib import nullcontext
from pathlib import Path

import pytest
from django.db import DatabaseError, connection, transaction
from django.db.models.functions import Now

from django_dbqueue import chain, enqueue_many
from django_dbqueue.db import is_connection_error
from django_dbqueue.execution import Defaults
from django_dbqueue.models import FailedJob, Job
from django_dbqueue.worker import Worker, WorkerOptions
from tests.conftest import children_of, kill_other_connections, kill_session, session_id, wait_until
from tests.testapp import jobs
from tests.testapp.models import Attempt, Order, Run

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.acceptance]


# -- long jobs and the heartbeat ---------------------------------------------------------------


def test_a_job_running_three_times_its_retry_after_is_not_stolen_from_its_live_worker(worker_process):
    # retry_after=2 s on the row, a 6 s run: without a heartbeat the idle second
    # worker reclaims the reservation at 2 s and runs the job again in parallel.
    row = jobs.long_running.using(retry_after=2).enqueue("long", 6)
    first = worker_process("--sleep", "0.05")
    wait_until(lambda: Attempt.objects.filter(key="long").exists(), 30, "the job never started")
    reserved_at = Job.objects.get(pk=row.pk).reserved_at
    second = worker_process("--sleep", "0.05")
    second.wait_for_output("worker started")
    latest = reserved_at
    deadline = time.monotonic() + 30
    while not Run.objects.filter(key="long").exists():
        assert time.monotonic() < deadline, f"the job never finished:\n{first.output()}"
        current = Job.objects.filter(pk=row.pk).values_list("reserved_at", flat=True).first()
        if current is not None:
            latest = max(latest, current)
        time.sleep(0.1)
    assert list(Attempt.objects.values_list("attempt", flat=True)) == [1], second.output()
    assert Run.objects.get(key="long").pid == first.pid
    assert latest - reserved_at >= dt.timedelta(seconds=2), "the reservation was never extended"
    # The job writes its Run row before it returns; its worker deletes the job row just after.
    wait_until(lambda: not Job.objects.exists(), 10, f"the finished job was not deleted:\n{first.output()}")
    assert not FailedJob.objects.exists()
    assert "reclaimed" not in first.output() + second.output()
    for process in (first, second):
        process.signal(signal.SIGTERM)
        assert process.wait(timeout=30) == 0, process.output()


def test_a_killed_workers_long_job_is_still_reclaimed_after_its_retry_after(worker_process):
    # Long enough that the kill lands mid-run however slowly the second worker starts under
    # load (at 3 s, a loaded CI's second worker took so long the job ended before the kill);
    # quick once reclaimed.
    jobs.long_running.using(retry_after=2).enqueue("orphan", 60, again=1)
    first = worker_process("--sleep", "0.05")
    wait_until(lambda: Attempt.objects.filter(key="orphan").exists(), 30, "the job never started")
    second = worker_process("--sleep", "0.05")
    second.wait_for_output("worker started")
    time.sleep(1.5)  # past a heartbeat or two
    assert not Run.objects.filter(key="orphan").exists(), "the job ended before the kill"
    first.signal(signal.SIGKILL)
    first.wait(timeout=10)
    killed = time.monotonic()
    wait_until(
        lambda: Attempt.objects.filter(key="orphan", attempt=2).exists(),
        15,
        f"the dead worker's job was not reclaimed:\n{second.output()}",
    )
    # The last heartbeat was at most retry_after / 3 before the kill.
    assert time.monotonic() - killed < 2 + 1.5
    wait_until(lambda: Run.objects.filter(key="orphan").exists(), 30, "the job never ran again")
    assert Run.objects.get(key="orphan").pid == second.pid
    assert list(Attempt.objects.order_by("attempt").values_list("attempt", flat=True)) == [1, 2]
    second.signal(signal.SIGTERM)
    assert second.wait(timeout=30) == 0
    assert not Job.objects.exists() and not FailedJob.objects.exists()


def test_quick_jobs_claimed_with_a_long_one_are_deleted_before_it_starts_so_a_kill_runs_none_again(worker_process):
    jobs.record.enqueue("warm")  # a worker's first claim takes one job; later ones claim ahead
    first = worker_process("--sleep", "0.05")
    wait_until(lambda: not Job.objects.exists(), 30, "the first job never ran")
    # One transaction: the next claim takes them all (a no-op-fast average claims up to --batch).
    quick = [jobs.record.bind(f"q{i}") for i in range(8)]
    enqueue_many([*quick, jobs.long_running.using(retry_after=2).bind("long", 30, again=0)])
    wait_until(lambda: Attempt.objects.filter(key="long").exists(), 30, "the long job never started")
    assert Run.objects.filter(key__startswith="q").count() == 8
    # Claimed in the same claim as the long job, and deleted before it started.
    assert list(Job.objects.values_list("name", flat=True)) == [jobs.long_running.name]
    first.signal(signal.SIGKILL)
    first.wait(timeout=10)
    second = worker_process("--sleep", "0.05")
    wait_until(lambda: Run.objects.filter(key="long").exists(), 30, f"the long job never ran again:\n{second.output()}")
    assert sorted(Run.objects.values_list("key", flat=True)) == sorted(["warm", "long", *(f"q{i}" for i in range(8))])
    assert not Job.objects.exists() and not FailedJob.objects.exists()
    second.signal(signal.SIGTERM)
    assert second.wait(timeout=30) == 0


# -- poison input in a real process ------------------------------------------------------------

MODEL = '{"__dbq__": "model", "v": ["testapp.Order", %s]}'
# Rows a bad deploy, a hand edit or a newer version could leave; tests/test_worker.py covers
# the unknown name, invalid JSON, a non-envelope and changed signatures in this process.
POISON = {
    "args-not-a-list": ("tests.add", '{"args": "12", "kwargs": {}}', "PayloadError", "not a job envelope"),
    "kwargs-not-a-dict": ("tests.add", '{"args": [1, 2], "kwargs": [3]}', "PayloadError", "not a job envelope"),
    "a-json-string": ("tests.add", '"args"', "PayloadError", "not a job envelope"),
    "model-pk-of-the-wrong-type": (
        "tests.testapp.jobs.touch_order",
        '{"args": [%s], "kwargs": {}}' % (MODEL % '"A-1"'),
        "PayloadError",
        "'A-1'",
    ),
    "model-pk-a-list": (
        "tests.testapp.jobs.touch_order",
        '{"args": [%s], "kwargs": {}}' % (MODEL % "[1, 2]"),
        "PayloadError",
        "[1, 2]",
    ),
    # A context job reads its position when it starts; any chain step reports progress when it ends.
    "chain-step-not-a-number": (
        "tests.testapp.jobs.fail_once",
        '{"args": ["c"], "kwargs": {}, "chain": {"id": "c1", "step": "two", "total": 3}}',
        "PayloadError",
        "chain position",
    ),
    "chain-total-missing-its-value": (
        "tests.add",
        '{"args": [1, 2], "kwargs": {}, "chain": {"id": "c2", "step": 1, "total": null}}',
        "PayloadError",
        "chain position",
    ),
    "nested-too-deep": (
        "tests.add",
        '{"args": [' + "[" * 100_000 + "]" * 100_000 + '], "kwargs": {}}',
        "PayloadError",
        "RecursionError",
    ),
}


def test_poison_rows_fail_at_once_with_a_reason_and_the_worker_process_keeps_serving(worker_process):
    rows = {
        label: Job.objects.create(name=name, payload=stored, retry_after=60, available_at=Now(), created_at=Now())
        for label, (name, stored, _cls, _message) in POISON.items()
    }
    jobs.record.enqueue("after-poison")
    process = worker_process("--sleep", "0.05")
    wait_until(
        lambda: Run.objects.filter(key="after-poison").exists(),
        60,
        f"the worker did not get past the poison rows:\n{process.output()}",
    )
    assert process.process.poll() is None, process.output()
    for label, row in rows.items():
        failed = FailedJob.objects.get(job_id=row.pk)
        _name, _stored, exception_class, message = POISON[label]
        assert failed.attempts == 1, label
        assert failed.exception_class.endswith(exception_class), (label, failed.exception_class, failed.error)
        assert "cannot run" in failed.error and message in failed.error, (label, failed.error[-500:])
    process.signal(signal.SIGTERM)
    assert process.wait(timeout=30) == 0, process.output()
    assert not Job.objects.exists()


def test_system_exit_and_keyboard_interrupt_from_a_job_do_not_end_a_worker_process(worker_process):
    jobs.raise_system_exit.enqueue()
    jobs.raise_keyboard_interrupt.enqueue()
    jobs.record.enqueue("after-exits")
    process = worker_process("--sleep", "0.05")
    wait_until(
        lambda: Run.objects.filter(key="after-exits").exists() and FailedJob.objects.count() == 2,
        60,
        f"the worker did not carry on:\n{process.output()}",
    )
    assert process.process.poll() is None, process.output()
    failures = dict(FailedJob.objects.values_list("name", "exception_class"))
    assert failures == {
        "tests.testapp.jobs.raise_system_exit": "builtins.SystemExit",
        "tests.testapp.jobs.raise_keyboard_interrupt": "builtins.KeyboardInterrupt",
    }
    # The job's KeyboardInterrupt is not a signal: the worker neither stops nor counts a signal.
    assert "stopping" not in process.output()
    process.signal(signal.SIGTERM)
    assert process.wait(timeout=30) == 0, process.output()


# -- memory -------------------------------------------------------------------------------------


def test_a_job_leaking_past_the_memory_limit_restarts_its_process_and_loses_no_job(worker_process):
    # tests/test_acceptance.py recycles after every job (--memory 1); here one real leak
    # crosses a limit the other jobs stay under, mid-queue.
    enqueue_many(jobs.record.bind(f"before-{i}") for i in range(20))
    jobs.leak.enqueue("leak", 200)
    enqueue_many(jobs.record.bind(f"after-{i}") for i in range(20))
    process = worker_process("--concurrency", "1", "--memory", "150", "--stop-when-empty", "--sleep", "0.05")
    assert process.wait(timeout=120) == 0, process.output()
    output = process.output()
    assert output.count("memory limit reached") == 1 and output.count("worker process recycled") == 1, output
    pids = dict(Run.objects.values_list("key", "pid"))
    assert len(pids) == 41
    before = {pids[f"before-{i}"] for i in range(20)}
    after = {pids[f"after-{i}"] for i in range(20)}
    # The leaking job ran to the end and was recorded in the old process; the rest in the new one.
    assert before == {pids["leak"]} and len(after) == 1 and after != before
    assert not Job.objects.exists() and not FailedJob.objects.exists()


# -- the database goes away: a restarted server, killed connections ----------------------------

# One log line per job outcome (see "Running workers" in the README).
LOST_CLAIM = re.compile(r"released job=\S+ id=(?P<id>\d+) attempt=(?P<attempt>\d+): its claim committed but the reply")
OUTCOME = re.compile(
    r"job=(?P<name>\S+) id=(?P<id>\d+) queue=\S+ attempt=(?P<attempt>\d+) "
    r"outcome=(?P<outcome>\w+) duration=\S+(?: retry_in=\S+)?(?: error=(?P<error>\S+))?"
)
CONNECTION_ERRORS = {"django.db.utils.OperationalError", "django.db.utils.InterfaceError"}
INTEGRITY_ERROR = "django.db.utils.IntegrityError"


def assert_each_job_ran_once(expected_keys: set[str], logs: str) -> dict[str, int]:
    """Check the rule for a drain through database faults; return counts for the report.

    Each job inserts one Run row under a unique key. The rule:
    - every key has exactly one Run row, and no job is left in the queue;
    - no reservation was reclaimed or lost and no outcome was given up on: a job never
      ran twice because of the queue;
    - a job ran again only after an attempt that ended in a connection error raised by
      its own query (released with OperationalError or InterfaceError). If that query
      had committed before the connection dropped (the server committed, the reply was
      lost), the job's write happened and the rerun meets the unique key: from then on
      it may be released or failed with IntegrityError, and end in FailedJob. Those
      jobs, and only those, may be in FailedJob; they are counted as ambiguous commits.
    """
    assert set(Run.objects.values_list("key", flat=True)) == expected_keys
    assert Run.objects.count() == len(expected_keys)
    assert not Job.objects.exists()
    failed = {str(row.job_id): row.exception_class for row in FailedJob.objects.all()}
    attempts: dict[str, list[tuple[int, str, str | None]]] = defaultdict(list)
    for match in OUTCOME.finditer(logs):
        attempts[match["id"]].append((int(match["attempt"]), match["outcome"], match["error"]))
    # A claim whose commit reached the server while the reply was lost is given back
    # unrun by its worker (Outages.release_lost_claims): an attempt without a run.
    for match in LOST_CLAIM.finditer(logs):
        attempts[match["id"]].append((int(match["attempt"]), "given_back", None))
    assert len(attempts) == len(expected_keys), "a job's outcome was never logged"
    reruns = ambiguous = 0
    for job_id, seen in attempts.items():
        seen.sort()
        numbers = [attempt for attempt, _o, _e in seen]
        assert numbers == list(range(numbers[0], numbers[0] + len(numbers))), (job_id, seen)
        *earlier, (_attempt, last, last_error) = seen
        broke = False
        for _attempt, outcome, error in earlier:
            if outcome == "given_back":
                continue
            assert outcome == "released", (job_id, seen)
            assert error in CONNECTION_ERRORS or (broke and error == INTEGRITY_ERROR), (job_id, seen)
            broke = broke or error in CONNECTION_ERRORS
        if last == "succeeded":
            assert job_id not in failed, (job_id, seen)
        else:
            assert (last, last_error, failed.get(job_id)) == ("failed", INTEGRITY_ERROR, INTEGRITY_ERROR), seen
            assert broke, (job_id, seen)
            ambiguous += 1
        reruns += len(seen) - 1
    assert len(failed) == ambiguous
    for line in ("reclaimed", "reservation lost", "giving up", "crashed", "Traceback"):
        assert line not in logs, f"{line!r} in the workers' logs"
    return {
        "jobs": len(attempts),
        "reruns": reruns,
        "ambiguous_commits": ambiguous,
        "db_errors": logs.count("connection_lost=True"),
        "record_errors": logs.count("database error during record"),
        "given_back": logs.count("given_back=connection_lost"),
    }


def postgres_version() -> str | None:
    root = Path("/etc/postgresql")
    versions = sorted(entry.name for entry in root.iterdir()) if root.is_dir() else []
    return versions[-1] if versions else None


def restart_postgres() -> float:
    """Restart the local cluster (fast shutdown: every session ends); return the seconds it took."""
    started = time.monotonic()
    subprocess.run(
        ["pg_ctlcluster", "--skip-systemctl-redirect", str(postgres_version()), "main", "restart"],
        check=True,
        timeout=120,
        capture_output=True,
    )
    # This process's connection died with the server: the next query opens a new one.
    connection.close()
    return time.monotonic() - started


def can_restart_postgres() -> tuple[bool, str]:
    if connection.vendor != "postgresql":
        return False, "restarts a PostgreSQL server"
    if not os.environ.get("DBQUEUE_TEST_RESTART_POSTGRES"):
        return False, (
            "restarting PostgreSQL ends every session on the server, other test runs included; "
            "set DBQUEUE_TEST_RESTART_POSTGRES=1 where the server is this run's alone (CI)"
        )
    if not shutil.which("pg_ctlcluster") or postgres_version() is None:
        return False, "needs a local Debian PostgreSQL cluster (pg_ctlcluster)"
    return True, ""


def test_four_workers_drain_20000_jobs_through_postgresql_restarts(worker_process):
    runnable, reason = can_restart_postgres()
    if not runnable:
        pytest.skip(reason)
    # Enough that the queue is still busy after the first restart (the workers
    # drain a few thousand jobs a second).
    total = 20000
    enqueue_many(jobs.record.bind(f"r{i}") for i in range(total))
    process = worker_process("--concurrency", "4", "--sleep", "0.05")
    wait_until(lambda: len(children_of(process.pid)) == 4, 30, f"the workers never started:\n{process.output()}")
    workers = set(children_of(process.pid))
    downtime = []
    for share in (0.2, 0.5):
        wait_until(
            lambda share=share: Run.objects.count() >= total * share,
            120,
            f"the workers stopped draining:\n{process.output()[-3000:]}",
        )
        downtime.append(restart_postgres())
        assert Job.objects.exists(), "the queue drained before the restart: enqueue more jobs"
    wait_until(lambda: not Job.objects.exists(), 240, f"jobs were stranded:\n{process.output()[-3000:]}")
    # The same four processes: none died and was replaced, none ended its loop quietly.
    assert set(children_of(process.pid)) == workers and all(_alive(pid) for pid in workers), process.output()
    process.signal(signal.SIGTERM)
    assert process.wait(timeout=60) == 0, process.output()[-3000:]
    counts = assert_each_job_ran_once({f"r{i}" for i in range(total)}, process.output())
    assert counts["db_errors"] >= 4, "the workers never noticed the restarts"
    print(f"restarts took {', '.join(f'{d:.1f}' for d in downtime)} s; {counts}")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.mark.skipif(
    "os.environ.get('DBQUEUE_TEST_DB', 'sqlite') == 'sqlite'", reason="SQLite has no server connection to kill"
)
@pytest.mark.parametrize("batch", [1, 4])
def test_workers_drain_every_job_once_while_their_connections_are_killed_again_and_again(worker_process, batch):
    orders = Order.objects.bulk_create([Order(number=f"K-{i}") for i in range(100)])
    enqueue_many([jobs.record.bind(f"r{i}") for i in range(3000)] + [jobs.touch_order.bind(order) for order in orders])
    for i in range(50):
        chain(jobs.step.bind(f"c{i}", 1), jobs.step.bind(f"c{i}", 2), jobs.step.bind(f"c{i}", 3)).enqueue()
    expected = (
        {f"r{i}" for i in range(3000)}
        | {f"order-{order.pk}" for order in orders}
        | {f"c{i}-{n}" for i in range(50) for n in (1, 2, 3)}
    )
    workers = [worker_process("--sleep", "0.05", "--batch", str(batch)) for _ in range(4)]
    wait_until(lambda: Run.objects.count() >= 200, 60, f"the workers never started:\n{workers[0].output()}")
    kills, rounds, until = 0, 0, time.monotonic() + 8
    while time.monotonic() < until and Job.objects.exists():
        kills += kill_other_connections()
        rounds += 1
        time.sleep(0.3)
    assert rounds >= 5, f"the queue drained after {rounds} rounds of kills: enqueue more jobs"
    wait_until(lambda: not Job.objects.exists(), 240, f"jobs were stranded:\n{workers[0].output()[-3000:]}")
    for process in workers:
        assert process.process.poll() is None, f"a worker loop ended:\n{process.output()[-3000:]}"
        # Each met a killed connection: in its own query, or first in a job's (given back).
        output = process.output()
        assert "connection_lost=True" in output or "given_back=connection_lost" in output, output[-3000:]
    for process in workers:
        process.signal(signal.SIGTERM)
        assert process.wait(timeout=60) == 0, process.output()[-3000:]
    # A chain step whose write committed while its reply was lost fails on its rerun (the
    # ambiguous commit assert_each_job_ran_once allows): the steps after it never run, and
    # stay in its FailedJob payload.
    for failed in FailedJob.objects.filter(exception_class=INTEGRITY_ERROR):
        for step in json.loads(failed.payload).get("next", []):
            expected.discard("{}-{}".format(*step["args"]))
    counts = assert_each_job_ran_once(expected, "".join(process.output() for process in workers))
    # Some kills landed while a job ran (it was given back without spending a try) or while its
    # worker stored an outcome (stored once the connection was back).
    assert counts["record_errors"] + counts["given_back"] >= 1, counts
    print(f"{kills} sessions killed in {rounds} rounds; {counts}")


# -- telling a lost connection from a refused query ---------------------------------------------


def test_a_query_the_database_refuses_is_not_taken_for_a_lost_connection():
    with pytest.raises(DatabaseError) as refused, connection.cursor() as cursor:
        cursor.execute("SELECT no_such_column FROM dbqueue_job")
    # SQLite says OperationalError here, as for a lost connection: the connection itself tells.
    assert not is_connection_error(refused.value)


@pytest.mark.skipif(
    "os.environ.get('DBQUEUE_TEST_DB', 'sqlite') == 'sqlite'", reason="SQLite has no server connection to kill"
)
@pytest.mark.parametrize("in_transaction", [False, True])
def test_a_killed_session_is_taken_for_a_lost_connection(in_transaction):
    kill_session(session_id())
    # Inside atomic, Django replaces the broken connection by a fresh one on the way out.
    block = transaction.atomic() if in_transaction else nullcontext()
    with pytest.raises(DatabaseError) as lost, block, connection.cursor() as cursor:
        cursor.execute("SELECT 1")
    assert is_connection_error(lost.value)
    connection.close()


def test_after_a_failed_reserve_a_worker_releases_its_lost_claims_but_not_a_job_it_could_not_record():
    lost_claim = jobs.record.enqueue("lost-claim")
    unrecorded = jobs.record.enqueue("unrecorded")
    worker = Worker(WorkerOptions(queues=["elsewhere"], defaults=Defaults(tries=3, timeout=30, backoff=0)))
    Job.objects.filter(pk__in=[lost_claim.pk, unrecorded.pk]).update(
        attempts=1, reserved_at=Now(), reserved_by=worker.worker_id
    )
    worker.outages.unrecorded.add(unrecorded.pk)
    worker.outages.claim_errors = 1
    assert worker.reserve() == []
    assert Job.objects.get(pk=lost_claim.pk).reserved_at is None
    # It ran: leaving it to its retry_after, as the "giving up" log line says.
    assert Job.objects.get(pk=unrecorded.pk).reserved_at is not None
