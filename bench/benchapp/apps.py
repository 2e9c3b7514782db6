import atexit
import os
import time
from typing import Any

from django.apps import AppConfig

from bench.benchapp import waiting_jobs  # noqa: F401 - registers the jobs of bench/waiting.py


class BenchAppConfig(AppConfig):
    name = "bench.benchapp"
    label = "benchapp"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        if os.environ.get("BENCH_CLAIM_TIMES"):
            time_claims(os.environ["BENCH_CLAIM_TIMES"])


def time_claims(path: str) -> None:
    """Append the duration of every claim this process makes to ``path`` (seconds, one a line), at exit."""
    from django_dbqueue import claims

    times: list[float] = []
    claim = claims.claim

    def timed(*args: Any, **kwargs: Any) -> Any:
        started = time.perf_counter()
        try:
            return claim(*args, **kwargs)
        finally:
            times.append(time.perf_counter() - started)

    def write() -> None:
        with open(path, "a") as out:
            out.write("".join(f"{value!r}\n" for value in times))

    claims.claim = timed
    atexit.register(write)
