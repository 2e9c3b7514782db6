from django.contrib import admin
from django.urls import include, path

urlpatterns = [
    path("", include("demo.urls")),
    path("admin/", admin.site.urls),
    # The JSON progress view: /queue/progress/<key>/?token=<progress token>
    path("queue/", include("django_dbqueue.urls")),
]
