import django
from django.apps import AppConfig
from django.utils.module_loading import autodiscover_modules

from . import conf
from .errors import install_log_filter


class DbQueueConfig(AppConfig):
    name = "django_dbqueue"
    verbose_name = "Job queue"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        from . import checks  # noqa: F401  (registers the system checks)

        # Here rather than in LOGGING: the queue's warnings are scrubbed whatever the
        # project's logging configuration, which Django applies before ready().
        install_log_filter()

        if django.VERSION >= (6, 0):
            # Registers the job that runs django.tasks tasks, and its signal receiver.
            from . import tasks  # noqa: F401

        if conf.get("IMMEDIATE"):
            # The test settings' immediate mode: its runner registers itself with enqueue.
            from . import testing  # noqa: F401

        if conf.get("AUTODISCOVER"):
            # Like admin.py: every installed app's jobs.py, so a worker knows every job.
            autodiscover_modules("jobs")
            if django.VERSION >= (6, 0) and conf.task_backend_queues() is not None:
                # And tasks.py, where django.tasks tasks live by convention.
                autodiscover_modules("tasks")
