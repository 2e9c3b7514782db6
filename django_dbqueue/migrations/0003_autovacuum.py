"""On PostgreSQL, vacuum and analyze the hot job table often.

Every job is inserted, updated and deleted, so the table churns; stale
statistics make the planner sort instead of reading the claim index in order.
"""

from django.db import migrations

SETTINGS = (
    "autovacuum_vacuum_scale_factor = 0.02, autovacuum_vacuum_threshold = 1000, "
    "autovacuum_analyze_scale_factor = 0.02, autovacuum_analyze_threshold = 1000"
)


def tune(apps, schema_editor):
    if schema_editor.connection.vendor == "postgresql":
        schema_editor.execute(f"ALTER TABLE dbqueue_job SET ({SETTINGS})")


def untune(apps, schema_editor):
    if schema_editor.connection.vendor == "postgresql":
        schema_editor.execute(
            "ALTER TABLE dbqueue_job RESET (autovacuum_vacuum_scale_factor, autovacuum_vacuum_threshold, "
            "autovacuum_analyze_scale_factor, autovacuum_analyze_threshold)"
        )


class Migration(migrations.Migration):
    dependencies = [("django_dbqueue", "0002_notify")]
    operations = [migrations.RunPython(tune, untune, elidable=False)]
