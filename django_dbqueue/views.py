"""A JSON view of progress that a project can mount (see ``django_dbqueue.urls``).

Job ids are sequential, so the view never serves progress to anyone who asks:
the caller needs the ``django_dbqueue.view_jobprogress`` permission (the
``JobProgress`` model's view permission), or a progress token for that one key
(``django_dbqueue.progress_token``), sent as ``Authorization: Bearer <token>``
or, where no header can be set, in the ``token`` query parameter (which access
logs keep: the header is the one to prefer).
"""

from __future__ import annotations

from typing import Any

from django.core import signing
from django.http import HttpRequest, JsonResponse
from django.views.decorators.http import require_GET

from .metrics import sent_token
from .progress import get_progress, key_from_token, shown_error

PERMISSION = "django_dbqueue.view_jobprogress"


def _json(data: dict[str, Any], status: int = 200) -> JsonResponse:
    response = JsonResponse(data, status=status)
    # Progress changes every moment and may be private: no cache keeps a copy.
    response["Cache-Control"] = "no-store"
    return response


def _refusal(request: HttpRequest, key: str) -> JsonResponse | None:
    """Return the response that refuses ``request`` the progress of ``key``, or None if it may see it."""
    user = getattr(request, "user", None)
    if user is not None and user.has_perm(PERMISSION):
        return None
    token = sent_token(request)
    if token is not None:
        try:
            token_key = key_from_token(token)
        except signing.SignatureExpired:
            return _json({"detail": "the progress token has expired"}, status=403)
        except signing.BadSignature:
            return _json({"detail": "the progress token is not valid"}, status=403)
        if token_key != key:
            return _json({"detail": "the progress token is for another key"}, status=403)
        return None
    if user is None or not user.is_authenticated:
        return _json(
            {"detail": "log in, or send a progress token as 'Authorization: Bearer <token>' (or ?token=)"},
            status=401,
        )
    return _json({"detail": f"the {PERMISSION} permission is required"}, status=403)


@require_GET
def progress_view(request: HttpRequest, key: str) -> JsonResponse:
    """Return the progress of ``key`` (a job id or ``chain:<id>``) to a user with view_jobprogress or a token for it.

    Refusals come before the lookup, so a caller who may not see ``key`` cannot
    learn whether it exists. The error text is served only with
    ``PROGRESS_SHOW_ERROR``, and then only its last line.
    """
    refusal = _refusal(request, key)
    if refusal is not None:
        return refusal
    # No key holds NUL, and PostgreSQL refuses it in a query's text.
    progress = None if "\x00" in key else get_progress(key)
    if progress is None:
        return _json({"key": key, "detail": "no progress is stored under this key"}, status=404)
    progress["error"] = shown_error(progress["error"])
    return _json(progress)
