"""The objects jobs are about (``about``): one row per object a job's arguments hold, written with
the job's row; found by reference (``demo.order:42``), newest job first."""

from django.db import migrations, models


class Migration(migrations.Migration):

    dependencies = [
        ('django_dbqueue', '0018_finished_jobs'),
    ]

    operations = [
        migrations.CreateModel(
            name='JobReference',
            fields=[
                ('id', models.BigAutoField(primary_key=True, serialize=False)),
                ('job_id', models.BigIntegerField(help_text='The job, queued, failed or finished.')),
                ('ref', models.CharField(help_text="Its model's label and pk: demo.order:42.", max_length=255)),
            ],
            options={
                'db_table': 'dbqueue_job_reference',
                'indexes': [models.Index(fields=['ref', 'job_id'], name='dbqueue_reference_ref')],
                'constraints': [models.UniqueConstraint(fields=('job_id', 'ref'), name='dbqueue_reference_job')],
            },
        ),
    ]
