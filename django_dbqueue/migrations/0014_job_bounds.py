"""The job table refuses every value the worker cannot act on, on every database.

Migration 0013 dropped the nine CHECK constraints of ``dbqueue_job`` on
PostgreSQL to save each statement that writes a row their compilation. The
bounds then lived only in Python, which ``update()``, raw SQL, bulk paths and
follow-up rows bypass, and one out-of-range row (a ``retry_after`` of -1 on its
last try) stopped the reclaim of every queue. One CHECK, ``dbqueue_job_bounds``,
now holds them all, tighter where the worker needs it (``retry_after`` and
``concurrency_limit`` at least 1, ``cancel`` 0 to 2): one constraint costs less
to compile than nine (docs/performance.md gives both).

On SQLite it replaces the nine older checks: SQLite can only add a check by
rebuilding the table, which would also lose the indexes the earlier migrations
made with raw SQL (the model state has none), so they are read before the
rebuild and made again after it. MariaDB/MySQL keep their older column checks
(and unsigned columns) beside it: they refuse nothing the new one admits.
"""

from django.db import migrations, models

BOUNDS = models.CheckConstraint(
    condition=models.Q(
        ("priority__range", (-100, 100)),
        ("attempts__gte", 0),
        ("given_back__gte", 0),
        ("cancel__range", (0, 2)),
        ("exceptions__gte", 0),
        models.Q(("max_tries__isnull", True), ("max_tries__gte", 0), _connector="OR"),
        ("retry_after__gte", 1),
        models.Q(("timeout__isnull", True), ("timeout__gte", 0), _connector="OR"),
        models.Q(("concurrency_limit__isnull", True), ("concurrency_limit__gte", 1), _connector="OR"),
    ),
    name="dbqueue_job_bounds",
)

# The SQLite indexes of dbqueue_job, read before the table is rebuilt (per database alias).
_indexes: dict[str, list[str]] = {}


def _sqlite_indexes(connection) -> list[str]:
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT sql FROM sqlite_master WHERE type = 'index' AND tbl_name = 'dbqueue_job' AND sql IS NOT NULL"
        )
        return [row[0] for row in cursor.fetchall()]


def remember_indexes(apps, schema_editor):
    connection = schema_editor.connection
    if connection.vendor == "sqlite":
        _indexes[connection.alias] = _sqlite_indexes(connection)


def restore_indexes(apps, schema_editor):
    connection = schema_editor.connection
    if connection.vendor != "sqlite":
        return
    present = set(_sqlite_indexes(connection))
    for sql in _indexes.pop(connection.alias, []):
        if sql not in present:
            schema_editor.execute(sql)


class Migration(migrations.Migration):
    dependencies = [("django_dbqueue", "0013_lighter_statements")]
    operations = [
        migrations.RunPython(remember_indexes, restore_indexes, elidable=False),
        migrations.AddConstraint(model_name="job", constraint=BOUNDS),
        migrations.RunPython(restore_indexes, remember_indexes, elidable=False),
    ]
