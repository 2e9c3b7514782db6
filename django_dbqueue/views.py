"""A JSON view of progress that a project can mount (see ``django_dbqueue.urls``).

Job ids are sequential, so the caller needs the ``view_jobprogress`` permission or a progress token
for that one key (``progress_token``), sent as ``Authorization: Bearer <token>`` or, where no header
can be set, in the ``token`` query parameter (which access logs keep: prefer the header).
"""

from __future__ import annotations

from django.core import signing
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.views.decorators.http import require_GET

from .metrics import no_store, sent_token
from .progress import get_progress, key_from_token, shown_error

PERMISSION = "django_dbqueue.view_jobprogress"


def _refusal(request: HttpRequest, key: str) -> tuple[int, str] | None:
    """Return ``(status, reason)`` refusing ``request`` the progress of ``key``, or None if it may see it."""
    user = getattr(request, "user", None)
    if user is not None and user.has_perm(PERMISSION):
        return None
    token = sent_token(request)
    if token is not None:
        try:
            token_key = key_from_token(token)
        except signing.SignatureExpired:
            return 403, "the progress token has expired"
        except signing.BadSignature:
            return 403, "the progress token is not valid"
        return None if token_key == key else (403, "the progress token is for another key")
    if user is None or not user.is_authenticated:
        return 401, "log in, or send a progress token as 'Authorization: Bearer <token>' (or ?token=)"
    return 403, f"the {PERMISSION} permission is required"


@require_GET
def progress_view(request: HttpRequest, key: str) -> HttpResponse:
    """Return the progress of ``key`` (a job id or ``chain:<id>``) to a user with view_jobprogress or a token for it.
    Refusals come before the lookup, so a caller who may not see ``key`` cannot learn whether it
    exists. The error text is served only with ``PROGRESS_SHOW_ERROR``, and then only its last line."""
    refusal = _refusal(request, key)
    if refusal is not None:
        return no_store(JsonResponse({"detail": refusal[1]}, status=refusal[0]))
    # No key holds NUL, and PostgreSQL refuses it in a query's text.
    progress = None if "\x00" in key else get_progress(key)
    if progress is None:
        return no_store(JsonResponse({"key": key, "detail": "no progress is stored under this key"}, status=404))
    progress["error"] = shown_error(progress["error"])
    return no_store(JsonResponse(progress))
