"""The example project's own check: its fixed SECRET_KEY is for DEBUG on a laptop only."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from django.conf import settings
from django.core.checks import CheckMessage, Error


def check_secret_key(app_configs: Sequence[Any] | None = None, **kwargs: Any) -> list[CheckMessage]:
    """Refuse the example's published SECRET_KEY once DEBUG is off: anyone could sign sessions and progress tokens."""
    if settings.DEBUG or settings.SECRET_KEY != getattr(settings, "INSECURE_SECRET_KEY", None):
        return []
    return [
        Error(
            "DEBUG is off, but SECRET_KEY is the example project's published key: anyone can forge "
            "sessions, CSRF tokens and progress tokens with it.",
            hint="Set DJANGO_SECRET_KEY (python -c 'import secrets; print(secrets.token_urlsafe(50))'), "
            "or DJANGO_DEBUG=1 on your own machine.",
            id="demo.E001",
        )
    ]
