"""Fixtures shared by the test layers."""

from __future__ import annotations

import asyncio
import importlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from asgiref.sync import sync_to_async
from django.contrib.auth.models import Permission, User
from django.db import DatabaseError, connection, connections
from django.test import Client

from django_dbqueue import registry
from django_dbqueue.execution import Defaults
from django_dbqueue.heartbeat import Heartbeat
from django_dbqueue.worker import StopReason, Worker, WorkerOptions

ROOT = Path(__file__).resolve().parent.parent


def vendor() -> str:
    return connection.vendor


def run_worker(queues: list[str] | None = None, **overrides: Any) -> tuple[Worker, StopReason]:
    """Run a worker in this process until the queue is empty."""
    defaults = overrides.pop("defaults", Defaults(tries=3, timeout=30, backoff=0, timeout_grace=2))
    overrides.setdefault("stop_when_empty", True)
    overrides.setdefault("sleep", 0)
    options = WorkerOptions(queues=queues or ["default"], defaults=defaults, **overrides)
    worker = Worker(options)
    reason = worker.run()
    return worker, reason


def claim(worker: Worker) -> list[Any]:
    """Claim as the worker loop does, and hand the jobs to the worker's executor (a one-slot
    worker then runs one each time ``worker._collect()`` is called)."""
    jobs = worker.reserve(worker._claim_size())
    worker._submit(jobs)
    return jobs


class WorkerProcess:
    """A real ``queue_work`` process on the test database."""

    def __init__(self, *args: str, env: dict[str, str] | None = None, prefix: list[str] | None = None) -> None:
        environment = {
            **os.environ,
            "DJANGO_SETTINGS_MODULE": "tests.settings",
            "DBQUEUE_TEST_USE_TEST_DB": "1",
            "PYTHONPATH": str(ROOT),
            "PYTHONUNBUFFERED": "1",
            **(env or {}),
        }
        self.args = args
        self.log_path = ROOT / ".pytest_cache" / f"worker-{os.getpid()}-{time.monotonic_ns()}.log"
        self.log_path.parent.mkdir(exist_ok=True)
        self._log = open(self.log_path, "wb")
        self.process = subprocess.Popen(
            [*(prefix or []), sys.executable, "-m", "django", "queue_work", *args],
            cwd=ROOT,
            env=environment,
            stdout=self._log,
            stderr=subprocess.STDOUT,
        )

    @property
    def pid(self) -> int:
        return self.process.pid

    def output(self) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")

    def signal(self, signum: int) -> None:
        self.process.send_signal(signum)

    def wait(self, timeout: float) -> int:
        try:
            return self.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"worker did not exit within {timeout} s; output:\n{self.output()}") from None

    def wait_for_output(self, text: str, timeout: float = 30) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if text in self.output():
                return
            if self.process.poll() is not None:
                break
            time.sleep(0.05)
        raise AssertionError(f"{text!r} not seen in worker output:\n{self.output()}")

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait(timeout=10)
        # Children of a supervisor live in their own process groups.
        self._log.close()


# Tests of the PostgreSQL LISTEN/NOTIFY wake-up.
needs_listen = pytest.mark.skipif(
    os.environ.get("DBQUEUE_TEST_DB", "sqlite") != "postgres",
    reason="LISTEN/NOTIFY is PostgreSQL's; other databases poll",
)


@pytest.fixture(autouse=True)
def _claims_start_afresh() -> Iterator[None]:
    """Claims cache the paused queues for half a second (claims.PAUSE_CHECK), and learn
    which queues hold jobs unique until started; workers cache the cancelled batches
    (batches.CANCEL_CHECK). A test's rows are rolled back with it, so no test claims
    with what the previous one left."""
    from django_dbqueue import batches, claims

    claims.forget_paused()
    claims.plain._clearing.clear()
    batches.forget_cancelled()
    yield
    claims.forget_paused()
    claims.plain._clearing.clear()
    batches.forget_cancelled()


@pytest.fixture(autouse=True)
def _no_heartbeat_outlives_its_test(request: pytest.FixtureRequest) -> Iterator[None]:
    """Stop a worker heartbeat that a test left beating in this process (a worker built by
    hand whose jobs were held and never let go), so its next beat does not land in the
    next test, which may not allow the database at all; say which test left it."""
    yield
    for thread in threading.enumerate():
        heartbeat = getattr(getattr(thread, "_target", None), "__self__", None)
        if thread.name.startswith("dbqueue-heartbeat-") and isinstance(heartbeat, Heartbeat):
            print(f"\n{request.node.nodeid} left {thread.name} beating: stopped", file=sys.stderr)
            heartbeat.stop()


@pytest.fixture
def worker_process() -> Iterator[Callable[..., WorkerProcess]]:
    started: list[WorkerProcess] = []

    def start(*args: str, env: dict[str, str] | None = None, prefix: list[str] | None = None) -> WorkerProcess:
        process = WorkerProcess(*args, env=env, prefix=prefix)
        started.append(process)
        return process

    yield start
    for process in started:
        # Supervised workers live in their own process groups: find them first.
        children = children_of(process.pid)
        process.stop()
        for child in children:
            try:
                os.kill(child, signal.SIGKILL)
            except ProcessLookupError:
                pass


def children_of(pid: int) -> list[int]:
    """Pids of the processes whose parent is ``pid``."""
    result = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
            result.append(int(entry.name))
    return result


def wait_until(predicate: Callable[[], bool], timeout: float, message: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.05)
    raise AssertionError(message)


@contextmanager
def listening(channel: str = "dbqueue") -> Iterator[Any]:
    """A psycopg connection of its own that LISTENs on ``channel`` (PostgreSQL), closed after."""
    import psycopg

    settings = connection.settings_dict
    listener = psycopg.connect(
        host=settings["HOST"], port=settings["PORT"], user=settings["USER"], dbname=settings["NAME"], autocommit=True
    )
    try:
        listener.execute(f"LISTEN {channel}")
        yield listener
    finally:
        listener.close()


def session_id() -> int:
    """This process's database session: the backend pid (PostgreSQL) or the connection id (MariaDB)."""
    connection.ensure_connection()
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_backend_pid()" if connection.vendor == "postgresql" else "SELECT CONNECTION_ID()")
        return int(cursor.fetchone()[0])


def kill_session(session: int) -> None:
    """End database session ``session`` (a backend pid, a MariaDB connection id) from a connection of its own."""
    other = connections.create_connection("default")
    try:
        with other.cursor() as cursor:
            if other.vendor == "postgresql":
                cursor.execute("SELECT pg_terminate_backend(%s)", [session])
            else:
                cursor.execute(f"KILL {int(session)}")
    finally:
        other.close()


def kill_other_connections() -> int:
    """End every other session on the test database, as a server restart would; return how many."""
    with connection.cursor() as cursor:
        if connection.vendor == "postgresql":
            cursor.execute(
                "SELECT pid FROM pg_stat_activity WHERE datname = current_database() AND pid <> pg_backend_pid()"
            )
            pids = [row[0] for row in cursor.fetchall()]
            for pid in pids:
                cursor.execute("SELECT pg_terminate_backend(%s)", [pid])
            # pg_terminate_backend only signals: wait until the sessions are gone, as
            # after a restart, or a client could still use one for a statement or two.
            deadline = time.monotonic() + 10
            while pids and time.monotonic() < deadline:
                cursor.execute("SELECT count(*) FROM pg_stat_activity WHERE pid = ANY(%s)", [pids])
                if not cursor.fetchone()[0]:
                    break
                time.sleep(0.01)
            return len(pids)
        cursor.execute("SELECT id FROM information_schema.processlist WHERE db = DATABASE() AND id <> CONNECTION_ID()")
        ids = [row[0] for row in cursor.fetchall()]
        for session in ids:
            try:
                cursor.execute("KILL %s", [session])
            except DatabaseError as exc:  # the session may have ended by itself meanwhile
                if "Unknown thread id" not in str(exc):
                    raise
        return len(ids)


@contextmanager
def registered(module_name: str) -> Iterator[ModuleType]:
    """The jobs of ``tests.testapp.<module_name>`` (its ``DEFINITIONS``), registered for one
    test only: imported here, not at collection, where ``@job`` would register them for every
    test (their queues would show in the other tests' checks and claims)."""
    module = importlib.import_module(f"tests.testapp.{module_name}")
    for definition in module.DEFINITIONS:
        registry.register(definition)
    try:
        yield module
    finally:
        for definition in module.DEFINITIONS:
            registry.unregister(definition.name)


@pytest.fixture
def limits() -> Iterator[ModuleType]:
    """The jobs of tests/testapp/limit_jobs.py (concurrency keys and rate limits), for one test."""
    with registered("limit_jobs") as module:
        yield module


def insert_at_this_schema(row: Any) -> Any:
    """Insert ``row`` (a ``Job`` with plain values) into the job table as it stands, writing only the
    columns it has: the migration tests go back to schemas without the columns added since."""
    from django_dbqueue.models import Job

    table = Job._meta.db_table
    with connection.cursor() as cursor:
        present = {column.name for column in connection.introspection.get_table_description(cursor, table)}
        fields = [f for f in Job._meta.concrete_fields if f.column in present and not f.primary_key]
        qn = connection.ops.quote_name
        sql = (
            f"INSERT INTO {qn(table)} ({', '.join(qn(f.column) for f in fields)}) "
            f"VALUES ({', '.join(['%s'] * len(fields))})"
        )
        values = [f.get_db_prep_save(getattr(row, f.attname), connection) for f in fields]
        if connection.vendor == "postgresql":
            cursor.execute(sql + " RETURNING " + qn(Job._meta.pk.column), values)
            row.pk = cursor.fetchone()[0]
        else:
            cursor.execute(sql, values)
            row.pk = cursor.lastrowid
    return row


def ticks_while(awaitable: Callable[[], Any]) -> int:
    """Run ``awaitable()`` in a fresh event loop beside a task ticking every 10 ms; return the ticks
    (at least one: the loop ran on while it awaited). Closes the async side's connections after."""
    ticks = 0

    async def tick() -> None:
        nonlocal ticks
        while True:
            ticks += 1
            await asyncio.sleep(0.01)

    async def main() -> None:
        ticker = asyncio.create_task(tick())
        try:
            await awaitable()
        finally:
            ticker.cancel()
            await sync_to_async(connections.close_all)()

    asyncio.run(main())
    return ticks


@pytest.fixture
def admin(admin_user: Any) -> Client:
    """A test client logged in as a superuser."""
    client = Client()
    client.force_login(admin_user)
    return client


@pytest.fixture
def staff(db: None) -> Callable[..., Client]:
    """``staff(*codenames)``: a test client logged in as a staff user with only these permissions of the app."""

    def make(*codenames: str) -> Client:
        user = User.objects.create_user(f"user{User.objects.count()}", password="pw", is_staff=True)
        user.user_permissions.set(
            Permission.objects.filter(content_type__app_label="django_dbqueue", codename__in=codenames)
        )
        client = Client()
        client.force_login(user)
        return client

    return make
