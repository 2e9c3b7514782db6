"""Workflows (a graph of jobs: nodes and edges), durable steps, and the job's node.

``node_id`` on the job and failed-job tables is nullable with no default, so every
database adds it in place (SQLite without rebuilding the table).

On PostgreSQL, ``dbqueue_release`` does what the success of workflow nodes does to
the nodes after them (``lifecycle.dependencies``): as a function, its statements
are planned once per server session (a client's statements are planned at every
call, and this one would cost a drain of nodes a millisecond a claim), which no
pooler can lose. It marks the nodes succeeded and their edges done, unblocks the
children left with no undone edge, and returns how many children may wait for a
parent that ends beside it (their release is tried again after the commit).
"""

import django.db.models.deletion
from django.db import migrations, models

RELEASE = """
CREATE OR REPLACE FUNCTION dbqueue_release(succeeded bigint[]) RETURNS bigint AS $$
DECLARE
    racing bigint;
BEGIN
    IF succeeded IS NULL OR cardinality(succeeded) = 0 THEN
        RETURN 0;
    END IF;
    UPDATE dbqueue_workflow_node SET state = 'succeeded', finished_at = statement_timestamp()
    WHERE id = ANY(succeeded) AND state = 'pending';
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
        AND dbqueue_job.blocked AND dbqueue_job.reserved_at IS NULL RETURNING 1
    )
    -- A parent still waiting to be claimed will see these edges done when it ends: no race. (Per
    -- child by the primary key: as an anti-join, planned for many children, it read every job.)
    SELECT count(*) INTO racing FROM waits WHERE waits.parent_job IS NOT NULL AND (
        SELECT j.reserved_at IS NULL FROM dbqueue_job j WHERE j.id = waits.parent_job LIMIT 1
    ) IS NOT TRUE;
    RETURN racing;
END;
$$ LANGUAGE plpgsql;
"""


def create_release(apps, schema_editor):
    if schema_editor.connection.vendor == "postgresql":
        schema_editor.execute(RELEASE)


def drop_release(apps, schema_editor):
    if schema_editor.connection.vendor == "postgresql":
        schema_editor.execute("DROP FUNCTION IF EXISTS dbqueue_release(bigint[])")


class Migration(migrations.Migration):

    dependencies = [
        ('django_dbqueue', '0014_job_bounds'),
    ]

    operations = [
        migrations.AddField(
            model_name='failedjob',
            name='node_id',
            field=models.BigIntegerField(blank=True, null=True),
        ),
        migrations.AddField(
            model_name='job',
            name='node_id',
            field=models.BigIntegerField(blank=True, null=True),
        ),
        migrations.CreateModel(
            name='JobStep',
            fields=[
                ('id', models.BigAutoField(primary_key=True, serialize=False)),
                ('job_id', models.BigIntegerField()),
                ('name', models.CharField(max_length=200)),
                ('result', models.TextField(default='null')),
                ('finished_at', models.DateTimeField()),
            ],
            options={
                'verbose_name': 'job step',
                'db_table': 'dbqueue_job_step',
                'indexes': [models.Index(fields=['finished_at'], name='dbqueue_step_finished')],
                'constraints': [models.UniqueConstraint(fields=('job_id', 'name'), name='dbqueue_step_name')],
            },
        ),
        migrations.CreateModel(
            name='Workflow',
            fields=[
                ('id', models.BigAutoField(primary_key=True, serialize=False)),
                ('name', models.CharField(blank=True, default='', max_length=200)),
                ('created_at', models.DateTimeField()),
                ('cancelled_at', models.DateTimeField(blank=True, null=True)),
            ],
            options={
                'verbose_name': 'workflow',
                'db_table': 'dbqueue_workflow',
                'ordering': ['-created_at', '-id'],
                'permissions': [('cancel_workflow', 'Can cancel workflows')],
                'indexes': [models.Index(fields=['created_at'], name='dbqueue_workflow_created')],
            },
        ),
        migrations.CreateModel(
            name='WorkflowNode',
            fields=[
                ('id', models.BigAutoField(primary_key=True, serialize=False)),
                ('name', models.CharField(max_length=200)),
                ('job_name', models.CharField(max_length=200)),
                ('job_id', models.BigIntegerField(blank=True, null=True)),
                ('state', models.CharField(choices=[('pending', 'pending'), ('succeeded', 'succeeded'), ('failed', 'failed'), ('cancelled', 'cancelled')], default='pending', max_length=20)),
                ('pass_results', models.BooleanField(default=False)),
                ('error', models.TextField(blank=True, default='')),
                ('finished_at', models.DateTimeField(blank=True, null=True)),
                ('adopted', models.BooleanField(default=False)),
                ('workflow', models.ForeignKey(on_delete=django.db.models.deletion.CASCADE, related_name='nodes', to='django_dbqueue.workflow')),
            ],
            options={
                'verbose_name': 'workflow node',
                'db_table': 'dbqueue_workflow_node',
                'ordering': ['id'],
            },
        ),
        migrations.CreateModel(
            name='WorkflowEdge',
            fields=[
                ('id', models.BigAutoField(primary_key=True, serialize=False)),
                ('run_anyway', models.BooleanField(default=False)),
                ('done', models.BooleanField(default=False)),
                ('child', models.ForeignKey(db_index=False, on_delete=django.db.models.deletion.CASCADE, related_name='parent_edges', to='django_dbqueue.workflownode')),
                ('parent', models.ForeignKey(db_index=False, on_delete=django.db.models.deletion.CASCADE, related_name='child_edges', to='django_dbqueue.workflownode')),
            ],
            options={
                'verbose_name': 'workflow edge',
                'db_table': 'dbqueue_workflow_edge',
            },
        ),
        migrations.AddIndex(
            model_name='workflownode',
            index=models.Index(fields=['job_id'], name='dbqueue_node_job'),
        ),
        migrations.AddIndex(
            model_name='workflownode',
            index=models.Index(condition=models.Q(('adopted', True)), fields=['adopted'], name='dbqueue_node_adopted'),
        ),
        migrations.AddConstraint(
            model_name='workflownode',
            constraint=models.UniqueConstraint(fields=('workflow', 'name'), name='dbqueue_node_name'),
        ),
        migrations.AddIndex(
            model_name='workflowedge',
            index=models.Index(fields=['child', 'parent'], name='dbqueue_edge_child'),
        ),
        migrations.AddConstraint(
            model_name='workflowedge',
            constraint=models.UniqueConstraint(fields=('parent', 'child'), name='dbqueue_edge_pair'),
        ),
        migrations.AddConstraint(
            model_name='workflowedge',
            constraint=models.CheckConstraint(condition=models.Q(('parent', models.F('child')), _negated=True), name='dbqueue_edge_not_self'),
        ),
        migrations.RunPython(create_release, drop_release, elidable=False),
    ]
