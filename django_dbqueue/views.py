"""A JSON view of progress that a project can mount (see ``django_dbqueue.urls``)."""

from __future__ import annotations

from django.http import HttpRequest, JsonResponse
from django.views.decorators.http import require_GET

from .progress import get_progress


@require_GET
def progress_view(request: HttpRequest, key: str) -> JsonResponse:
    """Return the progress stored under ``key``: a job id, or ``chain:<id>``."""
    progress = get_progress(key)
    if progress is None:
        return JsonResponse({"key": key, "error": "no progress is stored under this key"}, status=404)
    response = JsonResponse(progress)
    response["Cache-Control"] = "no-store"
    return response
