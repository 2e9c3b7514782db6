"""The benchmark's orchestrator: ``bench/run`` starts it in the project's environment.

Every system has a driver (``bench/drivers/``) that runs in that system's own
environment and database; this module starts the drivers and the worker
processes, times the drains from the outside, and prints and stores the
figures. See docs/performance.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import platform
import resource
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "bench"
VENVS = BENCH / ".venvs"
RESULTS = BENCH / "results"
LOGS = RESULTS / "logs"
RESULT_PREFIX = "BENCH_RESULT "
NCPU = os.cpu_count() or 1


def env_int(name: str, default: int) -> int:
    return int(os.environ.get(name, default))


def env_float(name: str, default: float) -> float:
    return float(os.environ.get(name, default))


@dataclasses.dataclass
class Config:
    """Scenario sizes; every one can be set with an environment variable."""

    enqueue_one: int = 2000  # BENCH_ENQUEUE_ONE
    enqueue_bulk: int = 50_000  # BENCH_ENQUEUE_BULK
    enqueue_stream: int = 1_000_000  # BENCH_ENQUEUE_STREAM (django-dbqueue only: handles=False)
    drain_jobs: int = 0  # BENCH_DRAIN_JOBS: fixed jobs per drain; 0 sizes each drain for BENCH_DRAIN_SECONDS
    drain_seconds: float = 6.0  # BENCH_DRAIN_SECONDS
    drain_min: int = 500  # BENCH_DRAIN_MIN
    drain_max: int = 20_000  # BENCH_DRAIN_MAX
    calibrate_jobs: int = 500  # BENCH_CALIBRATE_JOBS
    drain_timeout: float = 180.0  # BENCH_DRAIN_TIMEOUT
    workers: tuple[int, ...] = (1, 2, 4)  # BENCH_WORKERS
    sleep: float = 0.01  # BENCH_SLEEP: queue_work --sleep during drains
    latency_jobs: int = 200  # BENCH_LATENCY_JOBS
    latency_gap_ms: tuple[float, float] = (5.0, 30.0)  # BENCH_LATENCY_GAP_MS="5,30"
    latency_fast_sleep: float = 0.05  # BENCH_LATENCY_SLEEP: the extra dbqueue latency run's --sleep
    worker_boot: float = 2.0  # BENCH_WORKER_BOOT: seconds an idle worker gets to start before the latency run
    claim_sizes: tuple[int, ...] = (1000, 100_000, 1_000_000)  # BENCH_CLAIM_SIZES
    claim_in_front: int = 100_000  # BENCH_CLAIM_IN_FRONT
    claim_iterations: int = 200  # BENCH_CLAIM_ITERATIONS
    profile_jobs: int = 3000  # BENCH_PROFILE_JOBS
    batch: int = 10  # BENCH_BATCH: extra queue_work --batch N drains of django-dbqueue (0: none; the default is 50)
    alternating_rounds: int = 5  # BENCH_ALTERNATING_ROUNDS: enqueue rounds alternating with pgqueuer (0: none)
    bulk_calls: tuple[int, ...] = (10, 100, 1000, 50_000)  # BENCH_BULK_CALLS: enqueue_many call sizes, alternating
    bulk_calls_jobs: int = 20_000  # BENCH_BULK_CALLS_JOBS: jobs per round of those (at least one call)
    drain_rounds: int = 3  # BENCH_DRAIN_ROUNDS: drain rounds alternating with pgqueuer (0: none)
    instructions: int = 1  # BENCH_INSTRUCTIONS: count a single enqueue's instructions with callgrind (0: no)

    @classmethod
    def from_env(cls, quick: bool) -> Config:
        base = cls.quick() if quick else cls()

        def tup(name: str, default: tuple[Any, ...], kind: type) -> tuple[Any, ...]:
            text = os.environ.get(name)
            return tuple(kind(part) for part in text.split(",")) if text else default

        return cls(
            enqueue_one=env_int("BENCH_ENQUEUE_ONE", base.enqueue_one),
            enqueue_bulk=env_int("BENCH_ENQUEUE_BULK", base.enqueue_bulk),
            enqueue_stream=env_int("BENCH_ENQUEUE_STREAM", base.enqueue_stream),
            drain_jobs=env_int("BENCH_DRAIN_JOBS", base.drain_jobs),
            drain_seconds=env_float("BENCH_DRAIN_SECONDS", base.drain_seconds),
            drain_min=env_int("BENCH_DRAIN_MIN", base.drain_min),
            drain_max=env_int("BENCH_DRAIN_MAX", base.drain_max),
            calibrate_jobs=env_int("BENCH_CALIBRATE_JOBS", base.calibrate_jobs),
            drain_timeout=env_float("BENCH_DRAIN_TIMEOUT", base.drain_timeout),
            workers=tup("BENCH_WORKERS", base.workers, int),
            sleep=env_float("BENCH_SLEEP", base.sleep),
            latency_jobs=env_int("BENCH_LATENCY_JOBS", base.latency_jobs),
            latency_gap_ms=tup("BENCH_LATENCY_GAP_MS", base.latency_gap_ms, float),  # type: ignore[arg-type]
            latency_fast_sleep=env_float("BENCH_LATENCY_SLEEP", base.latency_fast_sleep),
            worker_boot=env_float("BENCH_WORKER_BOOT", base.worker_boot),
            claim_sizes=tup("BENCH_CLAIM_SIZES", base.claim_sizes, int),
            claim_in_front=env_int("BENCH_CLAIM_IN_FRONT", base.claim_in_front),
            claim_iterations=env_int("BENCH_CLAIM_ITERATIONS", base.claim_iterations),
            profile_jobs=env_int("BENCH_PROFILE_JOBS", base.profile_jobs),
            batch=env_int("BENCH_BATCH", base.batch),
            alternating_rounds=env_int("BENCH_ALTERNATING_ROUNDS", base.alternating_rounds),
            bulk_calls=tup("BENCH_BULK_CALLS", base.bulk_calls, int),
            bulk_calls_jobs=env_int("BENCH_BULK_CALLS_JOBS", base.bulk_calls_jobs),
            drain_rounds=env_int("BENCH_DRAIN_ROUNDS", base.drain_rounds),
            instructions=env_int("BENCH_INSTRUCTIONS", base.instructions),
        )

    @classmethod
    def quick(cls) -> Config:
        return cls(
            enqueue_one=200,
            enqueue_bulk=5000,
            alternating_rounds=1,
            bulk_calls=(10, 1000),
            bulk_calls_jobs=2000,
            drain_rounds=1,
            instructions=0,
            enqueue_stream=20_000,
            drain_seconds=1.5,
            drain_min=200,
            drain_max=2000,
            calibrate_jobs=200,
            latency_jobs=30,
            worker_boot=1.5,
            claim_sizes=(1000, 10_000),
            claim_in_front=10_000,
            claim_iterations=50,
            profile_jobs=500,
        )


# -- systems -----------------------------------------------------------------------


@dataclasses.dataclass
class System:
    key: str
    label: str
    python: Path
    driver: str
    env: dict[str, str]
    # One worker process: (stop when the queue is empty?, extra options) -> argv
    worker: Callable[[bool, list[str]], list[str]]
    pg_database: str | None = None
    has_bulk: bool = True
    # The django-dbqueue supervisor: queue_work --concurrency N
    supervised: bool = False
    packages: tuple[str, ...] = ()


def project_python() -> Path:
    return ROOT / ".venv" / "bin" / "python"


def dbqueue_system(key: str, label: str, db: str, sleep: float) -> System:
    python = project_python()

    def worker(stop: bool, extra: list[str]) -> list[str]:
        argv = [str(python), "-m", "django", "queue_work"]
        if stop:
            argv += ["--stop-when-empty", "--sleep", str(sleep)]
        return argv + extra

    return System(
        key=key,
        label=label,
        python=python,
        driver="bench.drivers.dbqueue",
        env={"DJANGO_SETTINGS_MODULE": "bench.settings", "BENCH_DB": db},
        worker=worker,
        pg_database="dbqueue_bench" if db == "postgres" else None,
        supervised=True,
        packages=("django-dbqueue", "Django", "psycopg", "mysqlclient"),
    )


def procrastinate_system() -> System:
    python = VENVS / "procrastinate" / "bin" / "python"

    def worker(stop: bool, extra: list[str]) -> list[str]:
        return [str(python), "-m", "bench.drivers.peer_procrastinate", "worker", *([] if stop else ["--wait"]), *extra]

    return System(
        key="procrastinate",
        label="procrastinate",
        python=python,
        driver="bench.drivers.peer_procrastinate",
        env={},
        worker=worker,
        pg_database="procrastinate_bench",
        packages=("procrastinate", "psycopg"),
    )


def tasksdb_system(conn_max_age: str) -> System:
    python = VENVS / "tasksdb" / "bin" / "python"
    persistent = conn_max_age != "0"

    def worker(stop: bool, extra: list[str]) -> list[str]:
        argv = [str(python), "-m", "django", "db_worker"]
        if stop:
            argv += ["--batch", "--interval", "0.01", "--no-startup-delay"]
        return argv + extra

    return System(
        key="tasksdb" if persistent else "tasksdb_conn0",
        label="django-tasks-db" if persistent else "django-tasks-db (CONN_MAX_AGE=0)",
        python=python,
        driver="bench.drivers.peer_tasksdb",
        env={"DJANGO_SETTINGS_MODULE": "bench.drivers.tasksdb_settings", "BENCH_TASKSDB_CONN_MAX_AGE": conn_max_age},
        worker=worker,
        pg_database="tasksdb_bench",
        has_bulk=False,
        packages=("django-tasks-db", "Django", "psycopg"),
    )


def pgqueuer_system() -> System:
    python = VENVS / "pgqueuer" / "bin" / "python"

    def worker(stop: bool, extra: list[str]) -> list[str]:
        return [str(python), "-m", "bench.drivers.peer_pgqueuer", "worker", *([] if stop else ["--wait"]), *extra]

    return System(
        key="pgqueuer",
        label="pgqueuer",
        python=python,
        driver="bench.drivers.peer_pgqueuer",
        env={},
        worker=worker,
        pg_database="pgqueuer_bench",
        packages=("pgqueuer", "asyncpg"),
    )


# -- running things ----------------------------------------------------------------------


class Failed(Exception):
    pass


def child_env(system: System, **extra: str) -> dict[str, str]:
    env = {**os.environ, **system.env, **extra}
    env["PYTHONPATH"] = str(ROOT)
    env.pop("VIRTUAL_ENV", None)
    return env


def driver(system: System, command: str, *args: str, timeout: float = 600, **env: str) -> dict[str, Any]:
    """Run a driver command in the system's environment; return its result."""
    argv = [str(system.python), "-m", system.driver, command, *args]
    proc = subprocess.run(
        argv, cwd=ROOT, env=child_env(system, **env), capture_output=True, text=True, timeout=timeout, check=False
    )
    if proc.returncode != 0:
        tail = "\n".join((proc.stderr or proc.stdout).strip().splitlines()[-6:])
        raise Failed(f"{system.label}: `{command}` exited {proc.returncode}: {tail}")
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith(RESULT_PREFIX):
            return dict(json.loads(line[len(RESULT_PREFIX) :]))
    raise Failed(f"{system.label}: `{command}` printed no result")


def spawn(system: System, argv: list[str], log_name: str, **env: str) -> subprocess.Popen[bytes]:
    LOGS.mkdir(parents=True, exist_ok=True)
    log = open(LOGS / f"{log_name}.log", "ab")
    # Its own session, so it never gets this terminal's signals.
    proc = subprocess.Popen(
        argv, cwd=ROOT, env=child_env(system, **env), stdout=log, stderr=subprocess.STDOUT, start_new_session=True
    )
    proc.log = log  # type: ignore[attr-defined]
    return proc


def stop(proc: subprocess.Popen[bytes], grace: float = 10.0) -> None:
    """End a worker we started: SIGTERM, then SIGKILL after ``grace`` seconds (by its id only)."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(grace)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    proc.log.close()  # type: ignore[attr-defined]


def machine_busy_seconds() -> float:
    """CPU seconds the whole machine spent busy since boot (/proc/stat)."""
    with open("/proc/stat") as stat:
        fields = [int(x) for x in stat.readline().split()[1:9]]
    user, nice, system, _idle, _iowait, irq, softirq, steal = fields
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def pg_commits(dbname: str | None) -> int | None:
    if dbname is None:
        return None
    import psycopg

    with psycopg.connect("host=127.0.0.1 user=postgres dbname=postgres", autocommit=True) as conn:
        row = conn.execute(
            "SELECT xact_commit + xact_rollback FROM pg_stat_database WHERE datname = %s", (dbname,)
        ).fetchone()
    return int(row[0]) if row else None


def pg_no_other_backends(dbname: str) -> None:
    """Wait until no session is left on ``dbname`` (the statistics of a backend are flushed when it ends)."""
    import psycopg

    with psycopg.connect("host=127.0.0.1 user=postgres dbname=postgres", autocommit=True) as conn:
        for _ in range(50):
            row = conn.execute("SELECT count(*) FROM pg_stat_activity WHERE datname = %s", (dbname,)).fetchone()
            if row and row[0] == 0:
                return
            time.sleep(0.1)


class LoadWatch:
    """Notes, twice a second, the moments other work (tests, workers, database sessions) runs beside us;
    work that names one of ``ignore`` (a benchmark's own databases) does not count."""

    def __init__(self, ignore: tuple[str, ...] = ()) -> None:
        self.ignore = ignore
        self.busy: list[float] = []
        self.seen: set[str] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> LoadWatch:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        pg = pg_watch_connection()
        while not self._stop.wait(0.5):
            load = other_load(pg)
            load["others"] = [item for item in load["others"] if not any(name in item for name in self.ignore)]
            if load["others"]:
                if pg is not None and any("PostgreSQL check failed" in item for item in load["others"]):
                    pg.close()
                    pg = pg_watch_connection()
                self.busy.append(time.monotonic())
                # What ran, not which process: "pytest -q tests/...", "3 busy sessions on test_dbqueue".
                self.seen.update(
                    item.split(": ", 1)[1][:80]
                    if item.startswith("process")
                    else item.split(" ", 1)[1]
                    if item[0].isdigit()
                    else item
                    for item in load["others"]
                )
        if pg is not None:
            pg.close()

    def during(self, start: float, end: float) -> bool:
        return any(start - 0.5 <= moment <= end + 0.5 for moment in self.busy)


class Bench:
    def __init__(self, config: Config, args: argparse.Namespace) -> None:
        self.config = config
        self.args = args
        self.results: dict[str, dict[str, Any]] = {}
        self.problems: list[str] = []
        self.calibrated: dict[str, float] = {}
        self.startup: dict[str, float] = {}
        self.watch = LoadWatch().start()
        if LOGS.exists():
            for old_log in LOGS.glob("*.log"):
                old_log.unlink()
        self.under_load: list[str] = []

    def note(self, text: str) -> None:
        print(f"  ! {text}", flush=True)
        self.problems.append(text)

    def record(self, system: System, scenario: str, value: dict[str, Any]) -> None:
        self.results.setdefault(system.key, {})[scenario] = value

    def attempt(self, system: System, scenario: str, action: Callable[[], dict[str, Any]]) -> dict[str, Any] | None:
        started = time.monotonic()
        print(f"- {system.label}: {scenario} ...", end=" ", flush=True)
        try:
            value = action()
        except Exception as exc:  # noqa: BLE001 - one scenario's failure (a restarted server...) ends only it
            print("failed", flush=True)
            self.note(f"{system.label}, {scenario}: {exc}")
            self.record(system, scenario, {"error": str(exc)})
            return None
        loaded = self.watch.during(started, time.monotonic())
        if loaded:
            value["under_load"] = True
            self.under_load.append(f"{system.label}: {scenario}")
        print(f"{summary(value)} ({time.monotonic() - started:.1f} s){' UNDER LOAD' if loaded else ''}", flush=True)
        self.record(system, scenario, value)
        return value

    # -- scenarios -------------------------------------------------------------------

    def enqueue(self, system: System) -> None:
        c = self.config
        self.attempt(system, "enqueue_one", lambda: driver(system, "enqueue-one", "--count", str(c.enqueue_one)))
        if system.has_bulk:
            self.attempt(system, "enqueue_bulk", lambda: driver(system, "enqueue-bulk", "--count", str(c.enqueue_bulk)))
        if system.key.startswith("dbqueue"):
            self.attempt(
                system,
                "enqueue_bulk_count",
                lambda: driver(system, "enqueue-bulk-count", "--count", str(c.enqueue_bulk)),
            )
            self.attempt(
                system, "enqueue_stream", lambda: driver(system, "enqueue-stream", "--count", str(c.enqueue_stream))
            )

    def drain_once(
        self,
        system: System,
        processes: int,
        jobs: int,
        *,
        supervised: bool = False,
        extra: list[str] | None = None,
        label: str = "",
    ) -> dict[str, Any]:
        """Fill ``jobs`` no-op jobs, start the workers, time until they all stopped on an empty queue."""
        filled = driver(system, "fill", "--count", str(jobs))["jobs"]
        if filled != jobs:
            raise Failed(f"filled {filled} jobs instead of {jobs}")
        if supervised:
            argvs = [system.worker(True, ["--concurrency", str(processes), *(extra or [])])]
        else:
            argvs = [system.worker(True, list(extra or [])) for _ in range(processes)]
        if system.pg_database:
            pg_no_other_backends(system.pg_database)
        commits_before = pg_commits(system.pg_database)
        usage_before = resource.getrusage(resource.RUSAGE_CHILDREN)
        busy_before = machine_busy_seconds()
        started = time.perf_counter()
        procs = [spawn(system, argv, f"{system.key}-{label or 'drain'}") for argv in argvs]
        deadline = time.monotonic() + self.config.drain_timeout
        try:
            for proc in procs:
                proc.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            for proc in procs:
                stop(proc, grace=2)
            raise Failed(f"the drain of {jobs} jobs did not finish in {self.config.drain_timeout:.0f} s") from None
        seconds = time.perf_counter() - started
        busy = machine_busy_seconds() - busy_before
        usage_after = resource.getrusage(resource.RUSAGE_CHILDREN)
        for proc in procs:
            proc.log.close()  # type: ignore[attr-defined]
        codes = [proc.returncode for proc in procs]
        left = driver(system, "remaining")["remaining"]
        if left:
            raise Failed(f"{left} of {jobs} jobs were still queued when the workers stopped (exit codes {codes})")
        if any(codes):
            raise Failed(f"a worker exited with {codes}")
        worker_cpu = (usage_after.ru_utime - usage_before.ru_utime) + (usage_after.ru_stime - usage_before.ru_stime)
        result: dict[str, Any] = {
            "jobs": jobs,
            "processes": processes,
            "seconds": seconds,
            "jobs_per_s": jobs / seconds,
            "worker_cpu_ms_per_job": worker_cpu * 1000 / jobs,
            "machine_cpu_ms_per_job": busy * 1000 / jobs,
        }
        startup = self.startup.get(system.key)
        if startup is not None and seconds > startup:
            result["jobs_per_s_after_startup"] = jobs / (seconds - startup)
        if system.pg_database:
            pg_no_other_backends(system.pg_database)
            commits_after = pg_commits(system.pg_database)
            if commits_before is not None and commits_after is not None:
                result["transactions_per_job"] = (commits_after - commits_before) / jobs
        return result

    def drain_size(self, system: System, processes: int, variant: str = "") -> int:
        c = self.config
        if c.drain_jobs:
            return c.drain_jobs
        rate = self.calibrated.get(system.key + variant) or self.calibrated.get(system.key) or 100.0
        size = rate * min(processes, NCPU) * c.drain_seconds
        return int(max(c.drain_min, min(c.drain_max, round(size, -2))))

    def calibrate(self, system: System) -> None:
        """Time a worker's start on an empty queue, and a small drain, to size the drains."""
        c = self.config

        def startup() -> dict[str, Any]:
            driver(system, "fill", "--count", "0")
            started = time.perf_counter()
            proc = spawn(system, system.worker(True, []), f"{system.key}-startup")
            proc.wait(60)
            proc.log.close()  # type: ignore[attr-defined]
            return {"seconds": time.perf_counter() - started}

        value = self.attempt(system, "worker_startup", startup)
        if value:
            self.startup[system.key] = value["seconds"]
        if c.drain_jobs:
            return
        self.calibrate_variant(system)

    def calibrate_variant(self, system: System, variant: str = "", extra: list[str] | None = None) -> None:
        """A small drain with one worker, to size the drains of this system (and options) to a few seconds."""
        c = self.config
        value = self.attempt(
            system,
            f"calibration{variant}",
            lambda: self.drain_once(system, 1, c.calibrate_jobs, extra=extra, label=f"calibration{variant}"),
        )
        if value:
            self.calibrated[system.key + variant] = value.get("jobs_per_s_after_startup") or value["jobs_per_s"]

    def drains(self, system: System, workers: tuple[int, ...]) -> None:
        self.calibrate(system)
        for n in workers:
            self.attempt(
                system,
                f"drain_{n}",
                lambda n=n: self.drain_once(system, n, self.drain_size(system, n), label=f"drain-{n}"),
            )
        if system.supervised and system.key == "dbqueue":
            for n in workers:
                self.attempt(
                    system,
                    f"drain_concurrency_{n}",
                    lambda n=n: self.drain_once(
                        system, n, self.drain_size(system, n), supervised=True, label=f"concurrency-{n}"
                    ),
                )
        batch = self.config.batch
        if system.supervised and batch > 1:
            variant, extra = f"_batch{batch}", ["--batch", str(batch)]
            if not self.config.drain_jobs:
                self.calibrate_variant(system, variant, extra)
            for n in workers:
                self.attempt(
                    system,
                    f"drain{variant}_{n}",
                    lambda n=n: self.drain_once(
                        system, n, self.drain_size(system, n, variant), extra=extra, label=f"drain{variant}-{n}"
                    ),
                )

    def latency(self, system: System, scenario: str = "latency", extra: list[str] | None = None) -> None:
        c = self.config

        def run() -> dict[str, Any]:
            driver(system, "fill", "--count", "0")
            path = Path(tempfile.mkdtemp(prefix="bench-latency-")) / "started.txt"
            proc = spawn(
                system,
                system.worker(False, list(extra or [])),
                f"{system.key}-{scenario}",
                BENCH_LATENCY_FILE=str(path),
            )
            try:
                time.sleep(c.worker_boot)
                if proc.poll() is not None:
                    raise Failed(f"the idle worker exited with {proc.returncode}")
                gap_min, gap_max = (str(ms / 1000) for ms in c.latency_gap_ms)
                value = driver(
                    system,
                    "latency",
                    "--count",
                    str(c.latency_jobs),
                    "--path",
                    str(path),
                    "--gap-min",
                    gap_min,
                    "--gap-max",
                    gap_max,
                    BENCH_LATENCY_FILE=str(path),
                )
            finally:
                stop(proc)
            if value["started"] < value["jobs"]:
                raise Failed(f"only {value['started']} of {value['jobs']} latency jobs started within 30 s")
            return value

        self.attempt(system, scenario, run)

    # -- the whole run -----------------------------------------------------------------

    def run(self) -> None:
        c = self.config
        selected = set(self.args.only.split(",")) if self.args.only else None

        def wanted(key: str) -> bool:
            return selected is None or key in selected

        dbqueue = dbqueue_system("dbqueue", "django-dbqueue", "postgres", c.sleep)
        systems: list[System] = []
        if wanted("dbqueue"):
            systems.append(dbqueue)
        peers = [procrastinate_system(), tasksdb_system("none"), tasksdb_system("0"), pgqueuer_system()]
        for peer in peers:
            if wanted(peer.key) and not self.args.no_peers:
                if not peer.python.exists():
                    self.note(f"{peer.label}: no environment at {peer.python.parent.parent} (bench/run creates it)")
                    continue
                systems.append(peer)
        others = [
            dbqueue_system("dbqueue_mysql", "django-dbqueue on MariaDB", "mysql", c.sleep),
            dbqueue_system("dbqueue_sqlite", "django-dbqueue on SQLite", "sqlite", c.sleep),
        ]
        for other in others:
            if wanted(other.key) and not self.args.no_other_databases:
                systems.append(other)

        for system in systems:
            print(f"\n== {system.label}", flush=True)
            if system.key == "tasksdb_conn0":
                # The same database as django-tasks-db; only its drains differ.
                self.drains(system, (1, max(c.workers)))
                continue
            if self.attempt(system, "setup", lambda s=system: driver(s, "setup")) is None:
                continue
            if system.key in ("dbqueue_mysql", "dbqueue_sqlite"):
                self.enqueue(system)
                self.drains(system, (1,))
                continue
            self.enqueue(system)
            self.drains(system, c.workers)
            self.latency(system)
            if system.key == "dbqueue":
                self.latency(system, "latency_fast_poll", ["--sleep", str(c.latency_fast_sleep)])
                if not self.args.skip_claim:
                    self.attempt(
                        system,
                        "claim",
                        lambda: driver(
                            dbqueue,
                            "claim",
                            "--count",
                            str(c.claim_iterations),
                            "--sizes",
                            ",".join(map(str, c.claim_sizes)),
                            "--delayed",
                            str(c.claim_in_front),
                        ),
                    )
                self.attempt(system, "statements_per_job", lambda: driver(dbqueue, "queries-per-job", "--count", "500"))
                if c.batch > 1:
                    self.attempt(
                        system,
                        f"statements_per_job_batch{c.batch}",
                        lambda: driver(dbqueue, "queries-per-job", "--count", "500", "--batch", str(c.batch)),
                    )
                if not self.args.no_profile:
                    self.attempt(system, "profile", lambda: self.profile(dbqueue))
                    if c.batch > 1:
                        self.attempt(
                            system,
                            f"profile_batch{c.batch}",
                            lambda: self.profile(dbqueue, ["--batch", str(c.batch)], f"batch{c.batch}"),
                        )

        pair = [system for system in systems if system.key in ("dbqueue", "pgqueuer")]
        if len(pair) == 2 and c.alternating_rounds > 0:
            print(
                f"\n== django-dbqueue and pgqueuer alternating: enqueue ({c.alternating_rounds} rounds), "
                f"drains ({c.drain_rounds} rounds)",
                flush=True,
            )
            self.alternating(pair)
        if len(pair) == 2 and c.instructions:
            print("\n== single enqueue, instructions per call (callgrind), django-dbqueue and pgqueuer", flush=True)
            self.instructions(pair)

    def instructions(self, pair: list[System]) -> None:
        """Both sides' CPU instructions of a single enqueue (bench/pg_instructions.py).

        The wall-clock rounds above swing by 10 % and more on this VM; the counts
        of callgrind repeat to a few instructions in a hundred thousand.
        """
        command = [sys.executable, str(ROOT / "bench" / "pg_instructions.py"), "--tree", f"dbqueue={ROOT}"]
        done = subprocess.run(command, capture_output=True, text=True, cwd=ROOT)
        if done.returncode:
            self.note(f"instructions per single enqueue: {(done.stderr or done.stdout).strip()[-500:]}")
            return
        print(done.stdout.rsplit("\n{", 1)[0], flush=True)
        figures = json.loads(done.stdout.strip().splitlines()[-1])["figures"]
        for system in pair:
            if system.key in figures:
                self.record(system, "enqueue_one_instructions", figures[system.key])

    def alternating(self, pair: list[System]) -> None:
        """Enqueue (single, bulk, bulk in calls of each size, handles on) and drains of the pair,
        one after the other, round after round, the first system changing each round.

        The rows above run minutes apart, one system after the other, and this VM's
        speed drifts by 10 % and more within minutes (docs/performance.md): the pair's
        ratios for the goals come from these rounds, run side by side, as the median
        of each system's rounds.
        """
        c = self.config
        scenarios: list[tuple[str, int, Callable[[System], dict[str, Any]]]] = [
            ("enqueue_one", c.alternating_rounds, lambda s: driver(s, "enqueue-one", "--count", str(c.enqueue_one))),
            ("enqueue_bulk", c.alternating_rounds, lambda s: driver(s, "enqueue-bulk", "--count", str(c.enqueue_bulk))),
        ]
        for size in c.bulk_calls:
            jobs = str(max(size, c.bulk_calls_jobs))
            scenarios.append(
                (
                    f"enqueue_bulk_calls_{size}",
                    c.alternating_rounds,
                    lambda s, jobs=jobs, size=size: driver(s, "enqueue-bulk", "--count", jobs, "--calls-of", str(size)),
                )
            )
        for n in c.workers if c.drain_rounds else ():
            scenarios.append(
                (
                    f"drain_{n}",
                    c.drain_rounds,
                    lambda s, n=n: self.drain_once(s, n, self.drain_size(s, n), label=f"alternating-{n}"),
                )
            )
        for scenario, rounds, run in scenarios:
            runs: dict[str, list[float]] = {system.key: [] for system in pair}
            for round_ in range(rounds):
                for system in pair if round_ % 2 == 0 else pair[::-1]:
                    try:
                        value = run(system)
                    except Failed as exc:
                        self.note(f"{system.label}, {scenario} (alternating): {exc}")
                        continue
                    runs[system.key].append(float(value["jobs_per_s"]))
                    print(f"- {system.label}: {scenario} (alternating) ... {summary(value)}", flush=True)
            for system in pair:
                if runs[system.key]:
                    self.record(
                        system,
                        f"{scenario}_alternating",
                        {"jobs_per_s": statistics.median(runs[system.key]), "rounds": runs[system.key]},
                    )

    def profile(self, system: System, extra: list[str] | None = None, name: str = "") -> dict[str, Any]:
        """py-spy (wall clock, idle included) of one queue_work process draining no-op jobs."""
        from bench.profile_summary import summarize

        py_spy = VENVS / "tools" / "bin" / "py-spy"
        if not py_spy.exists():
            raise Failed("py-spy is not installed in bench/.venvs/tools")
        jobs = self.config.profile_jobs
        driver(system, "fill", "--count", str(jobs))
        raw = RESULTS / f"profile-dbqueue{'-' + name if name else ''}.txt"
        argv = [
            str(py_spy),
            "record",
            "--idle",
            "--threads",
            "--nonblocking",
            "-r",
            "250",
            "-f",
            "raw",
            "-o",
            str(raw),
            "--",
            *system.worker(True, list(extra or [])),
        ]
        proc = spawn(system, argv, f"dbqueue-profile{name}")
        proc.wait(self.config.drain_timeout)
        proc.log.close()  # type: ignore[attr-defined]
        if proc.returncode:
            raise Failed(f"py-spy exited with {proc.returncode}; see {LOGS / 'dbqueue-profile.log'}")
        return summarize(raw.read_text(), jobs=jobs, rate=250)


def summary(value: dict[str, Any]) -> str:
    if "jobs_per_s" in value:
        return f"{value['jobs_per_s']:,.0f} jobs/s"
    if "p50_ms" in value:
        return f"{value['p50_ms']:.1f} ms p50, {value['p95_ms']:.1f} ms p95"
    if "waiting_1000" in value or any(k.startswith("waiting_") for k in value):
        return ", ".join(f"{k}={v['claim_mean_ms']:.2f} ms" for k, v in value.items() if isinstance(v, dict))
    if "statements_per_job" in value:
        return f"{value['statements_per_job']:.2f} statements/job"
    if "seconds" in value:
        return f"{value['seconds']:.2f} s"
    if "per_job_ms" in value:
        return f"{value['per_job_ms']:.2f} ms/job wall"
    return "ok"


# -- machine and versions -----------------------------------------------------------------


def machine() -> dict[str, Any]:
    model = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    info: dict[str, Any] = {
        "nproc": NCPU,
        "cpu_model": model,
        "python": platform.python_version(),
        "kernel": platform.release(),
    }
    try:
        info["memory_gib"] = round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)
    except (ValueError, OSError):
        pass
    try:
        import psycopg

        with psycopg.connect("host=127.0.0.1 user=postgres dbname=postgres") as conn:
            info["postgresql"] = conn.execute("SELECT version()").fetchone()[0]  # type: ignore[index]
            for name in ("synchronous_commit", "shared_buffers", "fsync"):
                info[f"pg_{name}"] = conn.execute(f"SHOW {name}").fetchone()[0]  # type: ignore[index]
    except Exception as exc:  # noqa: BLE001 - reported, not fatal
        info["postgresql"] = f"unknown ({exc})"
    try:
        import MySQLdb

        conn = MySQLdb.connect(host="127.0.0.1", user="root", passwd="")
        cursor = conn.cursor()
        cursor.execute("SELECT VERSION()")
        info["mariadb"] = cursor.fetchone()[0]
        conn.close()
    except Exception as exc:  # noqa: BLE001 - reported, not fatal
        info["mariadb"] = f"unknown ({exc})"
    return info


def versions(systems: list[System]) -> dict[str, dict[str, str]]:
    found: dict[str, dict[str, str]] = {}
    code = (
        "import importlib.metadata as m, json, sys\n"
        "out = {'python': sys.version.split()[0]}\n"
        "for name in sys.argv[1:]:\n"
        "    try: out[name] = m.version(name)\n"
        "    except m.PackageNotFoundError: pass\n"
        "print(json.dumps(out))"
    )
    for system in systems:
        if not system.python.exists():
            continue
        proc = subprocess.run(
            [str(system.python), "-c", code, *system.packages], capture_output=True, text=True, check=False
        )
        if proc.returncode == 0:
            found[system.key] = json.loads(proc.stdout)
    return found


def git_state() -> dict[str, Any]:
    def git(*args: str) -> str:
        proc = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=False)
        return proc.stdout

    dirty = [line[3:] for line in git("status", "--porcelain", "--", "django_dbqueue").splitlines() if line]
    return {"commit": git("rev-parse", "--short", "HEAD").strip(), "library_files_changed_since_commit": dirty}


BENCH_DATABASES = ("dbqueue_bench", "procrastinate_bench", "tasksdb_bench", "pgqueuer_bench", "postgres")
OTHER_WORK = ("pytest", "queue_work", "db_worker", "scripts/test", "procrastinate", "pgq ")


def other_load(pg: Any = None) -> dict[str, Any]:
    """What else runs here: test suites and workers we did not start, and busy sessions on other databases."""
    me = os.getpid()
    parents: dict[int, int] = {}
    commands: dict[int, str] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            commands[int(entry.name)] = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        parents[int(entry.name)] = int(stat.rsplit(")", 1)[1].split()[1])

    def ours(pid: int) -> bool:
        for _ in range(64):
            if pid == me:
                return True
            if pid <= 1 or pid not in parents:
                return False
            pid = parents[pid]
        return False

    others = [
        f"process {pid}: {cmd.strip()[:100]}"
        for pid, cmd in commands.items()
        # Server backends are told apart by pg_stat_activity below: their titles name
        # the database (procrastinate_bench), which is no sign of other work.
        if any(word in cmd for word in OTHER_WORK) and not cmd.startswith("postgres:") and not ours(pid)
    ]
    try:
        if pg is not None:
            rows = pg.execute(
                "SELECT datname, count(*) FROM pg_stat_activity WHERE state = 'active' AND pid <> pg_backend_pid() "
                "AND datname IS NOT NULL AND NOT datname = ANY(%s) GROUP BY datname",
                (list(BENCH_DATABASES),),
            ).fetchall()
            others += [f"{count} busy PostgreSQL session(s) on database {name}" for name, count in rows]
    except Exception as exc:  # noqa: BLE001 - a restarted server is itself worth noting
        others.append(f"PostgreSQL check failed: {exc}".strip()[:120])
    return {"others": others, "loadavg": os.getloadavg()}


def pg_watch_connection() -> Any:
    try:
        import psycopg

        return psycopg.connect("host=127.0.0.1 user=postgres dbname=postgres", autocommit=True)
    except Exception:  # noqa: BLE001 - then only processes are watched
        return None


# -- the table ----------------------------------------------------------------------------------

COLUMNS = [
    ("dbqueue", "dbqueue"),
    ("procrastinate", "procrastinate"),
    ("tasksdb", "tasks-db"),
    ("tasksdb_conn0", "tasks-db c0"),
    ("pgqueuer", "pgqueuer"),
    ("dbqueue_mysql", "dbq MariaDB"),
    ("dbqueue_sqlite", "dbq SQLite"),
]
RATIO_PEERS = [("procrastinate", "procrastinate"), ("tasksdb", "tasks-db"), ("pgqueuer", "pgqueuer")]


def table_rows(results: dict[str, dict[str, Any]], config: Config) -> list[dict[str, Any]]:
    """Rows of (scenario, unit, higher-is-better, {system: value})."""

    def get(system: str, scenario: str, key: str) -> float | None:
        value = results.get(system, {}).get(scenario)
        if not isinstance(value, dict) or key not in value:
            return None
        return float(value[key])

    rows: list[dict[str, Any]] = []

    def add(
        label: str,
        unit: str,
        higher: bool,
        scenario: str,
        key: str,
        systems: list[str] | None = None,
        same_as: dict[str, tuple[str, str]] | None = None,
    ) -> None:
        values = {}
        for system, _ in COLUMNS:
            if systems is not None and system not in systems:
                continue
            scen, k = (same_as or {}).get(system, (scenario, key))
            v = get(system, scen, k)
            if v is not None:
                values[system] = v
        if values:
            rows.append({"scenario": label, "unit": unit, "higher_is_better": higher, "values": values})

    add("enqueue one at a time", "jobs/s", True, "enqueue_one", "jobs_per_s")
    add("enqueue bulk", "jobs/s", True, "enqueue_bulk", "jobs_per_s")
    rounds = config.alternating_rounds
    add(f"enqueue one at a time, {rounds} rounds alternating", "jobs/s", True, "enqueue_one_alternating", "jobs_per_s")
    add(f"enqueue bulk, {rounds} rounds alternating", "jobs/s", True, "enqueue_bulk_alternating", "jobs_per_s")
    for size in config.bulk_calls:
        add(
            f"enqueue_many in calls of {size:,} (handles), {rounds} rounds alternating",
            "jobs/s",
            True,
            f"enqueue_bulk_calls_{size}_alternating",
            "jobs_per_s",
        )
    add("enqueue one at a time: CPU instructions per call", "instr.", False, "enqueue_one_instructions", "total")
    add("  of which the database server's", "instr.", False, "enqueue_one_instructions", "server")
    add("  of which the enqueueing process's", "instr.", False, "enqueue_one_instructions", "client")
    add("enqueue bulk, handles=False (count only)", "jobs/s", True, "enqueue_bulk_count", "jobs_per_s")
    add(f"stream of {config.enqueue_stream:,} calls, handles=False", "jobs/s", True, "enqueue_stream", "jobs_per_s")
    add("  its peak memory growth", "MB", False, "enqueue_stream", "rss_growth_mb")
    for n in (1, 2, 4):
        add(f"drain, {n} worker process{'es' if n > 1 else ''}", "jobs/s", True, f"drain_{n}", "jobs_per_s")
    for n in config.workers:
        add(
            f"drain, {n} worker process{'es' if n > 1 else ''}, {config.drain_rounds} rounds alternating",
            "jobs/s",
            True,
            f"drain_{n}_alternating",
            "jobs_per_s",
        )
    for n in (1, 2, 4):
        add(
            f"drain, queue_work --concurrency {n}",
            "jobs/s",
            True,
            f"drain_concurrency_{n}",
            "jobs_per_s",
            systems=["dbqueue"],
        )
    peers = ["procrastinate", "tasksdb", "tasksdb_conn0", "pgqueuer"]
    ours = ["dbqueue", "dbqueue_mysql", "dbqueue_sqlite"]
    for n in (1, 2, 4):
        # The peers' figures repeated from their plain drains, for the ratios.
        add(
            f"drain, {n} worker process{'es' if n > 1 else ''}, queue_work --batch {config.batch}",
            "jobs/s",
            True,
            f"drain_batch{config.batch}_{n}",
            "jobs_per_s",
            systems=[*ours, *peers],
            same_as={peer: (f"drain_{n}", "jobs_per_s") for peer in peers},
        )
    add("drain, 1 worker: worker CPU per job", "ms", False, "drain_1", "worker_cpu_ms_per_job")
    add("drain, 1 worker: machine CPU per job", "ms", False, "drain_1", "machine_cpu_ms_per_job")
    add("drain, 1 worker: transactions per job", "", False, "drain_1", "transactions_per_job")
    add(
        "drain, 1 worker: round trips per job (statements incl. BEGIN/COMMIT)",
        "",
        False,
        "statements_per_job",
        "statements_per_job",
        systems=["dbqueue"],
    )
    add(
        f"drain, --batch {config.batch}: round trips per job",
        "",
        False,
        f"statements_per_job_batch{config.batch}",
        "statements_per_job",
        systems=["dbqueue"],
    )
    add(
        f"drain, 1 worker, --batch {config.batch}: worker CPU per job",
        "ms",
        False,
        f"drain_batch{config.batch}_1",
        "worker_cpu_ms_per_job",
        systems=["dbqueue"],
    )
    add(
        f"drain, 1 worker, --batch {config.batch}: transactions per job",
        "",
        False,
        f"drain_batch{config.batch}_1",
        "transactions_per_job",
        systems=["dbqueue"],
    )
    add("worker start-up (empty queue)", "s", False, "worker_startup", "seconds")
    for p in ("p50", "p95", "p99"):
        add(f"enqueue-to-start latency {p}, idle worker", "ms", False, "latency", f"{p}_ms")
    for p in ("p50", "p95"):
        add(
            f"latency {p}, queue_work --sleep {config.latency_fast_sleep:g}",
            "ms",
            False,
            "latency_fast_poll",
            f"{p}_ms",
            systems=["dbqueue"],
        )
    claim = results.get("dbqueue", {}).get("claim") or {}
    for label, value in claim.items() if isinstance(claim, dict) else ():
        if isinstance(value, dict) and "claim_mean_ms" in value:
            nice = claim_label(label, value)
            rows.append(
                {
                    "scenario": f"claim (reserve_many limit=1), {nice}",
                    "unit": "ms",
                    "higher_is_better": False,
                    "values": {"dbqueue": value["claim_mean_ms"]},
                }
            )
            if value.get("server_execution_ms") is not None:
                rows.append(
                    {
                        "scenario": "  of which the claim statement on the server (EXPLAIN ANALYZE)",
                        "unit": "ms",
                        "higher_is_better": False,
                        "values": {"dbqueue": value["server_execution_ms"]},
                    }
                )
    return rows


def claim_label(label: str, value: dict[str, Any]) -> str:
    """``delayed_in_front_100000`` -> ``100,000 delayed jobs in front of 1,000 waiting``."""
    kind, _, count = label.rpartition("_")
    rows = f"{int(count):,}"
    if kind == "waiting":
        return f"{rows} waiting jobs"
    waiting = f"{int(value.get('waiting', 0)):,} waiting"
    return {
        "delayed_in_front": f"{rows} delayed jobs in front of {waiting}",
        "delayed_higher_priority": f"{rows} delayed jobs of higher priority, {waiting}",
        "reserved_in_front": f"{rows} reserved jobs in front of {waiting}",
    }.get(kind, f"{kind.replace('_', ' ')} {rows}")


def ratio(row: dict[str, Any], peer: str) -> float | None:
    """How many times better django-dbqueue is than ``peer`` (> 1: ahead)."""
    ours, theirs = row["values"].get("dbqueue"), row["values"].get(peer)
    if not ours or not theirs:
        return None
    return ours / theirs if row["higher_is_better"] else theirs / ours


def fmt(value: float | None, unit: str) -> str:
    if value is None:
        return "-"
    if unit == "jobs/s":
        return f"{value:,.0f}"
    if abs(value) >= 100:
        return f"{value:,.0f}"
    if abs(value) >= 10:
        return f"{value:.1f}"
    return f"{value:.2f}"


def render_table(rows: list[dict[str, Any]], markdown: bool = False) -> str:
    present = [(key, name) for key, name in COLUMNS if any(key in row["values"] for row in rows)]
    ratio_cols = [(key, name) for key, name in RATIO_PEERS if any(key in row["values"] for row in rows)]
    header = ["scenario", "unit", *[name for _, name in present], *[f"x {name}" for _, name in ratio_cols]]
    lines = []
    for row in rows:
        cells = [row["scenario"], row["unit"]]
        cells += [fmt(row["values"].get(key), row["unit"]) for key, _ in present]
        for key, _ in ratio_cols:
            r = ratio(row, key)
            cells.append("-" if r is None else f"{r:.2f}")
        lines.append(cells)
    if markdown:
        out = ["| " + " | ".join(header) + " |", "| " + " | ".join(["---"] + ["--:"] * (len(header) - 1)) + " |"]
        out += ["| " + " | ".join(cells) + " |" for cells in lines]
        return "\n".join(out)
    widths = [max(len(str(cells[i])) for cells in [header, *lines]) for i in range(len(header))]
    out = ["  ".join(h.ljust(w) if i == 0 else h.rjust(w) for i, (h, w) in enumerate(zip(header, widths, strict=True)))]
    out.append("  ".join("-" * w for w in widths))
    for cells in lines:
        out.append(
            "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths, strict=True)))
        )
    return "\n".join(out)


def goals(results: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """The goals of issue 7, as measured in this run."""

    def value(system: str, scenario: str, key: str) -> float | None:
        v = results.get(system, {}).get(scenario)
        return float(v[key]) if isinstance(v, dict) and key in v else None

    def best_drain(n: int) -> tuple[float | None, str]:
        """django-dbqueue's best drain with n workers, whichever way it was run."""
        runs = [
            (value("dbqueue", scenario, "jobs_per_s"), how)
            for scenario, how in (
                (f"drain_{n}", f"{n} processes" if n > 1 else "1 process"),
                (f"drain_concurrency_{n}", f"--concurrency {n}"),
                *(
                    (key, f"{n} process{'es' if n > 1 else ''} with --batch {key.split('batch')[1].split('_')[0]}")
                    for key in results.get("dbqueue", {})
                    if key.startswith("drain_batch") and key.endswith(f"_{n}")
                ),
            )
        ]
        measured = [(v, how) for v, how in runs if v]
        return max(measured) if measured else (None, "")

    def alternating(scenario: str) -> str:
        """The pair's alternating rounds of ``scenario`` where the run has them."""
        both = all(f"{scenario}_alternating" in results.get(key, {}) for key in ("dbqueue", "pgqueuer"))
        return f"{scenario}_alternating" if both else scenario

    def ratio_goal(text: str, scenario: str, peer: str, target: float) -> dict[str, Any]:
        how = ""
        if scenario.startswith("drain_"):
            ours, how = best_drain(int(scenario.split("_")[1]))
        else:
            ours = value("dbqueue", scenario, "jobs_per_s")
        theirs = value(peer, scenario, "jobs_per_s")
        measured = ours / theirs if ours and theirs else None
        return {
            "goal": text + (f" (ours: {how})" if how else ""),
            "target": f">= {target}x",
            "measured": measured,
            "met": None if measured is None else measured >= target,
        }

    def ratio_of(text: str, top: float | None, bottom: float | None, target: float, what: str = "") -> dict[str, Any]:
        measured = top / bottom if top and bottom else None
        return {
            "goal": text,
            "target": f">= {target}x{what}",
            "measured": measured,
            "met": None if measured is None else measured >= target,
        }

    def pair_goal(text: str, scenario: str, target: float) -> dict[str, Any]:
        ours, theirs = value("dbqueue", scenario, "jobs_per_s"), value("pgqueuer", scenario, "jobs_per_s")
        return ratio_of(text, ours, theirs, target)

    out = [
        ratio_goal("drain, 4 workers, vs procrastinate", "drain_4", "procrastinate", 5),
        ratio_goal("drain, 4 workers, vs django-tasks-db (persistent connections)", "drain_4", "tasksdb", 5),
        ratio_goal("drain, 4 workers, vs django-tasks-db (CONN_MAX_AGE=0)", "drain_4", "tasksdb_conn0", 5),
        ratio_goal("drain, 4 workers, on par with pgqueuer (>= 0.9x)", "drain_4", "pgqueuer", 0.9),
        ratio_goal("drain, 1 worker, vs procrastinate", "drain_1", "procrastinate", 3),
        ratio_goal("bulk enqueue vs procrastinate", "enqueue_bulk", "procrastinate", 2),
        ratio_goal("bulk enqueue vs pgqueuer (issue 18)", alternating("enqueue_bulk"), "pgqueuer", 1.5),
        ratio_goal("single enqueue vs pgqueuer (issue 18)", alternating("enqueue_one"), "pgqueuer", 1.0),
    ]
    # Issue 32's, from the alternating rounds only (both sides measured side by side).
    called = [k for k in results.get("dbqueue", {}) if k.startswith("enqueue_bulk_calls_")]
    for key in sorted(called, key=lambda k: int(k.split("_")[3])):
        size = int(key.split("_")[3])
        out.append(pair_goal(f"enqueue_many in calls of {size:,}, handles on, vs pgqueuer (issue 32)", key, 1.5))
    for n in (1, 4):
        out.append(
            pair_goal(
                f"drain, {n} worker process{'es' if n > 1 else ''}, vs pgqueuer (issue 32)",
                f"drain_{n}_alternating",
                1.2,
            )
        )
    out.append(
        ratio_of(
            "drain, 4 worker processes never slower than 2 (issue 32)",
            value("dbqueue", "drain_4_alternating", "jobs_per_s"),
            value("dbqueue", "drain_2_alternating", "jobs_per_s"),
            1.0,
        )
    )
    out.append(
        ratio_of(
            "single enqueue vs pgqueuer, CPU instructions per call, both sides (issue 18)",
            value("pgqueuer", "enqueue_one_instructions", "total"),
            value("dbqueue", "enqueue_one_instructions", "total"),
            1.0,
            " fewer",
        )
    )
    for key, limit in (("p50_ms", 5.0), ("p95_ms", 20.0)):
        measured = value("dbqueue", "latency", key)
        out.append(
            {
                "goal": f"enqueue-to-start {key[:3]}, idle worker, default settings",
                "target": f"< {limit:g} ms",
                "measured": measured,
                "met": None if measured is None else measured < limit,
            }
        )
    claim = results.get("dbqueue", {}).get("claim") or {}
    sizes = sorted(int(k.split("_")[1]) for k in claim if k.startswith("waiting_")) if isinstance(claim, dict) else []
    if len(sizes) >= 2:
        small, big = claim[f"waiting_{sizes[0]}"]["claim_mean_ms"], claim[f"waiting_{sizes[-1]}"]["claim_mean_ms"]
        out.append(
            {
                "goal": f"claim at {sizes[-1]:,} waiting within 2x of at {sizes[0]:,}",
                "target": "<= 2x",
                "measured": big / small,
                "met": big / small <= 2,
            }
        )
    return out


def render_goals(items: list[dict[str, Any]]) -> str:
    lines = []
    for item in items:
        measured = item["measured"]
        shown = "-" if measured is None else (f"{measured:.2f}x" if "x" in item["target"] else f"{measured:.1f} ms")
        verdict = {True: "met", False: "NOT met", None: "not measured"}[item["met"]]
        lines.append(f"  {item['goal']}: {shown} (goal {item['target']}): {verdict}")
    return "\n".join(lines)


def print_report(report: dict[str, Any], markdown: bool = False) -> None:
    """Print the machine, the table, the goals, the profile and the problems of one run."""
    info = report["machine"]
    config = Config(**{key: tuple(v) if isinstance(v, list) else v for key, v in report["config"].items()})
    rows = table_rows(report["results"], config)
    under_load = report["load"].get("scenarios_under_load") or []
    print()
    print(
        f"Machine: {info['nproc']} cores ({info['cpu_model']}), {info.get('memory_gib', '?')} GiB; "
        f"{info.get('postgresql', '?').split(' on ')[0]}; MariaDB {info.get('mariadb', '?')}; "
        f"Python {info['python']}"
    )
    print(f"Versions: {json.dumps(report['versions'])}")
    print(
        f"django-dbqueue at {report['git']['commit']}"
        + (
            f" plus uncommitted changes to {', '.join(report['git']['library_files_changed_since_commit'])}"
            if report["git"]["library_files_changed_since_commit"]
            else ""
        )
    )
    if report["load"]["under_load"]:
        print(
            "WARNING: other work (test suites, workers, busy sessions on other databases) ran during these "
            "scenarios; their figures are not reliable: " + ", ".join(under_load or ["(at the start)"])
        )
    print()
    print(render_table(rows, markdown=markdown))
    print(
        "\n'x peer' = how many times better django-dbqueue is than that peer (above 1: ahead); throughput "
        "divided by the peer's, or the peer's latency/cost divided by ours."
    )
    print("tasks-db = django-tasks-db with persistent connections; tasks-db c0 = with Django's default CONN_MAX_AGE=0.")
    print("\nGoals of issue 7:")
    print(render_goals(report["goals"]))
    for name, profile in report["results"].get("dbqueue", {}).items():
        if name.startswith("profile") and isinstance(profile, dict) and "text" in profile:
            how = f"queue_work --batch {name.split('batch')[1]}" if "batch" in name else "queue_work"
            print(f"\nWhere one {how} process spends its time per job (py-spy, wall clock):")
            print(profile["text"])
    if report["problems"]:
        print("\nProblems:")
        for problem in report["problems"]:
            print(f"  - {problem}")


def main() -> None:
    parser = argparse.ArgumentParser(
        prog="bench/run", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="small sizes: a smoke run of a minute or two")
    parser.add_argument(
        "--only",
        default="",
        help="comma-separated systems: dbqueue, procrastinate, tasksdb, "
        "tasksdb_conn0, pgqueuer, dbqueue_mysql, dbqueue_sqlite",
    )
    parser.add_argument("--no-peers", action="store_true", help="django-dbqueue only")
    parser.add_argument("--no-other-databases", action="store_true", help="skip MariaDB and SQLite")
    parser.add_argument("--skip-claim", action="store_true", help="skip the claim-versus-table-size scenario")
    parser.add_argument("--no-profile", action="store_true", help="skip the py-spy profile of one worker")
    parser.add_argument("--output", default=str(RESULTS / "latest.json"), help="where the JSON goes")
    parser.add_argument(
        "--wait-idle",
        type=float,
        default=0.0,
        help="wait up to this many seconds for other work (test suites, workers, busy sessions "
        "on other databases) to finish first",
    )
    parser.add_argument("--show", metavar="JSON", help="print the report of an earlier run (no benchmark)")
    parser.add_argument("--markdown", action="store_true", help="with --show: the table in Markdown")
    args = parser.parse_args()
    if args.show:
        print_report(json.loads(Path(args.show).read_text()), markdown=args.markdown)
        return
    config = Config.from_env(args.quick)

    pg = pg_watch_connection()
    load = other_load(pg)
    waited = 0.0
    while load["others"] and waited < args.wait_idle:
        time.sleep(10)
        waited += 10
        load = other_load(pg)
    if pg is not None:
        pg.close()
    if load["others"]:
        print(
            "WARNING: other work shares this machine; figures taken under load are not comparable:\n  "
            + "\n  ".join(load["others"][:10]),
            flush=True,
        )

    started = time.time()
    bench = Bench(config, args)
    info = machine()
    print(f"machine: {info['nproc']} cores, {info['cpu_model']}, {info.get('postgresql', '')[:40]}", flush=True)
    bench.run()
    bench.watch.stop()
    load_after = other_load()
    load_after["seen_during_run"] = sorted(bench.watch.seen)

    all_systems = [
        dbqueue_system("dbqueue", "", "postgres", config.sleep),
        procrastinate_system(),
        tasksdb_system("none"),
        pgqueuer_system(),
    ]
    rows = table_rows(bench.results, config)
    goal_items = goals(bench.results)
    report = {
        "started_at": datetime.datetime.fromtimestamp(started, datetime.UTC).isoformat(timespec="seconds"),
        "duration_s": round(time.time() - started, 1),
        "quick": args.quick,
        "machine": info,
        "versions": versions(all_systems),
        "git": git_state(),
        "load": {
            "before": load,
            "after": load_after,
            "scenarios_under_load": bench.under_load,
            "under_load": bool(bench.under_load or load["others"]),
        },
        "config": dataclasses.asdict(config),
        "results": bench.results,
        "table": [{**row, "ratios": {peer: ratio(row, peer) for peer, _ in RATIO_PEERS}} for row in rows],
        "goals": goal_items,
        "problems": bench.problems,
    }
    output = Path(args.output)
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(report, indent=2, default=str) + "\n")

    print_report(report)
    print(f"\nJSON: {output}  ({report['duration_s']:.0f} s)")
    sys.exit(0)


if __name__ == "__main__":
    main()
