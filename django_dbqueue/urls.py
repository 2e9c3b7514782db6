"""Mount with ``path("queue/", include("django_dbqueue.urls"))``; wrap in your own auth if keys are private."""

from django.urls import path

from .views import progress_view

app_name = "django_dbqueue"
urlpatterns = [path("progress/<str:key>/", progress_view, name="progress")]
