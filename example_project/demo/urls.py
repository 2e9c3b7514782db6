from django.urls import path

from . import views

app_name = "demo"
urlpatterns = [
    path("", views.index, name="index"),
    path("batch/", views.start_batch, name="start_batch"),
    path("progress/<str:key>/", views.progress, name="progress"),
]
