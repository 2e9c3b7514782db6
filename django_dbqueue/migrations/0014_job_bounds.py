"""The job table refuses every value the worker cannot act on, on every database.

Migration 0013 dropped the nine CHECK constraints of ``dbqueue_job`` on
PostgreSQL to save each statement that writes a row their compilation. The
bounds then lived only in Python, which ``update()``, raw SQL, bulk paths and
follow-up rows bypass, and one out-of-range row (a ``retry_after`` of -1 on its
last try) stopped the reclaim of every queue. One CHECK, ``dbqueue_job_bounds``,
now holds them all, tighter where the worker needs it (``retry_after`` and
``concurrency_limit`` at least 1, ``cancel`` 0 to 2). It costs a single enqueue
~144,000 server instructions, as the nine did (docs/performance.md). Rows
already out of these bounds are moved to FailedJob first, unrun.

On SQLite it replaces the nine older checks: SQLite can only add a check by
rebuilding the table, which would also lose the indexes the earlier migrations
made with raw SQL (the model state has none), so they are read before the
rebuild and made again after it. MariaDB/MySQL keep their older column checks
(and unsigned columns) beside it: they refuse nothing the new one admits.
"""

from django.db import migrations, models

# (column, lowest, highest or None): validation.ROW_BOUNDS when this was written.
# A NULL passes a CHECK, so the nullable columns need no ``IS NULL OR``.
RANGES = (
    ("priority", -100, 100),
    ("attempts", 0, None),
    ("given_back", 0, None),
    ("cancel", 0, 2),
    ("exceptions", 0, None),
    ("max_tries", 0, None),
    ("retry_after", 1, None),
    ("timeout", 0, None),
    ("concurrency_limit", 1, None),
)

BOUNDS = models.CheckConstraint(
    condition=models.Q(
        *(
            (f"{column}__gte", low) if high is None else (f"{column}__range", (low, high))
            for column, low, high in RANGES
        )
    ),
    name="dbqueue_job_bounds",
)


def move_aside_out_of_bounds(apps, schema_editor):
    """Move the rows the check would refuse to FailedJob unrun, within its bounds, so
    the constraint can be added and no such row reaches a worker."""
    Job = apps.get_model("django_dbqueue", "Job")
    FailedJob = apps.get_model("django_dbqueue", "FailedJob")
    using = schema_editor.connection.alias
    outside = models.Q()
    for column, low, high in RANGES:
        outside |= models.Q(**{f"{column}__lt": low})
        if high is not None:
            outside |= models.Q(**{f"{column}__gt": high})
    for job in Job.objects.using(using).filter(outside).iterator():
        values = {column: getattr(job, column) for column, _low, _high in RANGES}
        for column, low, high in RANGES:
            if values[column] is not None:
                values[column] = max(low, values[column]) if high is None else min(high, max(low, values[column]))
        FailedJob.objects.using(using).create(
            job_id=job.pk,
            batch_id=job.batch_id,
            queue=job.queue,
            name=job.name,
            payload=job.payload,
            priority=values["priority"],
            max_tries=values["max_tries"],
            retry_after=values["retry_after"],
            timeout=values["timeout"],
            attempts=values["attempts"],
            exception_class="django_dbqueue.exceptions.InvalidJobRow",
            error=(
                f"{job.name} (job {job.pk}) was moved aside unrun by migration 0014: a value was out of the "
                "bounds the worker relies on (now the table's check dbqueue_job_bounds). "
                "Fix the code that wrote it and retry it."
            ),
            created_at=job.created_at,
            failed_at=job.created_at,
        )
        Job.objects.using(using).filter(pk=job.pk).delete()


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
        migrations.RunPython(move_aside_out_of_bounds, migrations.RunPython.noop, elidable=False),
        migrations.RunPython(remember_indexes, restore_indexes, elidable=False),
        migrations.AddConstraint(model_name="job", constraint=BOUNDS),
        migrations.RunPython(restore_indexes, remember_indexes, elidable=False),
    ]
