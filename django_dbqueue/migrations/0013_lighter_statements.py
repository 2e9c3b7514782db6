"""Less work for PostgreSQL in every statement that writes a job row.

Counted with callgrind in the PostgreSQL backend (bench/pg_instructions.py), one
``enqueue()`` cost the server ~520,000 instructions, of which:

- ~134,000 went to the table's nine CHECK constraints (the eight columns of
  Django's ``Positive*Field`` and ``dbqueue_job_priority_range``): PostgreSQL
  reads each check back from its stored text and compiles it again in every
  statement that inserts or updates a row, the worker's claims included. They
  go, on PostgreSQL only: the values are checked where they are made (the
  enqueue's options, validation.py), and the fields keep the same bounds as
  validators. MariaDB, MySQL and SQLite keep them in the database (their
  statements carry them compiled; on SQLite dropping one would rebuild the
  table): Django's model state has none, on every database.
- ~50,000 went to expanding the parameter defaults of ``dbqueue_enqueue``
  (migration 0011), which the server also reads back from text at each call.
  It becomes two functions without defaults: one of eight parameters for a
  plain job, one of fifteen for a job with flow control or in a batch.

After this, ~320,000 instructions (docs/performance.md).
"""

from django.core import validators
from django.db import migrations, models

NOT_NEGATIVE = [validators.MinValueValidator(0)]

# (constraint, its condition) as Django made them in migrations 0001-0008.
CHECKS = [
    *(
        (f"dbqueue_job_{column}_check", f"{column} >= 0")
        for column in (
            "attempts",
            "given_back",
            "cancel",
            "exceptions",
            "max_tries",
            "retry_after",
            "timeout",
            "concurrency_limit",
        )
    ),
    ("dbqueue_job_priority_range", "priority >= -100 AND priority <= 100"),
]

PLAIN = "p_queue text, p_name text, p_payload text, p_priority integer, p_max_tries integer, p_retry_after integer, p_timeout integer, p_delay float8"
# The parameters of a job with flow control or in a batch, with 0011's defaults.
FLOW = [
    ("p_unique_key", "text", "NULL"),
    ("p_unique_until_start", "boolean", "false"),
    ("p_concurrency_key", "text", "NULL"),
    ("p_concurrency_limit", "integer", "NULL"),
    ("p_rate_key", "text", "NULL"),
    ("p_rate_limit", "text", "NULL"),
    ("p_batch_id", "bigint", "NULL"),
]
OUT = "OUT new_id bigint, OUT new_available_at timestamptz, OUT new_created_at timestamptz"


def _function(parameters: str, columns: str, values: str) -> str:
    return f"""
CREATE FUNCTION dbqueue_enqueue({parameters}, {OUT}) AS $$
BEGIN
    INSERT INTO dbqueue_job AS job (
        queue, name, payload, priority, max_tries, retry_after, timeout, {columns}
        attempts, given_back, cancel, exceptions, reserved_by, blocked, available_at, created_at
    ) VALUES (
        p_queue, p_name, p_payload, p_priority, p_max_tries, p_retry_after, p_timeout, {values}
        0, 0, 0, 0, '', false, statement_timestamp() + make_interval(secs => p_delay), statement_timestamp()
    )
    RETURNING job.id, job.available_at, job.created_at INTO new_id, new_available_at, new_created_at;
END;
$$ LANGUAGE plpgsql;
"""


def _flow(defaults: bool) -> str:
    parameters = ", ".join(
        f"{name} {kind}" + (f" DEFAULT {default}" if defaults else "") for name, kind, default in FLOW
    )
    columns = ", ".join(name.removeprefix("p_") for name, _kind, _default in FLOW)
    values = ", ".join(name for name, _kind, _default in FLOW)
    return _function(f"{PLAIN}, {parameters}", f"{columns},", f"{values},")


PLAIN_FUNCTION = _function(PLAIN, "unique_until_start,", "false,")
FLOW_TYPES = ", ".join(kind for _name, kind, _default in FLOW)
PLAIN_TYPES = "text, text, text, integer, integer, integer, integer, float8"


def lighter(apps, schema_editor):
    if schema_editor.connection.vendor != "postgresql":
        return
    for name, _condition in CHECKS:
        schema_editor.execute(f"ALTER TABLE dbqueue_job DROP CONSTRAINT IF EXISTS {name}")
    schema_editor.execute(f"DROP FUNCTION dbqueue_enqueue({PLAIN_TYPES}, {FLOW_TYPES})")
    schema_editor.execute(PLAIN_FUNCTION)
    schema_editor.execute(_flow(defaults=False))


def heavier(apps, schema_editor):
    if schema_editor.connection.vendor != "postgresql":
        return
    schema_editor.execute(f"DROP FUNCTION dbqueue_enqueue({PLAIN_TYPES})")
    schema_editor.execute(f"DROP FUNCTION dbqueue_enqueue({PLAIN_TYPES}, {FLOW_TYPES})")
    schema_editor.execute(_flow(defaults=True))
    for name, condition in CHECKS:
        schema_editor.execute(f"ALTER TABLE dbqueue_job ADD CONSTRAINT {name} CHECK ({condition})")


def _field(kind: type[models.Field], **options) -> models.Field:
    return kind(validators=NOT_NEGATIVE, **options)


class Migration(migrations.Migration):
    dependencies = [("django_dbqueue", "0012_enqueue_indexes")]
    operations = [
        migrations.SeparateDatabaseAndState(
            state_operations=[
                migrations.RemoveConstraint(model_name="job", name="dbqueue_job_priority_range"),
                migrations.AlterField(
                    model_name="job",
                    name="priority",
                    field=models.SmallIntegerField(
                        default=0,
                        validators=[validators.MinValueValidator(-100), validators.MaxValueValidator(100)],
                    ),
                ),
                migrations.AlterField("job", "attempts", _field(models.IntegerField, default=0)),
                migrations.AlterField("job", "given_back", _field(models.IntegerField, default=0, db_default=0)),
                migrations.AlterField("job", "cancel", _field(models.SmallIntegerField, default=0, db_default=0)),
                migrations.AlterField("job", "exceptions", _field(models.IntegerField, default=0, db_default=0)),
                migrations.AlterField("job", "max_tries", _field(models.SmallIntegerField, null=True, blank=True)),
                migrations.AlterField("job", "retry_after", _field(models.IntegerField)),
                migrations.AlterField("job", "timeout", _field(models.IntegerField, null=True, blank=True)),
                migrations.AlterField(
                    "job", "concurrency_limit", _field(models.SmallIntegerField, null=True, blank=True)
                ),
            ],
            database_operations=[migrations.RunPython(lighter, heavier, elidable=False)],
        ),
    ]
