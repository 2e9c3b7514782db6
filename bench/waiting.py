"""The benchmark of jobs that wait (issue 17): ``bench/waiting`` starts it in the project's environment.

Every job waits 50 ms, by ``time.sleep``, ``await asyncio.sleep`` or an HTTP GET to a local
server that this script starts (it answers after the same 50 ms), then appends its index and
``time.time()`` to a file. For each scenario all the jobs are enqueued first, then the worker is
started and timed:

- **from start**: jobs / (last job's finish - the worker's start), the worker's start-up included;
- **steady**: from the first finished jobs to the last: (jobs - W) / (last finish - W-th finish),
  W = the jobs in flight (the first wave, which ends together); the plain (jobs - 1) / (last
  finish - first finish) is in the JSON too (``first_to_last_jobs_per_s``);
- **ideal**: in flight / 0.05 s, and steady as a share of it;
- **memory**: RSS and PSS summed over the worker's process tree (``/proc/PID/smaps_rollup`` of
  each process, sampled 4 times a second during the run; the largest sum).

A scenario needing a ``queue_work`` option that this checkout does not have yet (``--threads``,
``--async-concurrency``) is shown as "not available". Each figure is the median of ``--repeat``
runs, the scenarios taken in turn (all of them once, then again). See docs/performance.md,
"Jobs that wait".

    python -m bench.waiting [--quick] [--jobs N] [--repeat N] [--only KEY,...]
    python -m bench.waiting serve        the local HTTP server alone (prints its port)
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import datetime
import json
import os
import re
import resource
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from bench.main import LoadWatch, git_state, machine, machine_busy_seconds, pg_no_other_backends, stop

ROOT = Path(__file__).resolve().parent.parent
VENVS = ROOT / "bench" / ".venvs"
RESULTS = ROOT / "bench" / "results"
LOGS = RESULTS / "logs"
RESULT_PREFIX = "BENCH_RESULT "
DBQUEUE_DB = "dbqueue_waiting_bench"
PROCRASTINATE_DB = "procrastinate_waiting_bench"
OUR_DATABASES = (DBQUEUE_DB, PROCRASTINATE_DB)


class Failed(Exception):
    pass


# -- systems and scenarios -----------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class System:
    key: str
    label: str
    python: Path
    driver: str
    env: dict[str, str]
    packages: tuple[str, ...]
    pg_database: str | None = None


def systems() -> dict[str, System]:
    project = ROOT / ".venv" / "bin" / "python"
    return {
        "dbqueue": System(
            "dbqueue",
            "django-dbqueue",
            project,
            "bench.drivers.waiting_dbqueue",
            {"DJANGO_SETTINGS_MODULE": "bench.settings", "BENCH_DB": "postgres", "BENCH_DBNAME": DBQUEUE_DB},
            ("django-dbqueue", "Django", "psycopg"),
            DBQUEUE_DB,
        ),
        "celery": System(
            "celery",
            "Celery",
            VENVS / "celery" / "bin" / "python",
            "bench.drivers.waiting_celery",
            {},
            ("celery", "kombu", "redis"),
        ),
        "procrastinate": System(
            "procrastinate",
            "procrastinate",
            VENVS / "procrastinate" / "bin" / "python",
            "bench.drivers.waiting_procrastinate",
            {"BENCH_PROCRASTINATE_WAITING_DB": PROCRASTINATE_DB},
            ("procrastinate", "psycopg"),
            PROCRASTINATE_DB,
        ),
    }


@dataclasses.dataclass(frozen=True)
class Scenario:
    key: str
    label: str
    system: str
    kind: str  # sync | async | http_sync | http_async: the job (bench/benchapp/waiting_jobs.py and the drivers)
    in_flight: int  # jobs that can wait at once: the ideal rate is in_flight / wait
    options: tuple[str, ...] = ()  # django-dbqueue: queue_work options; peers: worker options
    needs: str = ""  # a queue_work option this scenario needs

    @property
    def http(self) -> bool:
        return self.kind.startswith("http")


SCENARIOS = [
    Scenario("dbq_threads32", "django-dbqueue --threads 32", "dbqueue", "sync", 32, ("--threads", "32"), "--threads"),
    Scenario("dbq_concurrency4", "django-dbqueue --concurrency 4", "dbqueue", "sync", 4, ("--concurrency", "4")),
    Scenario("dbq_concurrency8", "django-dbqueue --concurrency 8", "dbqueue", "sync", 8, ("--concurrency", "8")),
    Scenario(
        "dbq_async32",
        "django-dbqueue --async-concurrency 32",
        "dbqueue",
        "async",
        32,
        ("--async-concurrency", "32"),
        "--async-concurrency",
    ),
    Scenario(
        "dbq_async256",
        "django-dbqueue --async-concurrency 256",
        "dbqueue",
        "async",
        256,
        ("--async-concurrency", "256"),
        "--async-concurrency",
    ),
    Scenario("celery_threads32", "Celery --pool threads --concurrency 32", "celery", "sync", 32),
    Scenario("procrastinate_async32", "procrastinate concurrency=32, async", "procrastinate", "async", 32),
    Scenario("procrastinate_sync32", "procrastinate concurrency=32, sync", "procrastinate", "sync", 32),
    Scenario(
        "dbq_threads32_http",
        "HTTP: django-dbqueue --threads 32",
        "dbqueue",
        "http_sync",
        32,
        ("--threads", "32"),
        "--threads",
    ),
    Scenario(
        "dbq_async32_http",
        "HTTP: django-dbqueue --async-concurrency 32",
        "dbqueue",
        "http_async",
        32,
        ("--async-concurrency", "32"),
        "--async-concurrency",
    ),
    Scenario("celery_threads32_http", "HTTP: Celery --pool threads --concurrency 32", "celery", "http_sync", 32),
    Scenario(
        "procrastinate_async32_http", "HTTP: procrastinate concurrency=32, async", "procrastinate", "http_async", 32
    ),
]


def worker_argv(system: System, scenario: Scenario) -> list[str]:
    if system.key == "dbqueue":
        # As bench/run's drains: stop when the queue is empty.
        return [
            str(system.python),
            "-m",
            "django",
            "queue_work",
            "--stop-when-empty",
            "--sleep",
            "0.01",
            *scenario.options,
        ]
    if system.key == "celery":
        # Celery's worker does not stop by itself: it is sent SIGTERM (warm shutdown) once every job finished.
        # Mingle, gossip and heartbeats are for clusters of workers; off, as commonly advised for one.
        return [
            str(system.python),
            "-m",
            "celery",
            "-A",
            "bench.drivers.waiting_celery",
            "worker",
            "--pool",
            "threads",
            "--concurrency",
            str(scenario.in_flight),
            "--without-mingle",
            "--without-gossip",
            "--without-heartbeat",
            "--loglevel",
            "WARNING",
            *scenario.options,
        ]
    return [str(system.python), "-m", system.driver, "worker", "--concurrency", str(scenario.in_flight)]


# -- running things ------------------------------------------------------------------------------


def child_env(system: System, **extra: str) -> dict[str, str]:
    env = {**os.environ, **system.env, **extra}
    env["PYTHONPATH"] = str(ROOT)
    env.pop("VIRTUAL_ENV", None)
    return env


def driver(system: System, command: str, *args: str, timeout: float = 600) -> dict[str, Any]:
    argv = [str(system.python), "-m", system.driver, command, *args]
    proc = subprocess.run(
        argv, cwd=ROOT, env=child_env(system), capture_output=True, text=True, timeout=timeout, check=False
    )
    if proc.returncode != 0:
        tail = "\n".join((proc.stderr or proc.stdout).strip().splitlines()[-6:])
        raise Failed(f"{system.label}: `{command}` exited {proc.returncode}: {tail}")
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith(RESULT_PREFIX):
            return dict(json.loads(line[len(RESULT_PREFIX) :]))
    raise Failed(f"{system.label}: `{command}` printed no result")


def spawn(argv: list[str], env: dict[str, str], log_name: str) -> subprocess.Popen[bytes]:
    LOGS.mkdir(parents=True, exist_ok=True)
    log = open(LOGS / f"waiting-{log_name}.log", "ab")
    # Its own session, so it never gets this terminal's signals.
    proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    proc.log = log  # type: ignore[attr-defined]
    return proc


def queue_work_options() -> str:
    """``queue_work --help`` with the bench's settings: which options this checkout has."""
    system = systems()["dbqueue"]
    proc = subprocess.run(
        [str(system.python), "-m", "django", "queue_work", "--help"],
        cwd=ROOT,
        env=child_env(system),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    return proc.stdout if proc.returncode == 0 else ""


def has_option(help_text: str, option: str) -> bool:
    return re.search(rf"(^|[\s\[,]){re.escape(option)}\b", help_text) is not None


# -- memory of a process tree -------------------------------------------------------------------


def process_tree(root: int) -> list[int]:
    """``root`` and all its descendants (from the parent ids in /proc/*/stat)."""
    children: dict[int, list[int]] = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat") as stat:
                parent = int(stat.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(parent, []).append(int(entry.name))
    tree, todo = [], [root]
    while todo:
        pid = todo.pop()
        tree.append(pid)
        todo.extend(children.get(pid, ()))
    return tree


def rollup(pid: int) -> tuple[int, int] | None:
    """(RSS, PSS) of one process in kB, from /proc/PID/smaps_rollup; None if it is gone."""
    rss = pss = 0
    try:
        with open(f"/proc/{pid}/smaps_rollup") as lines:
            for line in lines:
                if line.startswith("Rss:"):
                    rss = int(line.split()[1])
                elif line.startswith("Pss:"):
                    pss = int(line.split()[1])
    except (OSError, ValueError):
        return None
    return rss, pss


class MemorySampler:
    """Sums RSS and PSS over a process tree 4 times a second; keeps the largest sums."""

    def __init__(self, root: int, interval: float = 0.25) -> None:
        self.root = root
        self.interval = interval
        self.rss_kb = 0
        self.pss_kb = 0
        self.processes = 0
        self.samples = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> MemorySampler:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def sample(self) -> None:
        rss = pss = count = 0
        for pid in process_tree(self.root):
            values = rollup(pid)
            if values:
                rss, pss, count = rss + values[0], pss + values[1], count + 1
        if count:
            self.samples += 1
            self.rss_kb = max(self.rss_kb, rss)
            self.pss_kb = max(self.pss_kb, pss)
            self.processes = max(self.processes, count)

    def _run(self) -> None:
        while True:
            self.sample()
            if self._stop.wait(self.interval):
                return


# -- the local HTTP server ------------------------------------------------------------------------


async def serve(port: int, wait: float) -> None:
    """Answer every request with 200 after ``wait`` seconds, then close (asyncio, one process)."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while (await reader.readline()) not in (b"\r\n", b"\n", b""):
                pass
            await asyncio.sleep(wait)
            writer.write(
                b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: 3\r\nConnection: close\r\n\r\nok\n"
            )
            await writer.drain()
        except OSError:
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", port, backlog=4096)
    print(f"PORT {server.sockets[0].getsockname()[1]}", flush=True)
    async with server:
        await server.serve_forever()


def start_http_server(wait: float) -> tuple[subprocess.Popen[bytes], str]:
    LOGS.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    with open(LOGS / "waiting-http-server.log", "ab") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "bench.waiting", "serve", "--wait", str(wait)],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=log,
            start_new_session=True,
        )
    assert proc.stdout is not None
    line = proc.stdout.readline().decode()
    if not line.startswith("PORT "):
        stop(proc)
        raise Failed(f"the local HTTP server did not start ({line!r})")
    return proc, f"http://127.0.0.1:{int(line.split()[1])}/"


# -- one run ---------------------------------------------------------------------------------------


class Finishes:
    """Reads the finish file as it grows: ``index time`` per line."""

    def __init__(self, path: Path) -> None:
        self.file = open(path)
        self.partial = ""
        self.times: list[float] = []
        self.indexes: set[int] = set()

    def read(self) -> None:
        text = self.partial + self.file.read()
        lines = text.split("\n")
        self.partial = lines.pop()
        for line in lines:
            index, at = line.split()
            self.indexes.add(int(index))
            self.times.append(float(at))

    def close(self) -> None:
        self.file.close()


@dataclasses.dataclass
class Options:
    jobs: int
    repeat: int
    wait: float
    stall: float
    url: str = ""


def run_once(system: System, scenario: Scenario, options: Options, label: str) -> dict[str, Any]:
    jobs = options.jobs
    filled = driver(system, "fill", "--count", str(jobs), "--kind", scenario.kind)["jobs"]
    if filled != jobs:
        raise Failed(f"filled {filled} jobs instead of {jobs}")
    if system.pg_database:
        pg_no_other_backends(system.pg_database)
    folder = Path(tempfile.mkdtemp(prefix="bench-waiting-"))
    path = folder / "finished.txt"
    path.touch()
    finishes = Finishes(path)
    env = child_env(
        system, BENCH_WAIT_FILE=str(path), BENCH_WAIT_SECONDS=repr(options.wait), BENCH_WAIT_URL=options.url
    )
    usage_before = resource.getrusage(resource.RUSAGE_CHILDREN)
    busy_before = machine_busy_seconds()
    started = time.time()
    proc = spawn(worker_argv(system, scenario), env, label)
    sampler = MemorySampler(proc.pid).start()
    exited_early = False
    try:
        last_progress, seen = time.monotonic(), 0
        while True:
            time.sleep(0.05)
            finishes.read()
            if len(finishes.indexes) >= jobs:
                break
            if len(finishes.times) != seen:
                seen, last_progress = len(finishes.times), time.monotonic()
            if proc.poll() is not None:
                finishes.read()
                exited_early = len(finishes.indexes) < jobs
                break
            if time.monotonic() - last_progress > options.stall:
                raise Failed(f"no job finished for {options.stall:.0f} s ({len(finishes.indexes)} of {jobs} done)")
        sampler.stop()
        if system.key == "celery":
            stop(proc)
        else:
            # django-dbqueue and procrastinate stop by themselves on an empty queue.
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                stop(proc, grace=5)
                raise Failed("the worker did not stop within 60 s of the last job") from None
        exited = time.time()
    finally:
        sampler.stop()
        stop(proc, grace=5)
        finishes.read()
        finishes.close()
    usage_after = resource.getrusage(resource.RUSAGE_CHILDREN)
    busy = machine_busy_seconds() - busy_before
    if exited_early:
        raise Failed(f"the worker exited ({proc.returncode}) after {len(finishes.indexes)} of {jobs} jobs")
    left = driver(system, "remaining")["remaining"]
    if left:
        raise Failed(f"{left} of {jobs} jobs were still queued after the run")
    if system.key != "celery" and proc.returncode:
        raise Failed(f"the worker exited with {proc.returncode}")
    times = sorted(finishes.times)
    first, last = times[0], times[-1]
    # The first wave (up to in_flight jobs) ends together: counted from its end, the steady rate
    # is not overstated by in_flight / jobs (6 % with 32 in flight and 500 jobs).
    wave = min(scenario.in_flight, jobs // 2)
    wave_end = times[wave - 1]
    worker_cpu = (usage_after.ru_utime - usage_before.ru_utime) + (usage_after.ru_stime - usage_before.ru_stime)
    for leftover in folder.iterdir():
        leftover.unlink()
    folder.rmdir()
    return {
        "jobs": jobs,
        "jobs_per_s": jobs / (last - started),
        "steady_jobs_per_s": (jobs - wave) / (last - wave_end) if last > wave_end else float("nan"),
        "first_to_last_jobs_per_s": (jobs - 1) / (last - first) if last > first else float("nan"),
        "first_finish_s": first - started,
        "last_finish_s": last - started,
        "exit_s": exited - started,
        "rss_mb": sampler.rss_kb / 1024,
        "pss_mb": sampler.pss_kb / 1024,
        "processes": sampler.processes,
        "memory_samples": sampler.samples,
        "ran_twice": len(finishes.times) - len(finishes.indexes),
        "worker_cpu_ms_per_job": worker_cpu * 1000 / jobs,
        "machine_cpu_ms_per_job": busy * 1000 / jobs,
    }


MEDIAN_FIELDS = (
    "jobs_per_s",
    "steady_jobs_per_s",
    "first_to_last_jobs_per_s",
    "first_finish_s",
    "last_finish_s",
    "exit_s",
    "rss_mb",
    "pss_mb",
    "processes",
    "worker_cpu_ms_per_job",
    "machine_cpu_ms_per_job",
)


def median_of(runs: list[dict[str, Any]]) -> dict[str, Any]:
    good = [run for run in runs if "error" not in run]
    if not good:
        return {}
    value: dict[str, Any] = {field: statistics.median(run[field] for run in good) for field in MEDIAN_FIELDS}
    value["runs"] = len(good)
    value["ran_twice"] = max(run["ran_twice"] for run in good)
    return value


# -- the whole run -----------------------------------------------------------------------------------


def versions(system: System) -> dict[str, str]:
    code = (
        "import importlib.metadata as m, json, sys\n"
        "out = {'python': sys.version.split()[0]}\n"
        "for name in sys.argv[1:]:\n"
        "    try: out[name] = m.version(name)\n"
        "    except m.PackageNotFoundError: pass\n"
        "print(json.dumps(out))"
    )
    proc = subprocess.run(
        [str(system.python), "-c", code, *system.packages], capture_output=True, text=True, check=False
    )
    return dict(json.loads(proc.stdout)) if proc.returncode == 0 else {}


def run(args: argparse.Namespace) -> dict[str, Any]:
    options = Options(jobs=args.jobs, repeat=args.repeat, wait=args.wait, stall=args.stall)
    chosen = [s for s in SCENARIOS if not args.only or s.key in args.only.split(",")]
    if args.only and len(chosen) != len(set(args.only.split(","))):
        known = ", ".join(s.key for s in SCENARIOS)
        raise SystemExit(f"--only: unknown scenario in {args.only!r}; known: {known}")
    all_systems = systems()
    for old_log in LOGS.glob("waiting-*.log"):
        old_log.unlink()
    results: dict[str, dict[str, Any]] = {}
    problems: list[str] = []

    def note(text: str) -> None:
        print(f"  ! {text}", flush=True)
        problems.append(text)

    for scenario in chosen:
        results[scenario.key] = {
            "label": scenario.label,
            "system": scenario.system,
            "kind": scenario.kind,
            "in_flight": scenario.in_flight,
            "ideal_jobs_per_s": scenario.in_flight / options.wait,
            "available": True,
            "runs": [],
        }

    help_text = queue_work_options()
    if not help_text:
        note("`queue_work --help` failed with the bench's settings: every django-dbqueue row is skipped")
    ready: set[str] = set()
    for key in sorted({s.system for s in chosen}):
        system = all_systems[key]
        if not system.python.exists():
            note(f"{system.label}: no environment at {system.python.parent.parent} (bench/waiting creates it)")
            continue
        if key == "dbqueue" and not help_text:
            continue
        print(f"- {system.label}: setup ...", end=" ", flush=True)
        try:
            driver(system, "setup")
        except (Failed, subprocess.TimeoutExpired) as exc:
            print("failed", flush=True)
            note(f"{system.label}: setup: {exc}")
            continue
        print("ok", flush=True)
        ready.add(key)
    for scenario in chosen:
        entry = results[scenario.key]
        if scenario.system not in ready:
            entry.update(available=False, reason=f"{all_systems[scenario.system].label} is not set up")
        elif scenario.needs and not has_option(help_text, scenario.needs):
            entry.update(available=False, reason=f"queue_work has no {scenario.needs} yet")

    server = None
    if any(s.http and results[s.key]["available"] for s in chosen):
        server, options.url = start_http_server(options.wait)
        print(f"- local HTTP server at {options.url} (answers after {options.wait * 1000:.0f} ms)", flush=True)

    watch = LoadWatch(ignore=OUR_DATABASES).start()
    under_load: list[str] = []
    try:
        for round_number in range(1, options.repeat + 1):
            print(f"\n== round {round_number} of {options.repeat}: {options.jobs:,} jobs per scenario", flush=True)
            for scenario in chosen:
                entry = results[scenario.key]
                if not entry["available"]:
                    if round_number == 1:
                        print(f"- {scenario.label}: not available ({entry['reason']})", flush=True)
                    continue
                system = all_systems[scenario.system]
                print(f"- {scenario.label} ...", end=" ", flush=True)
                began = time.monotonic()
                try:
                    value = run_once(system, scenario, options, f"{scenario.key}-{round_number}")
                except (Failed, subprocess.TimeoutExpired, OSError) as exc:
                    print("failed", flush=True)
                    note(f"{scenario.label}, round {round_number}: {exc}")
                    entry["runs"].append({"error": str(exc)})
                    continue
                if watch.during(began, time.monotonic()):
                    value["under_load"] = True
                    under_load.append(f"{scenario.label}, round {round_number}")
                entry["runs"].append(value)
                ideal = entry["ideal_jobs_per_s"]
                print(
                    f"{value['jobs_per_s']:,.0f} jobs/s from start, {value['steady_jobs_per_s']:,.0f} steady "
                    f"({value['steady_jobs_per_s'] / ideal:.0%} of {ideal:,.0f}), "
                    f"RSS {value['rss_mb']:.0f} MB, PSS {value['pss_mb']:.0f} MB"
                    f"{', RAN TWICE: ' + str(value['ran_twice']) if value['ran_twice'] else ''}"
                    f"{' UNDER LOAD' if value.get('under_load') else ''}",
                    flush=True,
                )
    finally:
        watch.stop()
        if server is not None:
            stop(server)
    for entry in results.values():
        entry["median"] = median_of(entry["runs"])
    return {
        "when": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "config": {"jobs": options.jobs, "repeat": options.repeat, "wait_s": options.wait, "quick": args.quick},
        "machine": machine(),
        "versions": {key: versions(all_systems[key]) for key in sorted(ready)},
        "git": git_state(),
        "scenarios": results,
        "problems": problems,
        "load": {"scenarios_under_load": under_load, "seen": sorted(watch.seen)},
    }


# -- the table ------------------------------------------------------------------------------------------

HEADER = (
    "scenario",
    "in flight",
    "procs",
    "jobs/s from start",
    "steady jobs/s",
    "ideal",
    "% of ideal",
    "RSS MB",
    "PSS MB",
)


def rows(report: dict[str, Any]) -> list[tuple[str, ...]]:
    out = []
    for entry in report["scenarios"].values():
        ideal = entry["ideal_jobs_per_s"]
        median = entry.get("median") or {}
        if not entry["available"]:
            cells = ("not available", "", "", "", "", "")
        elif not median:
            cells = ("failed", "", "", "", "", "")
        else:
            cells = (
                f"{median['processes']:.0f}",
                f"{median['jobs_per_s']:,.0f}",
                f"{median['steady_jobs_per_s']:,.0f}",
                f"{ideal:,.0f}",
                f"{median['steady_jobs_per_s'] / ideal:.0%}",
                f"{median['rss_mb']:.0f}",
                f"{median['pss_mb']:.0f}",
            )
            out.append((entry["label"], str(entry["in_flight"]), *cells))
            continue
        out.append((entry["label"], str(entry["in_flight"]), "", cells[0], "", f"{ideal:,.0f}", "", "", ""))
    return out


def print_report(report: dict[str, Any], markdown: bool = False) -> None:
    config = report["config"]
    print(
        f"\nJobs that wait: {config['jobs']:,} jobs of {config['wait_s'] * 1000:.0f} ms each, "
        f"median of {config['repeat']} run(s); {report['when']}, commit {report['git']['commit']}"
        f"{' (library files changed since)' if report['git']['library_files_changed_since_commit'] else ''}"
    )
    table = [HEADER, *rows(report)]
    if markdown:
        print("| " + " | ".join(HEADER) + " |")
        print("| --- | " + " | ".join("--:" for _ in HEADER[1:]) + " |")
        for row in table[1:]:
            print("| " + " | ".join(row) + " |")
    else:
        widths = [max(len(row[i]) for row in table) for i in range(len(HEADER))]
        for n, row in enumerate(table):
            print("  ".join(cell.ljust(widths[i]) if i == 0 else cell.rjust(widths[i]) for i, cell in enumerate(row)))
            if n == 0:
                print("  ".join("-" * width for width in widths))
    print(
        "jobs/s from start: from the worker's start to the last job's finish; steady: from the end of the first "
        "wave of finished jobs (as many as in flight) to the last; % of ideal: steady / (in flight / wait); "
        "memory: the largest sum over the worker's processes."
    )
    for entry in report["scenarios"].values():
        if not entry["available"]:
            print(f"  {entry['label']}: not available: {entry['reason']}")
    for problem in report.get("problems", []):
        print(f"  ! {problem}")
    if report["load"]["scenarios_under_load"]:
        print("Other work ran during: " + "; ".join(report["load"]["scenarios_under_load"]))
        print("  seen: " + "; ".join(report["load"]["seen"][:8]))


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "serve":
        parser = argparse.ArgumentParser(prog="python -m bench.waiting serve")
        parser.add_argument("serve")
        parser.add_argument("--port", type=int, default=0)
        parser.add_argument("--wait", type=float, default=0.05)
        served = parser.parse_args()
        asyncio.run(serve(served.port, served.wait))
        return
    parser = argparse.ArgumentParser(
        prog="bench/waiting", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="500 jobs, one run: a smoke run")
    parser.add_argument("--jobs", type=int, help="jobs per scenario (default 10,000; 500 with --quick)")
    parser.add_argument("--repeat", type=int, help="runs of each scenario, the median is shown (2; 1 with --quick)")
    parser.add_argument("--wait", type=float, default=0.05, help="seconds each job waits (0.05)")
    parser.add_argument(
        "--only", default="", help="comma-separated scenario keys: " + ", ".join(s.key for s in SCENARIOS)
    )
    parser.add_argument("--stall", type=float, default=60.0, help="a run fails after this long without a finished job")
    parser.add_argument("--output", default=str(RESULTS / "waiting-latest.json"), help="where the JSON goes")
    parser.add_argument("--show", metavar="JSON", help="print the table of an earlier run (no benchmark)")
    parser.add_argument("--markdown", action="store_true", help="the table in Markdown")
    args = parser.parse_args()
    if args.show:
        print_report(json.loads(Path(args.show).read_text()), markdown=args.markdown)
        return
    if args.jobs is None:
        args.jobs = 500 if args.quick else 10_000
    if args.repeat is None:
        args.repeat = 1 if args.quick else 2
    report = run(args)
    output = Path(args.output)
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(report, indent=2) + "\n")
    print_report(report, markdown=args.markdown)
    print(f"\nJSON: {output}")


if __name__ == "__main__":
    main()
