"""On PostgreSQL, notify listening workers when an INSERT makes jobs available at once."""

from django.db import migrations

CREATE = """
CREATE OR REPLACE FUNCTION dbqueue_job_notify() RETURNS trigger AS $$
BEGIN
    PERFORM pg_notify('dbqueue', queue)
    FROM (SELECT DISTINCT queue FROM dbqueue_new_jobs WHERE available_at <= statement_timestamp()) AS ready;
    RETURN NULL;
END;
$$ LANGUAGE plpgsql;

CREATE TRIGGER dbqueue_job_notify
AFTER INSERT ON dbqueue_job
REFERENCING NEW TABLE AS dbqueue_new_jobs
FOR EACH STATEMENT EXECUTE FUNCTION dbqueue_job_notify();
"""

DROP = """
DROP TRIGGER IF EXISTS dbqueue_job_notify ON dbqueue_job;
DROP FUNCTION IF EXISTS dbqueue_job_notify();
"""


def create(apps, schema_editor):
    if schema_editor.connection.vendor == "postgresql":
        schema_editor.execute(CREATE)


def drop(apps, schema_editor):
    if schema_editor.connection.vendor == "postgresql":
        schema_editor.execute(DROP)


class Migration(migrations.Migration):
    dependencies = [("django_dbqueue", "0001_initial")]
    operations = [migrations.RunPython(create, drop, elidable=False)]
