from django.apps import AppConfig

from bench.benchapp import waiting_jobs  # noqa: F401 - registers the jobs of bench/waiting.py


class BenchAppConfig(AppConfig):
    name = "bench.benchapp"
    label = "benchapp"
    default_auto_field = "django.db.models.BigAutoField"
