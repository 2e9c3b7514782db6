from django.apps import AppConfig
from django.utils.module_loading import autodiscover_modules


class DbQueueConfig(AppConfig):
    name = "django_dbqueue"
    verbose_name = "Job queue"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        from . import checks, conf  # noqa: F401  (registers the system checks)

        if conf.get("AUTODISCOVER"):
            # Like admin.py: every installed app's jobs.py, so a worker knows every job.
            autodiscover_modules("jobs")
