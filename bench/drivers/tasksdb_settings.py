"""Settings of the django-tasks-db side of the benchmark (its own database, tasksdb_bench).

BENCH_TASKSDB_CONN_MAX_AGE: Django's default 0 (a new connection per task in
db_worker) or a number of seconds; "none" keeps connections forever.
"""

import os

_age = os.environ.get("BENCH_TASKSDB_CONN_MAX_AGE", "none")

DATABASES = {
    "default": {
        "ENGINE": "django.db.backends.postgresql",
        "NAME": os.environ.get("BENCH_TASKSDB_DB", "tasksdb_bench"),
        "USER": os.environ.get("BENCH_PGUSER", "postgres"),
        "HOST": os.environ.get("BENCH_PGHOST", "127.0.0.1"),
        "PORT": os.environ.get("BENCH_PGPORT", "5432"),
        "CONN_MAX_AGE": None if _age == "none" else int(_age),
    }
}
DEBUG = False
SECRET_KEY = "bench-only"
USE_TZ = True
TIME_ZONE = "UTC"
INSTALLED_APPS = ["django_tasks_db"]
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"
TASKS = {"default": {"BACKEND": "django_tasks_db.DatabaseBackend"}}
