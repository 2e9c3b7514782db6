"""Flow control: unique keys, concurrency keys, rate-limit buckets, paused queues.

The indexes on the new job columns are partial where the database has partial
indexes (PostgreSQL, SQLite): rows that use no flow control (NULL keys) are
not in them, so claiming or deleting such a row writes no entry there. MariaDB
and MySQL index every row; a unique index there allows any number of NULLs
too. The partial index of waiting rows on PostgreSQL (0004) now leaves out
blocked rows as well, so jobs waiting for a concurrency slot cost the claim
nothing.
"""

from django.db import migrations, models

INDEXES = {
    # name: (unique, column)
    "dbqueue_job_unique": (True, "unique_key"),
    "dbqueue_job_concurrency": (False, "concurrency_key"),
}
WAITING = "dbqueue_job_waiting"


def create(apps, schema_editor):
    vendor = schema_editor.connection.vendor
    for name, (unique, column) in INDEXES.items():
        kind = "UNIQUE INDEX" if unique else "INDEX"
        where = f" WHERE {column} IS NOT NULL" if vendor in ("postgresql", "sqlite") else ""
        schema_editor.execute(f"CREATE {kind} {name} ON dbqueue_job ({column}){where}")
    if vendor == "postgresql":
        schema_editor.execute(f"DROP INDEX IF EXISTS {WAITING}")
        schema_editor.execute(
            f"CREATE INDEX {WAITING} ON dbqueue_job (queue, priority DESC, available_at, id) "
            "WHERE reserved_at IS NULL AND NOT blocked"
        )


def drop(apps, schema_editor):
    vendor = schema_editor.connection.vendor
    for name in INDEXES:
        schema_editor.execute(f"DROP INDEX {name}" + (" ON dbqueue_job" if vendor == "mysql" else ""))
    if vendor == "postgresql":
        schema_editor.execute(f"DROP INDEX IF EXISTS {WAITING}")
        schema_editor.execute(
            f"CREATE INDEX {WAITING} ON dbqueue_job (queue, priority DESC, available_at, id) WHERE reserved_at IS NULL"
        )


class Migration(migrations.Migration):
    dependencies = [
        ("django_dbqueue", "0007_schedules"),
    ]

    operations = [
        migrations.CreateModel(
            name="FlowLimit",
            fields=[
                ("id", models.BigAutoField(auto_created=True, primary_key=True, serialize=False, verbose_name="ID")),
                ("key", models.CharField(max_length=255, unique=True)),
                ("tokens", models.FloatField(default=0)),
                ("updated_at", models.DateTimeField(blank=True, null=True)),
                ("held_until", models.DateTimeField(blank=True, null=True)),
            ],
            options={
                "verbose_name": "flow limit",
                "db_table": "dbqueue_limit",
            },
        ),
        migrations.CreateModel(
            name="PausedQueue",
            fields=[
                ("id", models.BigAutoField(auto_created=True, primary_key=True, serialize=False, verbose_name="ID")),
                ("queue", models.CharField(max_length=100, unique=True)),
                ("paused_at", models.DateTimeField()),
            ],
            options={
                "verbose_name": "paused queue",
                "db_table": "dbqueue_paused_queue",
                "permissions": [("pause_queue", "Can pause and resume queues")],
            },
        ),
        migrations.AddField(
            model_name="job",
            name="blocked",
            field=models.BooleanField(db_default=False, default=False),
        ),
        migrations.AddField(
            model_name="job",
            name="concurrency_key",
            field=models.CharField(blank=True, max_length=255, null=True),
        ),
        migrations.AddField(
            model_name="job",
            name="concurrency_limit",
            field=models.PositiveSmallIntegerField(blank=True, null=True),
        ),
        migrations.AddField(
            model_name="job",
            name="rate_key",
            field=models.CharField(blank=True, max_length=255, null=True),
        ),
        migrations.AddField(
            model_name="job",
            name="rate_limit",
            field=models.CharField(blank=True, max_length=50, null=True),
        ),
        migrations.AddField(
            model_name="job",
            name="unique_key",
            field=models.CharField(blank=True, max_length=255, null=True),
        ),
        migrations.AddField(
            model_name="job",
            name="unique_until_start",
            field=models.BooleanField(db_default=False, default=False),
        ),
        migrations.CreateModel(
            name="UniqueWindow",
            fields=[
                ("id", models.BigAutoField(auto_created=True, primary_key=True, serialize=False, verbose_name="ID")),
                ("key", models.CharField(max_length=255, unique=True)),
                ("job_id", models.BigIntegerField(blank=True, null=True)),
                ("expires_at", models.DateTimeField()),
            ],
            options={
                "verbose_name": "unique window",
                "db_table": "dbqueue_unique_window",
                "indexes": [models.Index(fields=["expires_at"], name="dbqueue_unique_window_expires")],
            },
        ),
        migrations.RunPython(create, drop, elidable=False, atomic=False),
    ]
