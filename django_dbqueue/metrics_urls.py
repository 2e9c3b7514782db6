"""The monitoring views; opt-in: mount with ``path("queue/", include("django_dbqueue.metrics_urls"))``.

``metrics/`` serves the Prometheus / OpenMetrics figures (metrics.py, needs the
``prometheus`` extra) and ``health/`` the health checks as JSON (health.py), to
a client that sends ``DBQUEUE["METRICS_TOKEN"]`` (``Authorization: Bearer
<token>``, or ``?token=``), or a user with the ``django_dbqueue.view_job``
permission (and, for the metrics, which count failures, ``view_failedjob``).
Reverse them as ``dbqueue_metrics:metrics`` and ``dbqueue_metrics:health``.
"""

from django.urls import path

from .health import health_view
from .metrics import metrics_view

app_name = "dbqueue_metrics"
urlpatterns = [
    path("metrics/", metrics_view, name="metrics"),
    path("health/", health_view, name="health"),
]
