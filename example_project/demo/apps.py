from django.apps import AppConfig
from django.core import checks

from .checks import check_secret_key


class DemoConfig(AppConfig):
    name = "demo"
    verbose_name = "Demo shop"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        checks.register(check_secret_key, checks.Tags.security)
