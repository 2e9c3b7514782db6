"""On PostgreSQL, a partial index of the waiting jobs for the claim.

The claim reads ``dbqueue_job_claim`` in order and skips reserved rows one by
one: with 100,000 jobs reserved by live workers in front of the waiting ones,
each claim would read them all. This index holds only rows with
``reserved_at IS NULL``, so reserved rows cost nothing; a reserved row leaves
it on its claim. MariaDB and MySQL have no partial indexes, and SQLite's
claim reads few rows at a time, so they keep the full index alone.
"""

from django.db import migrations

INDEX = "dbqueue_job_waiting"


def create(apps, schema_editor):
    if schema_editor.connection.vendor == "postgresql":
        schema_editor.execute(
            f"CREATE INDEX IF NOT EXISTS {INDEX} ON dbqueue_job "
            "(queue, priority DESC, available_at, id) WHERE reserved_at IS NULL"
        )


def drop(apps, schema_editor):
    if schema_editor.connection.vendor == "postgresql":
        schema_editor.execute(f"DROP INDEX IF EXISTS {INDEX}")


class Migration(migrations.Migration):
    dependencies = [("django_dbqueue", "0003_autovacuum")]
    operations = [migrations.RunPython(create, drop, elidable=False)]
