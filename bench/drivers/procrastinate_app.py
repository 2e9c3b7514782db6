"""The procrastinate app and tasks of the benchmark (not in __main__, as procrastinate asks)."""

from __future__ import annotations

import os
import time

import procrastinate

from bench.drivers.common import conninfo

DBNAME = os.environ.get("BENCH_PROCRASTINATE_DB", "procrastinate_bench")

app = procrastinate.App(connector=procrastinate.PsycopgConnector(conninfo=conninfo(DBNAME)))


@app.task(name="noop")
def noop(i: int) -> None:
    """Does nothing."""


@app.task(name="latency")
def record_start(tag: int, enqueued_at: float) -> None:
    started = time.time()
    with open(os.environ["BENCH_LATENCY_FILE"], "a") as out:
        out.write(f"{tag} {enqueued_at!r} {started!r}\n")
