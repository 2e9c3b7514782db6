"""Fewer index entries per new job: each enqueue wrote one in every index of the table.

- ``dbqueue_job_reserved`` becomes partial where the database has partial
  indexes (PostgreSQL, SQLite): ``WHERE reserved_at IS NOT NULL``. Every query
  that reads it asks for reserved rows (the reclaim, a worker's own rows, the
  admin's running jobs), and a new job, not reserved, writes no entry there.
- ``dbqueue_job_claim`` goes on PostgreSQL, where the claim reads the partial
  index of waiting rows (``dbqueue_job_waiting``, 0004 and 0008) and nothing
  reads the full one. MariaDB, MySQL and SQLite keep it: their claim reads it.

Both leave Django's model state: like the partial indexes of 0004, 0008 and
0009, they are made here, per database. A bulk enqueue of 50,000 jobs on
PostgreSQL took 12 % less time (docs/performance.md).
"""

from django.db import migrations

CLAIM = "dbqueue_job_claim"
RESERVED = "dbqueue_job_reserved"


def partial(apps, schema_editor):
    vendor = schema_editor.connection.vendor
    if vendor == "postgresql":
        schema_editor.execute(f"DROP INDEX IF EXISTS {CLAIM}")
    if vendor in ("postgresql", "sqlite"):
        schema_editor.execute(f"DROP INDEX IF EXISTS {RESERVED}")
        schema_editor.execute(f"CREATE INDEX {RESERVED} ON dbqueue_job (reserved_at) WHERE reserved_at IS NOT NULL")


def full(apps, schema_editor):
    vendor = schema_editor.connection.vendor
    if vendor == "postgresql":
        schema_editor.execute(f"CREATE INDEX {CLAIM} ON dbqueue_job (queue, priority DESC, available_at, id)")
    if vendor in ("postgresql", "sqlite"):
        schema_editor.execute(f"DROP INDEX IF EXISTS {RESERVED}")
        schema_editor.execute(f"CREATE INDEX {RESERVED} ON dbqueue_job (reserved_at)")


class Migration(migrations.Migration):
    dependencies = [("django_dbqueue", "0011_enqueue_function")]
    operations = [
        migrations.SeparateDatabaseAndState(
            state_operations=[
                migrations.RemoveIndex(model_name="job", name=CLAIM),
                migrations.RemoveIndex(model_name="job", name=RESERVED),
            ],
            database_operations=[migrations.RunPython(partial, full, elidable=False)],
        ),
    ]
