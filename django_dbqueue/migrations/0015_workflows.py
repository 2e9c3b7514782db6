"""Workflows (a graph of jobs: nodes and edges), durable steps, and the job's node.

``node_id`` on the job and failed-job tables is nullable with no default, so every
database adds it in place (SQLite without rebuilding the table).
"""

import django.db.models.deletion
from django.db import migrations, models


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
                ('child', models.ForeignKey(on_delete=django.db.models.deletion.CASCADE, related_name='parent_edges', to='django_dbqueue.workflownode')),
                ('parent', models.ForeignKey(on_delete=django.db.models.deletion.CASCADE, related_name='child_edges', to='django_dbqueue.workflownode')),
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
            index=models.Index(fields=['adopted', 'state'], name='dbqueue_node_adopted'),
        ),
        migrations.AddConstraint(
            model_name='workflownode',
            constraint=models.UniqueConstraint(fields=('workflow', 'name'), name='dbqueue_node_name'),
        ),
        migrations.AddIndex(
            model_name='workflowedge',
            index=models.Index(fields=['child', 'done'], name='dbqueue_edge_child'),
        ),
        migrations.AddConstraint(
            model_name='workflowedge',
            constraint=models.UniqueConstraint(fields=('parent', 'child'), name='dbqueue_edge_pair'),
        ),
        migrations.AddConstraint(
            model_name='workflowedge',
            constraint=models.CheckConstraint(condition=models.Q(('parent', models.F('child')), _negated=True), name='dbqueue_edge_not_self'),
        ),
    ]
