"""Whether the queue's database holds the app's tables and its latest migration.

A worker started before ``migrate`` would otherwise retry ``no such table`` for ever: ``queue_work``
refuses to start, ``queue_health`` is unhealthy and ``check --database default`` (and ``migrate``'s
own checks) warn (``dbqueue.W009``), each saying what to run. Read from Django's migration
history and the database's catalogue; a database that cannot be read tells nothing here (the
worker rides out an outage, the health probe reports it).
"""

from __future__ import annotations

from typing import Any

from django.apps import apps
from django.core.exceptions import ImproperlyConfigured
from django.db import DatabaseError, connections, router
from django.db.migrations.loader import MigrationLoader

APP_LABEL = "django_dbqueue"
MIGRATE = "manage.py migrate django_dbqueue"
# Tables named in a message, at most: the rest are counted.
NAMED_TABLES = 3
# What each driver says of a table or column that is not there: SQLite's text, PostgreSQL's
# SQLSTATE (undefined table, undefined column), MySQL's error numbers (no such table, unknown column).
SQLITE_MISSING = ("no such table", "no such column", "has no column named")
POSTGRESQL_MISSING = frozenset({"42P01", "42703"})
MYSQL_MISSING = frozenset({1146, 1054})


class NotMigrated(ImproperlyConfigured):
    """The queue's database lacks the app's tables or its latest migration: run ``MIGRATE``."""


def names_missing_schema(exc: DatabaseError) -> bool:
    """Tell whether ``exc`` says that a table or a column is not there (the app is not migrated)."""
    cause = exc.__cause__ if exc.__cause__ is not None else exc
    sqlstate = getattr(cause, "sqlstate", None) or getattr(cause, "pgcode", None)
    if sqlstate is not None:
        return sqlstate in POSTGRESQL_MISSING
    args: tuple[Any, ...] = getattr(cause, "args", ())
    if args and isinstance(args[0], int):
        return args[0] in MYSQL_MISSING
    return bool(args) and isinstance(args[0], str) and args[0].startswith(SQLITE_MISSING)


def tables() -> set[str]:
    """The tables the app's migrations create."""
    models = apps.get_app_config(APP_LABEL).get_models()
    return {model._meta.db_table for model in models if model._meta.managed and not model._meta.proxy}


def missing_tables(using: str) -> list[str]:
    """The app's tables that database ``using`` lacks, sorted (one query of its catalogue)."""
    connection = connections[using]
    with connection.cursor() as cursor:
        present = {name.lower() for name in connection.introspection.table_names(cursor)}
    return sorted(table for table in tables() if table.lower() not in present)


def unapplied_migrations(using: str) -> list[str]:
    """The app's migrations not applied to ``using``, oldest first; none where the routers keep
    the app's tables out of ``using`` (they are migrated elsewhere)."""
    if not router.allow_migrate_model(using, apps.get_model(APP_LABEL, "Job")):
        return []
    loader = MigrationLoader(connections[using], ignore_no_migrations=True)
    unapplied: dict[str, None] = {}
    for leaf in loader.graph.leaf_nodes(APP_LABEL):
        for app_label, name in loader.graph.forwards_plan(leaf):
            if app_label == APP_LABEL and (app_label, name) not in loader.applied_migrations:
                unapplied[name] = None
    return list(unapplied)


def problem(using: str, *, migrations: bool = True) -> str | None:
    """What ``using`` lacks, as a sentence that says to run ``MIGRATE``; None when it lacks
    nothing, or cannot be read. ``migrations=False`` looks at the tables only (one query)."""
    try:
        missing = missing_tables(using)
        unapplied = unapplied_migrations(using) if migrations and not missing else []
    except DatabaseError:
        return None
    where = f"The queue's database {using!r}"
    if missing:
        if len(missing) == len(tables()):
            return f"{where} has none of django_dbqueue's tables: run `{MIGRATE}`."
        named = ", ".join(missing[:NAMED_TABLES])
        if len(missing) > NAMED_TABLES:
            named += f" and {len(missing) - NAMED_TABLES} more"
        return f"{where} lacks django_dbqueue's table{'s' if len(missing) > 1 else ''} {named}: run `{MIGRATE}`."
    if unapplied:
        count = f"{len(unapplied)} migration{'s' if len(unapplied) > 1 else ''} not applied, the last {unapplied[-1]}"
        return f"{where} lacks the latest migration of django_dbqueue ({count}): run `{MIGRATE}`."
    return None


def require_migrated(using: str, *, migrations: bool = True) -> None:
    """Raise ``NotMigrated`` with ``problem``'s sentence if ``using`` lacks a table or a migration."""
    found = problem(using, migrations=migrations)
    if found is not None:
        raise NotMigrated(found)
