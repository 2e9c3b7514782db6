"""Workflows on PostgreSQL: a wide fan-out released in chunks.

``dbqueue_release_chunk(succeeded, max_edges)`` is ``dbqueue_release`` (migration 0016) marking
at most ``max_edges`` of the parents' undone edges done (and unblocking the children they leave
ready); ``more`` says edges were left for the next call. The finish-and-claim statement releases
a first chunk, and the worker releases the rest after its commit, a larger chunk per transaction
(``lifecycle.dependencies.release_rest``): a root of 10,000 children no longer holds them all
back until one transaction has written 10,000 edges and 10,000 job rows, while every other worker
waits. The bound applies only where the parents have more than ``max_edges`` edges (one probe of
the edges' (parent, child) index): a node with a few children is released as before.

``dbqueue_release(succeeded)`` stays, for workers of the version before during a rolling upgrade.
"""

from django.db import migrations

RELEASE_CHUNK = """
CREATE OR REPLACE FUNCTION dbqueue_release_chunk(
    succeeded bigint[], max_edges integer, OUT racing bigint, OUT more boolean
) AS $$
DECLARE
    ended bigint[];
    ready text[];
    bound integer;
    marked integer;
BEGIN
    racing := 0;
    more := false;
    IF succeeded IS NULL OR cardinality(succeeded) = 0 THEN
        RETURN;
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
    -- More edges than the bound (done or not: the index alone): mark the first max_edges undone.
    IF EXISTS (SELECT 1 FROM dbqueue_workflow_edge WHERE parent_id = ANY(succeeded) OFFSET max_edges) THEN
        bound := max_edges;
    END IF;
    -- One snapshot: the edges marked here still read undone in it, so they are left out by parent
    -- (an edge of a succeeded parent left for the next chunk is left out too: that parent succeeded).
    -- A child's edges are read from the highest parent down (parents end roughly in id order),
    -- so the first one read is undone.
    WITH edges AS (
        UPDATE dbqueue_workflow_edge SET done = true
        WHERE parent_id = ANY(succeeded) AND NOT done AND (bound IS NULL OR id IN (
            SELECT id FROM dbqueue_workflow_edge WHERE parent_id = ANY(succeeded) AND NOT done LIMIT bound
        )) RETURNING child_id
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
    ) IS NOT TRUE), ARRAY(SELECT DISTINCT queue FROM released), (SELECT count(*) FROM edges)
    INTO racing, ready, marked;
    -- Wake the idle workers of the released jobs' queues (the INSERT trigger's channel).
    PERFORM pg_notify('dbqueue', queue) FROM unnest(ready) AS queue;
    more := bound IS NOT NULL AND marked >= bound;
END;
$$ LANGUAGE plpgsql;
"""


def forward(apps, schema_editor):
    if schema_editor.connection.vendor == "postgresql":
        schema_editor.execute(RELEASE_CHUNK)


def backward(apps, schema_editor):
    if schema_editor.connection.vendor == "postgresql":
        schema_editor.execute("DROP FUNCTION IF EXISTS dbqueue_release_chunk(bigint[], integer)")


class Migration(migrations.Migration):
    dependencies = [("django_dbqueue", "0020_failed_job_id")]

    operations = [migrations.RunPython(forward, backward, elidable=False)]
