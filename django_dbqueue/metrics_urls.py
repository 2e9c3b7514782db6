"""The monitoring views, opt-in: ``path("queue/", include("django_dbqueue.metrics_urls"))``.

``metrics/`` (metrics.py, needs the ``prometheus`` extra) and ``health/`` (health.py, JSON), reversed
as ``dbqueue_metrics:metrics`` and ``dbqueue_metrics:health``; metrics.py says who may read them.
"""

from django.urls import path

from .health import health_view
from .metrics import metrics_view

app_name = "dbqueue_metrics"
urlpatterns = [
    path("metrics/", metrics_view, name="metrics"),
    path("health/", health_view, name="health"),
]
