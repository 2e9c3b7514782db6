"""Settings of the django-dbqueue side of the benchmark.

BENCH_DB chooses the database: postgres (default), mysql or sqlite. The
database is the benchmark's own (``dbqueue_bench``), created and dropped by
``bench/run``; never a test database.
"""

import json
import os
import tempfile
from typing import Any

BENCH_DB = os.environ.get("BENCH_DB", "postgres")
NAME = os.environ.get("BENCH_DBNAME", "dbqueue_bench")
if NAME.startswith("test"):
    raise RuntimeError("the benchmark never uses a database whose name starts with 'test'")

DATABASES: dict[str, dict[str, Any]]
if BENCH_DB == "postgres":
    DATABASES = {
        "default": {
            "ENGINE": "django.db.backends.postgresql",
            "NAME": NAME,
            "USER": os.environ.get("BENCH_PGUSER", "postgres"),
            "HOST": os.environ.get("BENCH_PGHOST", "127.0.0.1"),
            "PORT": os.environ.get("BENCH_PGPORT", "5432"),
            # Django's default, as in a web project: the worker keeps its
            # connection whatever this says.
            "CONN_MAX_AGE": 0,
            # BENCH_PREPARE_THRESHOLD=5 lets psycopg prepare statements run 5 times
            # (Django's default, unset, prepares none: see docs/performance.md).
            "OPTIONS": (
                {"prepare_threshold": int(os.environ["BENCH_PREPARE_THRESHOLD"])}
                if os.environ.get("BENCH_PREPARE_THRESHOLD")
                else {}
            ),
        }
    }
elif BENCH_DB == "mysql":
    DATABASES = {
        "default": {
            "ENGINE": "django.db.backends.mysql",
            "NAME": NAME,
            "USER": os.environ.get("BENCH_MYSQL_USER", "root"),
            "PASSWORD": os.environ.get("BENCH_MYSQL_PASSWORD", ""),
            "HOST": os.environ.get("BENCH_MYSQL_HOST", "127.0.0.1"),
            "PORT": os.environ.get("BENCH_MYSQL_PORT", "3306"),
            "OPTIONS": {"charset": "utf8mb4"},
        }
    }
elif BENCH_DB == "sqlite":
    DATABASES = {
        "default": {
            "ENGINE": "django.db.backends.sqlite3",
            "NAME": os.environ.get("BENCH_SQLITE_PATH") or os.path.join(tempfile.gettempdir(), f"{NAME}.sqlite3"),
            "OPTIONS": {"timeout": 20, "transaction_mode": "IMMEDIATE", "init_command": "PRAGMA journal_mode=WAL;"},
        }
    }
else:
    raise RuntimeError(f"BENCH_DB must be postgres, mysql or sqlite, not {BENCH_DB!r}")

DEBUG = False
SECRET_KEY = "bench-only"
USE_TZ = True
TIME_ZONE = "UTC"
INSTALLED_APPS = ["django_dbqueue", "bench.benchapp"]
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"
DBQUEUE: dict[str, Any] = {}
if os.environ.get("BENCH_RESULTS"):
    # bench/results_cost.py: every job keeps its result.
    DBQUEUE["RESULTS"] = True
if os.environ.get("BENCH_KEEP_FINISHED"):
    # bench/setting_cost.py: the history of finished jobs, kept this many hours.
    DBQUEUE["KEEP_FINISHED"] = float(os.environ["BENCH_KEEP_FINISHED"])
if os.environ.get("BENCH_HISTORY") == "0":
    # bench/observe_cost.py: workers count no runs (DBQUEUE["HISTORY"]).
    DBQUEUE["HISTORY"] = False
if os.environ.get("BENCH_LISTEN") == "0":
    # bench/capacity.py --pgbouncer: workers behind a transaction pooler poll (DBQUEUE["LISTEN"]).
    DBQUEUE["LISTEN"] = False
if os.environ.get("BENCH_PRESSURE"):
    # bench/pressure.py: workers back off the database (DBQUEUE["PRESSURE"], JSON).
    DBQUEUE["PRESSURE"] = json.loads(os.environ["BENCH_PRESSURE"])
