"""Mount with ``path("queue/", include("django_dbqueue.urls"))``: ``progress/<key>/``; views.py says who may see it."""

from django.urls import path

from .views import progress_view

app_name = "django_dbqueue"
urlpatterns = [path("progress/<str:key>/", progress_view, name="progress")]
