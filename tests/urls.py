from django.contrib import admin
from django.urls import include, path

from tests.testapp import views

urlpatterns = [
    path("admin/", admin.site.urls),
    path("queue/", include("django_dbqueue.urls")),
    path("enqueue-async/", views.enqueue_async),
]
