"""Summarise a py-spy ``raw`` profile (``--idle --threads``) of one queue_work process.

Every sample of the main thread inside ``Worker._loop`` is put in the step of the
loop it belongs to (claim, heartbeat, run, record, signals, log line...), and
each step is split by where its time went: in psycopg (the driver, including
the wait for the server's answer), in Django's ORM and database layer, or in
other Python code. ``python -m bench.profile_summary FILE JOBS RATE`` prints it.
"""

from __future__ import annotations

import sys
from collections import Counter, defaultdict
from collections.abc import Callable
from typing import Any

# (step, test on the frames below Worker._loop), first match wins. The tests look
# for names anywhere below the loop, so a renamed or added layer in worker.py
# (say Worker._next_job around the claim) still lands in the right step.
STEPS: list[tuple[str, Callable[[str], bool]]] = [
    (
        "idle wait (--sleep, or a wait for a notification)",
        lambda frame: frame.startswith(("Worker.wait ", "Listener.wait", "Listener.poll")),
    ),
    (
        "claim, with the DELETE of the batch that ran: finish_and_reserve",
        lambda frame: "finish_and_reserve" in frame or "reserve_many" in frame or frame.startswith("Worker.reserve "),
    ),
    ("run the job: execution.execute", lambda frame: frame.startswith(("Worker._execute ", "execute (django_dbqueue"))),
    (
        "record an outcome on its own: _finish_done, _store",
        lambda frame: frame.startswith(("Worker._store ", "Worker._finish_done ")),
    ),
    ("heartbeat: hold and drop", lambda frame: frame.startswith(("Heartbeat.hold ", "Heartbeat.drop "))),
    ("signals (job_started, job_succeeded)", lambda frame: frame.startswith("_send ")),
    ("progress/report after the job", lambda frame: frame.startswith("Worker._report ")),
    ("stop checks (restart marker, limits)", lambda frame: frame.startswith("Worker._stop_reason ")),
    ("log line per job", lambda frame: frame.startswith(("Logger.log ", "Logger._log ", "Logger.info "))),
]


def classify(frames: list[str]) -> tuple[str, list[str]]:
    """The loop step a main-thread stack belongs to, and the frames below the step's own."""
    try:
        start = next(i for i, frame in enumerate(frames) if frame.startswith("Worker._loop "))
    except StopIteration:
        return "outside the loop (start-up, shut-down)", []
    below = frames[start + 1 :]
    for step, test in STEPS:
        for i, frame in enumerate(below):
            if test(frame):
                return step, below[i + 1 :]
    if not below:
        return "loop: own code", []
    if below[0].startswith("Worker.process ") and len(below) == 1:
        return "process: own code", []
    rest = below[1:] if below[0].startswith("Worker.process ") else below
    return f"other: {short(rest[0])}", rest[1:]


def boundary(below: list[str]) -> str:
    """Where the step leaves django-dbqueue's code: ``our function -> the library call it makes``."""
    ours = ""
    for frame in below:
        if "django_dbqueue/" in frame or "contextlib.py" in frame:
            if "django_dbqueue/" in frame:
                ours = short(frame)
            continue
        return f"{ours} -> {short(frame)}" if ours else short(frame)
    return ours or "(its own code)"


def short(frame: str) -> str:
    """``Class.method (path/file.py:12)`` -> ``Class.method (file.py)``."""
    name, _, where = frame.partition(" (")
    return f"{name} ({where.split(':')[0].rsplit('/', 1)[-1]})" if where else name


def layer(frames: list[str]) -> str:
    if any("psycopg/" in frame or "psycopg_binary" in frame for frame in frames):
        return "psycopg"
    if any("django/db/" in frame for frame in frames):
        return "orm"
    return "python"


def summarize(raw: str, *, jobs: int, rate: float) -> dict[str, Any]:
    per_step: dict[str, Counter[str]] = defaultdict(Counter)
    children: dict[str, Counter[str]] = defaultdict(Counter)
    inclusive: Counter[str] = Counter()
    other_threads = 0
    total_main = 0
    for line in raw.splitlines():
        stack, _, count_text = line.rpartition(" ")
        if not stack or not count_text.isdigit():
            continue
        count = int(count_text)
        frames = stack.split(";")
        if not frames[0].endswith("MainThread"):
            other_threads += count
            continue
        frames = frames[1:]
        total_main += count
        step, below = classify(frames)
        per_step[step][layer(frames)] += count
        children[step][boundary(below)] += count
        for name in {
            frame.split(" (")[0] + " (" + frame.split(" (")[-1].split(":")[0] + ")"
            for frame in frames
            if "django/db/" in frame or "psycopg/" in frame
        }:
            inclusive[name] += count

    def ms(samples: float) -> float:
        return samples / rate * 1000 / jobs

    loop_samples = sum(sum(c.values()) for step, c in per_step.items() if not step.startswith("outside"))
    steps = []
    for step, counter in sorted(per_step.items(), key=lambda item: -sum(item[1].values())):
        samples = sum(counter.values())
        steps.append(
            {
                "step": step,
                "ms_per_job": ms(samples) if not step.startswith("outside") else None,
                "seconds": samples / rate,
                "share_of_loop": samples / loop_samples if loop_samples and not step.startswith("outside") else None,
                "psycopg_ms_per_job": ms(counter["psycopg"]),
                "orm_ms_per_job": ms(counter["orm"]),
                "python_ms_per_job": ms(counter["python"]),
                "in": [{"function": name, "ms_per_job": ms(n)} for name, n in children[step].most_common(6)],
            }
        )
    top = [{"function": name, "ms_per_job": ms(samples)} for name, samples in inclusive.most_common(25)]
    result = {
        "jobs": jobs,
        "sample_rate": rate,
        "loop_ms_per_job": ms(loop_samples),
        "steps": steps,
        "top_functions": top,
        "other_thread_samples": other_threads,
    }
    result["text"] = render(result)
    return result


def render(result: dict[str, Any]) -> str:
    lines = [
        f"  {result['loop_ms_per_job']:.2f} ms of wall clock per job in the worker loop "
        f"({result['jobs']} no-op jobs); per step, ms per job (in psycopg incl. waiting for the server / "
        "in Django's ORM / other Python):"
    ]
    for step in result["steps"]:
        if step["ms_per_job"] is None:
            lines.append(f"    {step['step']}: {step['seconds']:.2f} s in all")
            continue
        lines.append(
            f"    {step['ms_per_job']:6.3f}  {step['share_of_loop']:5.1%}  {step['step']}  "
            f"({step['psycopg_ms_per_job']:.3f} / {step['orm_ms_per_job']:.3f} / "
            f"{step['python_ms_per_job']:.3f})"
        )
        if step["share_of_loop"] >= 0.03:
            lines.extend(
                f"             {item['ms_per_job']:6.3f} in {item['function']}"
                for item in step["in"]
                if item["ms_per_job"] >= 0.02
            )
    lines.append("  Heaviest Django database layer and psycopg functions (inclusive ms per job):")
    for item in result["top_functions"][:15]:
        lines.append(f"    {item['ms_per_job']:6.3f}  {item['function']}")
    return "\n".join(lines)


if __name__ == "__main__":
    with open(sys.argv[1]) as raw_file:
        print(summarize(raw_file.read(), jobs=int(sys.argv[2]), rate=float(sys.argv[3]))["text"])
