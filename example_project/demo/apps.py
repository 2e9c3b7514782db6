from django.apps import AppConfig


class DemoConfig(AppConfig):
    name = "demo"
    verbose_name = "Demo shop"
    default_auto_field = "django.db.models.BigAutoField"
