"""Settings of the example project.

SQLite (``example_project/db.sqlite3``, or the file named by ``EXAMPLE_SQLITE_PATH``)
by default; set ``DATABASE_URL`` to use PostgreSQL or MySQL/MariaDB instead, e.g.
``DATABASE_URL=postgres://user:password@localhost:5432/dbqueue_demo``.
"""

import os
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl, unquote, urlsplit

from django.core.exceptions import ImproperlyConfigured

BASE_DIR = Path(__file__).resolve().parent.parent

# For a laptop: DEBUG on and a SECRET_KEY everyone knows, served to localhost only.
# Anywhere else set DJANGO_DEBUG=0, DJANGO_SECRET_KEY (python -c "import secrets;
# print(secrets.token_urlsafe(50))") and DJANGO_ALLOWED_HOSTS; with DEBUG off and the
# key below, the demo app's check demo.E001 stops every command (demo/checks.py).
INSECURE_SECRET_KEY = "django-insecure-example-project-only"
SECRET_KEY = os.environ.get("DJANGO_SECRET_KEY") or INSECURE_SECRET_KEY
DEBUG = os.environ.get("DJANGO_DEBUG", "1") == "1"
ALLOWED_HOSTS = os.environ.get("DJANGO_ALLOWED_HOSTS", "localhost,127.0.0.1,[::1]").split(",")

INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "django_dbqueue",
    "demo",
]

MIDDLEWARE = [
    "django.middleware.security.SecurityMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
]

ROOT_URLCONF = "config.urls"
WSGI_APPLICATION = "config.wsgi.application"

TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [],
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
            ],
        },
    },
]

ENGINES = {
    "postgres": "django.db.backends.postgresql",
    "postgresql": "django.db.backends.postgresql",
    "mysql": "django.db.backends.mysql",
}


def database_from_url(url: str) -> dict[str, Any]:
    """Return a DATABASES entry for ``scheme://user:password@host:port/name?option=value``."""
    parts = urlsplit(url)
    engine = ENGINES.get(parts.scheme)
    if engine is None:
        raise ImproperlyConfigured(
            f"DATABASE_URL has the scheme {parts.scheme!r}; use postgres://, postgresql:// or mysql://"
        )
    name = unquote(parts.path.lstrip("/"))
    if not name:
        raise ImproperlyConfigured("DATABASE_URL names no database: write scheme://user:password@host:port/NAME")
    try:
        port = parts.port
    except ValueError as exc:
        raise ImproperlyConfigured(f"DATABASE_URL has a bad port: {exc}") from None
    config: dict[str, Any] = {
        "ENGINE": engine,
        "NAME": name,
        "USER": unquote(parts.username or ""),
        "PASSWORD": unquote(parts.password or ""),
        # A percent-encoded host is a Unix socket directory: postgres://user@%2Fvar%2Frun%2Fpostgresql/db
        "HOST": unquote(parts.hostname or ""),
        "PORT": str(port or ""),
    }
    options: dict[str, Any] = dict(parse_qsl(parts.query))
    if engine == "django.db.backends.mysql":
        options.setdefault("charset", "utf8mb4")
    if options:
        config["OPTIONS"] = options
    return config


if os.environ.get("DATABASE_URL"):
    DATABASES = {"default": database_from_url(os.environ["DATABASE_URL"])}
else:
    DATABASES = {
        "default": {
            "ENGINE": "django.db.backends.sqlite3",
            # EXAMPLE_SQLITE_PATH lets tests (and you) use another file, e.g. a temporary one.
            "NAME": os.environ.get("EXAMPLE_SQLITE_PATH") or BASE_DIR / "db.sqlite3",
            # Workers and the web process write concurrently: wait for the lock
            # instead of failing, take it at BEGIN, and let readers run during writes.
            "OPTIONS": {
                "timeout": 20,
                "transaction_mode": "IMMEDIATE",
                "init_command": "PRAGMA journal_mode=WAL;",
            },
        }
    }

DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

# The queue's defaults for jobs that set none; see django_dbqueue/conf.py.
DBQUEUE: dict[str, Any] = {
    "TRIES": 3,
    "TIMEOUT": 45,
    # Longer than TIMEOUT, so a job still running is never reclaimed and run twice.
    "RETRY_AFTER": 60,
}
# EXAMPLE_KEEP_FINISHED=168 keeps the finished jobs a week, searchable in the admin (docs/howto/history.md).
if os.environ.get("EXAMPLE_KEEP_FINISHED"):
    DBQUEUE["KEEP_FINISHED"] = float(os.environ["EXAMPLE_KEEP_FINISHED"])

LANGUAGE_CODE = "en-us"
TIME_ZONE = "UTC"
USE_I18N = True
USE_TZ = True

STATIC_URL = "static/"

LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "formatters": {
        "console": {"format": "%(asctime)s %(levelname)-7s %(name)s: %(message)s", "datefmt": "%H:%M:%S"},
    },
    "handlers": {
        "console": {"class": "logging.StreamHandler", "formatter": "console"},
    },
    "loggers": {
        # One line per job: started/stopped worker, outcome, attempt, duration.
        "django_dbqueue": {"handlers": ["console"], "level": "INFO", "propagate": False},
        "demo": {"handlers": ["console"], "level": "INFO", "propagate": False},
    },
}
