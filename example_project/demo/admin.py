from django.contrib import admin

from .models import Order


@admin.register(Order)
class OrderAdmin(admin.ModelAdmin):
    list_display = ["number", "email", "total", "status", "created_at", "confirmed_at"]
    list_filter = ["status"]
    search_fields = ["number", "email"]
