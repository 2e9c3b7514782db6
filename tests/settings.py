"""Test settings; the database comes from DBQUEUE_TEST_DB: sqlite (default), postgres or mysql."""

import json
import os
import tempfile
from typing import Any

import django

DB = os.environ.get("DBQUEUE_TEST_DB", "sqlite")
DATABASES: dict[str, dict[str, Any]]

if DB == "postgres":
    DATABASES = {
        "default": {
            "ENGINE": "django.db.backends.postgresql",
            "NAME": os.environ.get("PGDATABASE", "test"),
            "USER": os.environ.get("PGUSER", "postgres"),
            "HOST": os.environ.get("PGHOST", "127.0.0.1"),
            "PORT": os.environ.get("PGPORT", "5432"),
            # A worker cut off from the server gives up a connect after this long
            # (the kernel's default is about two minutes).
            "OPTIONS": {"connect_timeout": int(os.environ.get("DBQUEUE_TEST_CONNECT_TIMEOUT", "10"))},
            "TEST": {"NAME": os.environ.get("DBQUEUE_TEST_NAME", "test_dbqueue")},
        }
    }
elif DB == "mysql":
    DATABASES = {
        "default": {
            "ENGINE": "django.db.backends.mysql",
            "NAME": "test",
            "USER": os.environ.get("MYSQL_USER", "root"),
            "PASSWORD": os.environ.get("MYSQL_PASSWORD", ""),
            "HOST": os.environ.get("MYSQL_HOST", "127.0.0.1"),
            "PORT": os.environ.get("MYSQL_PORT", "3306"),
            "OPTIONS": {
                "charset": "utf8mb4",
                "connect_timeout": int(os.environ.get("DBQUEUE_TEST_CONNECT_TIMEOUT", "10")),
            },
            "TEST": {"NAME": os.environ.get("DBQUEUE_TEST_NAME", "test_dbqueue"), "CHARSET": "utf8mb4"},
        }
    }
elif DB == "sqlite":
    # A file, not :memory:, so worker processes started by the tests see the same rows.
    _path = os.environ.get("DBQUEUE_SQLITE_PATH") or os.path.join(tempfile.gettempdir(), "dbqueue-tests.sqlite3")
    DATABASES = {
        "default": {
            "ENGINE": "django.db.backends.sqlite3",
            "NAME": _path,
            "OPTIONS": {"timeout": 30, "transaction_mode": "IMMEDIATE", "init_command": "PRAGMA journal_mode=WAL;"},
            "TEST": {"NAME": _path + ".test"},
        }
    }
else:
    raise RuntimeError(f"DBQUEUE_TEST_DB must be sqlite, postgres or mysql, not {DB!r}")

# A read replica for the router tests: the same database under a second alias, as a
# project with a primary and a replica declares it (tests/routers.py sends reads to it).
DATABASES["replica"] = {**DATABASES["default"], "TEST": {**DATABASES["default"]["TEST"], "MIRROR": "default"}}

if DB == "postgres" and os.environ.get("DBQUEUE_TEST_DIRECT_PORT"):
    # Workers behind PgBouncer: a second alias that reaches PostgreSQL directly, for LISTEN.
    DATABASES["direct"] = {**DATABASES["default"], "PORT": os.environ["DBQUEUE_TEST_DIRECT_PORT"]}

if DB == "postgres" and os.environ.get("DBQUEUE_TEST_POOL"):
    # Django's connection pool (psycopg_pool), at most this many connections per process.
    DATABASES["default"]["OPTIONS"]["pool"] = {"min_size": 2, "max_size": int(os.environ["DBQUEUE_TEST_POOL"])}

if os.environ.get("DBQUEUE_TEST_CONN_MAX_AGE"):
    # Persistent connections ("none": for ever), as behind PgBouncer.
    _age = os.environ["DBQUEUE_TEST_CONN_MAX_AGE"]
    DATABASES["default"]["CONN_MAX_AGE"] = None if _age == "none" else int(_age)

if os.environ.get("DBQUEUE_TEST_USE_TEST_DB"):
    # Set for worker processes started by the tests: use the test database
    # that pytest-django created, not the development one.
    for _database in DATABASES.values():
        _database["NAME"] = _database["TEST"]["NAME"]

SECRET_KEY = "tests-only"
ALLOWED_HOSTS = ["localhost", "127.0.0.1", "testserver"]
USE_TZ = True
TIME_ZONE = "Europe/Paris"
INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "django_dbqueue",
    "tests.testapp",
]
MIDDLEWARE = [
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
]
ROOT_URLCONF = "tests.urls"
STATIC_URL = "static/"
TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
            ]
        },
    }
]
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"
DBQUEUE = {
    "SLEEP": 0.05,
    "RETRY_AFTER": 60,
    "TIMEOUT": 30,
    "TIMEOUT_GRACE": float(os.environ.get("DBQUEUE_TEST_TIMEOUT_GRACE", "5")),
    "NETWORK_TIMEOUT": float(os.environ.get("DBQUEUE_TEST_NETWORK_TIMEOUT", "30")),
    "LISTEN": os.environ.get("DBQUEUE_TEST_LISTEN", "1") == "1",
    "LISTEN_DATABASE": "direct" if "direct" in DATABASES else None,
    # Worker processes of the workers-table tests beat faster (DBQUEUE["WORKER_BEAT"]).
    "WORKER_BEAT": float(os.environ.get("DBQUEUE_TEST_WORKER_BEAT", "10")),
}
if os.environ.get("DBQUEUE_TEST_KEEP_FINISHED"):
    # Worker processes of the history tests keep finished jobs (DBQUEUE["KEEP_FINISHED"], hours).
    DBQUEUE["KEEP_FINISHED"] = float(os.environ["DBQUEUE_TEST_KEEP_FINISHED"])
if os.environ.get("DBQUEUE_TEST_RATE_LIMITS"):
    # Worker processes of the rate limit tests: DBQUEUE["RATE_LIMITS"], as JSON.
    DBQUEUE["RATE_LIMITS"] = json.loads(os.environ["DBQUEUE_TEST_RATE_LIMITS"])

if django.VERSION >= (6, 0):
    TASKS = {
        "default": {
            "BACKEND": "django_dbqueue.tasks.DatabaseBackend",
            "QUEUES": ["default", "high", "low"],
            "OPTIONS": {"TRIES": 2},
        }
    }
