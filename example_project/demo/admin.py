from django.contrib import admin

from django_dbqueue.models import FailedJob, Job

from .models import Order


@admin.register(Order)
class OrderAdmin(admin.ModelAdmin):
    list_display = ["number", "email", "total", "status", "created_at", "confirmed_at"]
    list_filter = ["status"]
    search_fields = ["number", "email"]


# django_dbqueue has no admin of its own yet. Until it does, show its tables
# read-only here; once it registers them, these two are skipped (the library's
# admin.py is loaded first, as django_dbqueue comes before demo in INSTALLED_APPS).
class ReadOnlyAdmin(admin.ModelAdmin):
    def has_add_permission(self, request, obj=None):
        return False

    def has_change_permission(self, request, obj=None):
        return False


if not admin.site.is_registered(Job):

    @admin.register(Job)
    class JobAdmin(ReadOnlyAdmin):
        list_display = ["id", "name", "queue", "attempts", "available_at", "reserved_at", "reserved_by"]
        list_filter = ["queue", "name"]


if not admin.site.is_registered(FailedJob):

    @admin.register(FailedJob)
    class FailedJobAdmin(ReadOnlyAdmin):
        list_display = ["id", "name", "queue", "attempts", "error_summary", "failed_at"]
        list_filter = ["queue", "name", "exception_class"]
