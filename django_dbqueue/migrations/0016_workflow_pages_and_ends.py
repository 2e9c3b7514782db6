"""Workflows on PostgreSQL: room on each page for the one update a row gets, and their ends announced.

Pages: a node is updated once when it ends (its state) and an edge once when its parent
ends (``done``); neither column is indexed, so PostgreSQL can write the new row version on
the same page without touching an index (a HOT update), but only if the page has room.
Filled to the brim at enqueue, 57 % of those updates wrote an entry in every index of the
table; with half of each page kept free, all of them are HOT, and a 10,000-node fan-in
drains at 82-89 % of the same plain jobs instead of 75 % (bench.workflows). The two
tables take twice the pages while a workflow lives.

Wake-ups: the jobs it releases are announced on the channel of migration 0002's INSERT
trigger (``dbqueue``, one NOTIFY per queue), so idle workers claim them at once rather
than at their next poll (``--sleep``): a fan-out is drained by every worker from its start.

Ends: ``dbqueue_release`` now also sends the ids of the workflows of the succeeded nodes
that have no child on ``dbqueue_workflow_ended`` (a workflow can only end when one of
those does), for ``WorkflowHandle.wait``; the other ends are announced from Python
(``lifecycle.dependencies``). PostgreSQL sends one payload once per transaction.
"""

import importlib

from django.db import migrations

TABLES = ("dbqueue_workflow_node", "dbqueue_workflow_edge")

RELEASE = """
CREATE OR REPLACE FUNCTION dbqueue_release(succeeded bigint[]) RETURNS bigint AS $$
DECLARE
    racing bigint;
    ended bigint[];
    ready text[];
BEGIN
    IF succeeded IS NULL OR cardinality(succeeded) = 0 THEN
        RETURN 0;
    END IF;
    -- The leaves among them (by the edges' (parent, child) index, one probe each): their workflows may have ended.
    WITH marked AS (
        UPDATE dbqueue_workflow_node SET state = 'succeeded', finished_at = statement_timestamp()
        WHERE id = ANY(succeeded) AND state = 'pending' RETURNING id, workflow_id
    )
    SELECT array_agg(DISTINCT workflow_id) INTO ended FROM marked
    WHERE (SELECT 1 FROM dbqueue_workflow_edge l WHERE l.parent_id = marked.id LIMIT 1) IS NULL;
    IF ended IS NOT NULL THEN
        PERFORM pg_notify('dbqueue_workflow_ended', array_to_string(ended, ','));
    END IF;
    -- One snapshot: the edges marked here still read undone in it, so they are left out by parent.
    -- A child's edges are read from the highest parent down (parents end roughly in id order),
    -- so the first one read is undone.
    WITH edges AS (
        UPDATE dbqueue_workflow_edge SET done = true
        WHERE parent_id = ANY(succeeded) AND NOT done RETURNING child_id
    ), waits AS (
        SELECT c.id, c.job_id, (
            SELECT p.job_id FROM dbqueue_workflow_edge u JOIN dbqueue_workflow_node p ON p.id = u.parent_id
            WHERE u.child_id = c.id AND NOT u.done AND u.parent_id <> ALL(succeeded)
            ORDER BY u.parent_id DESC LIMIT 1
        ) AS parent_job
        FROM (SELECT DISTINCT child_id FROM edges) AS e CROSS JOIN LATERAL (
            SELECT id, job_id FROM dbqueue_workflow_node WHERE id = e.child_id AND state = 'pending' LIMIT 1
        ) AS c
    ), released AS (
        UPDATE dbqueue_job SET blocked = false FROM waits
        WHERE dbqueue_job.id = waits.job_id AND waits.parent_job IS NULL
        AND dbqueue_job.blocked AND dbqueue_job.reserved_at IS NULL RETURNING dbqueue_job.queue
    )
    -- A parent still waiting to be claimed will see these edges done when it ends: no race. (Per
    -- child by the primary key: as an anti-join, planned for many children, it read every job.)
    SELECT (SELECT count(*) FROM waits WHERE waits.parent_job IS NOT NULL AND (
        SELECT j.reserved_at IS NULL FROM dbqueue_job j WHERE j.id = waits.parent_job LIMIT 1
    ) IS NOT TRUE), ARRAY(SELECT DISTINCT queue FROM released) INTO racing, ready;
    -- Wake the idle workers of the released jobs' queues (the INSERT trigger's channel).
    PERFORM pg_notify('dbqueue', queue) FROM unnest(ready) AS queue;
    RETURN racing;
END;
$$ LANGUAGE plpgsql;
"""


def forward(apps, schema_editor):
    if schema_editor.connection.vendor == "postgresql":
        for table in TABLES:
            schema_editor.execute(f"ALTER TABLE {schema_editor.quote_name(table)} SET (fillfactor = 50)")
        schema_editor.execute(RELEASE)


def backward(apps, schema_editor):
    if schema_editor.connection.vendor == "postgresql":
        for table in TABLES:
            schema_editor.execute(f"ALTER TABLE {schema_editor.quote_name(table)} RESET (fillfactor)")
        schema_editor.execute(importlib.import_module("django_dbqueue.migrations.0015_workflows").RELEASE)


class Migration(migrations.Migration):
    dependencies = [("django_dbqueue", "0015_workflows")]

    operations = [migrations.RunPython(forward, backward, elidable=False)]
