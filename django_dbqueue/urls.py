"""Mount with ``path("queue/", include("django_dbqueue.urls"))``.

``progress/<key>/`` serves a user with the ``django_dbqueue.view_jobprogress``
permission, or anyone who sends a progress token for that key
(``django_dbqueue.progress_token(key)``) as ``Authorization: Bearer <token>``
(or ``?token=``, which access logs keep).
"""

from django.urls import path

from .views import progress_view

app_name = "django_dbqueue"
urlpatterns = [path("progress/<str:key>/", progress_view, name="progress")]
