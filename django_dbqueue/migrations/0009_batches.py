"""Batches: the batch table, and the batch of each job and failed job.

The index on ``dbqueue_job.batch_id`` is partial where the database has partial
indexes (PostgreSQL, SQLite), as the flow-control ones (0008): rows outside
batches are not in it, so inserting or deleting them writes no entry there.
"""

from django.db import migrations, models


INDEX = "dbqueue_job_batch"


def create(apps, schema_editor):
    where = " WHERE batch_id IS NOT NULL" if schema_editor.connection.vendor in ("postgresql", "sqlite") else ""
    schema_editor.execute(f"CREATE INDEX {INDEX} ON dbqueue_job (batch_id){where}")


def drop(apps, schema_editor):
    on = " ON dbqueue_job" if schema_editor.connection.vendor == "mysql" else ""
    schema_editor.execute(f"DROP INDEX {INDEX}{on}")


class Migration(migrations.Migration):
    dependencies = [
        ("django_dbqueue", "0008_flow_control"),
    ]

    operations = [
        migrations.CreateModel(
            name="JobBatch",
            fields=[
                ("id", models.BigAutoField(primary_key=True, serialize=False)),
                ("name", models.CharField(blank=True, default="", max_length=200)),
                ("total", models.PositiveIntegerField(default=0)),
                ("pending", models.PositiveIntegerField(default=0)),
                ("failed", models.PositiveIntegerField(default=0)),
                ("cancelled", models.PositiveIntegerField(default=0)),
                ("allow_failures", models.BooleanField(default=False)),
                ("callbacks", models.TextField(blank=True, default="")),
                ("created_at", models.DateTimeField()),
                ("finished_at", models.DateTimeField(blank=True, null=True)),
                ("cancelled_at", models.DateTimeField(blank=True, null=True)),
            ],
            options={
                "verbose_name": "batch",
                "verbose_name_plural": "batches",
                "db_table": "dbqueue_batch",
                "ordering": ["-created_at", "-id"],
                "permissions": [("cancel_batch", "Can cancel batches")],
            },
        ),
        migrations.AddField(
            model_name="failedjob",
            name="batch_id",
            field=models.BigIntegerField(blank=True, null=True),
        ),
        migrations.AddField(
            model_name="job",
            name="batch_id",
            field=models.BigIntegerField(blank=True, null=True),
        ),
        migrations.AddIndex(
            model_name="failedjob",
            index=models.Index(fields=["batch_id"], name="dbqueue_failed_batch"),
        ),
        migrations.AddIndex(
            model_name="jobbatch",
            index=models.Index(fields=["finished_at"], name="dbqueue_batch_finished"),
        ),
        migrations.AddConstraint(
            model_name="jobbatch",
            constraint=models.CheckConstraint(
                condition=models.Q(("pending__lte", models.F("total")), ("failed__lte", models.F("total"))),
                name="dbqueue_batch_counts",
            ),
        ),
        migrations.RunPython(create, drop, elidable=False, atomic=False),
    ]
