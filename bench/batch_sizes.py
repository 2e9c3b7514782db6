"""Drains of django-dbqueue and pgqueuer at the same claim sizes, in alternating rounds.

    bench/run --help >/dev/null        # once: builds bench/.venvs/pgqueuer
    .venv/bin/python -m bench.batch_sizes [--jobs 20000] [--rounds 4] [--workers 1,4] [--sizes 10,50]

Each round fills the queue with no-op jobs, starts the workers and times them until the queue
is empty (start-up included, as bench/run's drains): ``queue_work --batch N`` against pgqueuer's
``QueueManager.run(batch_size=N)``, one after the other, the order turning each round. Both
systems' defaults differ (django-dbqueue 50, pgqueuer 10): this puts each claim size side by
side, so that the ratio at the defaults can be read apart from the ratio at equal sizes
(docs/performance.md). PostgreSQL only; the databases are bench/run's (dbqueue_bench,
pgqueuer_bench), created here if missing.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OURS = ROOT / ".venv" / "bin" / "python"
PGQUEUER = ROOT / "bench" / ".venvs" / "pgqueuer" / "bin" / "python"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--jobs", type=int, default=20_000)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--workers", default="1,4", help="worker processes, comma-separated")
    parser.add_argument("--sizes", default="10,50", help="claim sizes, comma-separated")
    args = parser.parse_args()
    if not PGQUEUER.exists():
        sys.exit(f"no pgqueuer environment at {PGQUEUER.parent.parent}: run bench/run once first")
    env = dict(os.environ, PYTHONPATH=str(ROOT), DJANGO_SETTINGS_MODULE="bench.settings", BENCH_DB="postgres")
    quiet = {"cwd": ROOT, "env": env, "check": True, "capture_output": True}
    subprocess.run([OURS, "-m", "compileall", "-q", "-x", r"/\.venvs/", "django_dbqueue", "bench"], **quiet)
    subprocess.run([OURS, "-m", "bench.drivers.dbqueue", "setup"], **quiet)
    subprocess.run([PGQUEUER, "-m", "bench.drivers.peer_pgqueuer", "setup"], **quiet)
    for workers in [int(n) for n in args.workers.split(",")]:
        for size in [int(n) for n in args.sizes.split(",")]:
            sides = {
                f"django-dbqueue --batch {size}": (
                    [OURS, "-m", "bench.drivers.dbqueue"],
                    [OURS, "-m", "django", "queue_work", "--stop-when-empty", "--sleep", "0.01", "--batch", str(size)],
                    env,
                ),
                f"pgqueuer batch_size={size}": (
                    [PGQUEUER, "-m", "bench.drivers.peer_pgqueuer"],
                    [PGQUEUER, "-m", "bench.drivers.peer_pgqueuer", "worker"],
                    dict(env, BENCH_PGQUEUER_BATCH=str(size)),
                ),
            }
            rates: dict[str, list[float]] = {name: [] for name in sides}
            for round_ in range(args.rounds):
                for name in list(sides) if round_ % 2 == 0 else list(sides)[::-1]:
                    driver, worker, side_env = sides[name]
                    fill = [*driver, "fill", "--count", str(args.jobs)]
                    subprocess.run(fill, cwd=ROOT, env=side_env, check=True, capture_output=True)
                    started = time.perf_counter()
                    silent = {"stdout": subprocess.DEVNULL, "stderr": subprocess.DEVNULL}
                    procs = [subprocess.Popen(worker, cwd=ROOT, env=side_env, **silent) for _ in range(workers)]
                    if any(proc.wait() for proc in procs):
                        sys.exit(f"{name}: a worker failed")
                    rates[name].append(args.jobs / (time.perf_counter() - started))
            ours, theirs = (statistics.median(rates[name]) for name in sides)
            print(
                f"{workers} worker process{'es' if workers > 1 else ''}, claims of {size}: django-dbqueue {ours:,.0f}, "
                f"pgqueuer {theirs:,.0f} jobs/s (medians of {args.rounds}): {ours / theirs:.2f}x",
                flush=True,
            )


if __name__ == "__main__":
    main()
