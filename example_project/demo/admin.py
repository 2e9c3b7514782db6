from django.contrib import admin

from django_dbqueue.admin.about import JobsAboutMixin

from .models import Order


@admin.register(Order)
class OrderAdmin(JobsAboutMixin, admin.ModelAdmin):
    """An order's page lists the jobs about it (those given the order as an argument), with
    Retry and Cancel: docs/howto/jobs-about-objects.md."""

    list_display = ["number", "email", "total", "status", "created_at", "confirmed_at"]
    list_filter = ["status"]
    search_fields = ["number", "email"]
