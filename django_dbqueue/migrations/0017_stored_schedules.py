"""Stored schedules: periodic schedules made at runtime (admin, ``queue_schedules``), ticked as
those declared in code; each keeps its state in a ``dbqueue_schedule`` row of the same name."""

import django.core.validators
from django.db import migrations, models


class Migration(migrations.Migration):

    dependencies = [
        ('django_dbqueue', '0016_workflow_pages_and_ends'),
    ]

    operations = [
        migrations.CreateModel(
            name='StoredSchedule',
            fields=[
                ('id', models.BigAutoField(primary_key=True, serialize=False)),
                ('name', models.CharField(help_text="The schedule's key; unique with those in code.", max_length=200, unique=True)),
                ('job_name', models.CharField(help_text="A registered job's name.", max_length=200)),
                ('args', models.JSONField(blank=True, default=list, help_text='Positional arguments, a JSON list: ["eu", 3].')),
                ('kwargs', models.JSONField(blank=True, default=dict, help_text='Keyword arguments, a JSON object: {"full": true}.')),
                ('cron', models.CharField(help_text='5 fields (minute hour day month weekday), 6 with seconds first, or @daily, @hourly ...', max_length=100)),
                ('timezone', models.CharField(blank=True, default='', help_text='Blank: settings.TIME_ZONE.', max_length=64)),
                ('queue', models.CharField(blank=True, default='', help_text="Blank: the job's own queue.", max_length=100)),
                ('enabled', models.BooleanField(default=True)),
                ('jitter', models.PositiveIntegerField(default=0, help_text="Tick up to so many seconds after the expression's time (0 to 3600): a fixed offset of this schedule's own, the same at every tick.", validators=[django.core.validators.MaxValueValidator(3600)])),
                ('tick_argument', models.CharField(blank=True, default='', help_text='Pass the tick (an aware datetime) as this keyword; blank: not.', max_length=100)),
                ('revision', models.PositiveIntegerField(default=0, editable=False)),
                ('created_at', models.DateTimeField(auto_now_add=True)),
                ('updated_at', models.DateTimeField(auto_now=True)),
            ],
            options={
                'verbose_name': 'stored schedule',
                'db_table': 'dbqueue_stored_schedule',
                'ordering': ['name'],
                'constraints': [models.CheckConstraint(condition=models.Q(('jitter__lte', 3600)), name='dbqueue_stored_schedule_jitter')],
            },
        ),
    ]
