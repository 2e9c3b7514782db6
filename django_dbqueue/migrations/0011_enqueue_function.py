"""On PostgreSQL, the INSERT of one new job as a function, whose plan the server keeps.

Django opens PostgreSQL connections with prepared statements off (so that
transaction-pooling PgBouncer works), so every ``INSERT`` a client sends is
parsed and planned again: 20-30 µs of a single enqueue's ~300 µs. PL/pgSQL
prepares the statements of a function once per server session and keeps the
plan, which no pooler can lose: ``enqueue()`` calls ``dbqueue_enqueue`` (bulk.py,
``insert_one``). It returns the id and the two times the row got from the
server's clock. Its parameters are a new row's columns in the order of ``bulk.NewJob`` (the delay
in seconds last), then those of ``bulk.Flow`` and the batch, which default to
a job without flow control outside any batch: a plain job sends eight values.
"""

from django.db import migrations

CREATE = """
CREATE OR REPLACE FUNCTION dbqueue_enqueue(
    p_queue text, p_name text, p_payload text, p_priority integer, p_max_tries integer,
    p_retry_after integer, p_timeout integer, p_delay float8,
    p_unique_key text DEFAULT NULL, p_unique_until_start boolean DEFAULT false,
    p_concurrency_key text DEFAULT NULL, p_concurrency_limit integer DEFAULT NULL,
    p_rate_key text DEFAULT NULL, p_rate_limit text DEFAULT NULL, p_batch_id bigint DEFAULT NULL,
    OUT new_id bigint, OUT new_available_at timestamptz, OUT new_created_at timestamptz
) AS $$
BEGIN
    INSERT INTO dbqueue_job AS job (
        queue, name, payload, priority, max_tries, retry_after, timeout,
        unique_key, unique_until_start, concurrency_key, concurrency_limit, rate_key, rate_limit,
        batch_id, attempts, given_back, cancel, exceptions, reserved_by, blocked, available_at, created_at
    ) VALUES (
        p_queue, p_name, p_payload, p_priority, p_max_tries, p_retry_after, p_timeout,
        p_unique_key, p_unique_until_start, p_concurrency_key, p_concurrency_limit, p_rate_key, p_rate_limit,
        p_batch_id, 0, 0, 0, 0, '', false,
        statement_timestamp() + make_interval(secs => p_delay), statement_timestamp()
    )
    RETURNING job.id, job.available_at, job.created_at INTO new_id, new_available_at, new_created_at;
END;
$$ LANGUAGE plpgsql;
"""

DROP = (
    "DROP FUNCTION IF EXISTS dbqueue_enqueue("
    "text, text, text, integer, integer, integer, integer, float8, text, boolean, text, integer, text, text, bigint)"
)


def create(apps, schema_editor):
    if schema_editor.connection.vendor == "postgresql":
        schema_editor.execute(CREATE)


def drop(apps, schema_editor):
    if schema_editor.connection.vendor == "postgresql":
        schema_editor.execute(DROP)


class Migration(migrations.Migration):
    dependencies = [("django_dbqueue", "0010_workers_and_history")]
    operations = [migrations.RunPython(create, drop, elidable=False)]
