import django
from django.apps import AppConfig
from django.conf import settings
from django.utils.module_loading import autodiscover_modules


def uses_tasks_backend() -> bool:
    """Tell whether a TASKS backend of the project is django-dbqueue's."""
    backends = getattr(settings, "TASKS", None) or {}
    return any(str(params.get("BACKEND", "")).startswith("django_dbqueue.") for params in backends.values())


class DbQueueConfig(AppConfig):
    name = "django_dbqueue"
    verbose_name = "Job queue"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        from . import checks, conf  # noqa: F401  (registers the system checks)
        from .errors import install_log_filter

        # Here rather than in LOGGING: the queue's warnings are scrubbed whatever the
        # project's logging configuration, which Django applies before ready().
        install_log_filter()

        if django.VERSION >= (6, 0):
            # Registers the job that runs django.tasks tasks, and its signal receiver.
            from . import tasks  # noqa: F401

        if conf.get("AUTODISCOVER"):
            # Like admin.py: every installed app's jobs.py, so a worker knows every job.
            autodiscover_modules("jobs")
            if django.VERSION >= (6, 0) and uses_tasks_backend():
                # And tasks.py, where django.tasks tasks live by convention.
                autodiscover_modules("tasks")
