"""Middleware: code wrapped around every run of a job, inside its timeout.

A middleware is ``middleware(context, call_next)``: ``call_next()`` runs the rest of the stack and
returns the job's result; what the middleware returns or raises is the run's. ``DBQUEUE["MIDDLEWARE"]``
wraps every job, outermost first; a job's own ``@job(middleware=[...])`` runs inside those.
"""

from __future__ import annotations

import contextvars
import functools
import inspect
import logging
from collections.abc import Awaitable, Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any

from django.core.exceptions import ImproperlyConfigured
from django.core.signals import setting_changed
from django.dispatch import receiver
from django.utils.module_loading import import_string

from . import conf

if TYPE_CHECKING:
    from .context import JobContext

logger = logging.getLogger("django_dbqueue")

Middleware = Callable[["JobContext", Callable[[], Any]], Any]
# A middleware, or the dotted path of one.
MiddlewareEntry = Middleware | str


def resolve(entries: Iterable[MiddlewareEntry], where: str) -> tuple[Middleware, ...]:
    """Return ``entries`` with dotted paths imported; raise ImproperlyConfigured naming a bad one."""
    resolved = []
    for entry in entries:
        if isinstance(entry, str):
            try:
                entry = import_string(entry)
            except ImportError as exc:
                raise ImproperlyConfigured(f"the middleware {entry!r} in {where} cannot be imported: {exc}") from exc
        if not callable(entry):
            raise ImproperlyConfigured(f"the middleware {entry!r} in {where} is not callable")
        resolved.append(entry)
    return tuple(resolved)


def valid_list(value: Any) -> bool:
    """Tell whether ``value`` is a list of middleware that all import (for the system check)."""
    if not isinstance(value, (list, tuple)):
        return False
    try:
        resolve(value, "DBQUEUE['MIDDLEWARE']")
    except ImproperlyConfigured:
        return False
    return True


@functools.cache
def from_settings() -> tuple[Middleware, ...]:
    """Return ``DBQUEUE["MIDDLEWARE"]`` resolved; cached until the setting changes."""
    return resolve(conf.get("MIDDLEWARE") or (), "DBQUEUE['MIDDLEWARE']")


@functools.lru_cache(maxsize=1024)
def for_job(name: str, entries: tuple[MiddlewareEntry, ...]) -> tuple[Middleware, ...]:
    """Return a job's own middleware resolved; cached per job name and entries."""
    return resolve(entries, f"@job(middleware=...) of {name}")


@receiver(setting_changed)
def _clear_cache(*, setting: str, **kwargs: Any) -> None:
    if setting == "DBQUEUE":
        from_settings.cache_clear()


def run(stack: Sequence[Middleware], context: JobContext, call: Callable[[], Any]) -> Any:
    """Call ``call`` inside ``stack``, the first middleware outermost; return its result."""
    for middleware in reversed(stack):
        call = functools.partial(middleware, context, call)
    return call()


def for_loop(stack: Sequence[Middleware]) -> tuple[Middleware, ...] | None:
    """The async form of ``stack``, for an ``async def`` job on the worker's event loop; None if a
    middleware in it has none (the job then runs in a thread). An ``async def`` middleware is its
    own async form; a sync one may name its twin in an ``async_form`` attribute (as ``log_context``)."""
    forms = []
    for middleware in stack:
        form = middleware if inspect.iscoroutinefunction(middleware) else getattr(middleware, "async_form", None)
        if form is None:
            return None
        forms.append(form)
    return tuple(forms)


async def arun(stack: Sequence[Middleware], context: JobContext, call: Callable[[], Awaitable[Any]]) -> Any:
    """Await ``call()`` inside the async ``stack`` (see ``for_loop``); return its result."""
    for middleware in reversed(stack):
        call = functools.partial(middleware, context, call)
    return await call()


_current: contextvars.ContextVar[JobContext | None] = contextvars.ContextVar("django_dbqueue_job", default=None)


def log_context(context: JobContext, call_next: Callable[[], Any]) -> Any:
    """Make the running job's id, name and attempt visible to ``JobLogFilter``."""
    token = _current.set(context)
    try:
        return call_next()
    finally:
        _current.reset(token)


async def _log_context_async(context: JobContext, call_next: Callable[[], Awaitable[Any]]) -> Any:
    # Each asyncio task runs in a copy of the context: the variable is the task's own.
    token = _current.set(context)
    try:
        return await call_next()
    finally:
        _current.reset(token)


log_context.async_form = _log_context_async  # type: ignore[attr-defined]


class JobLogFilter(logging.Filter):
    """Add ``job_id``, ``job_name`` and ``job_attempt`` to each log record (empty outside a job);
    needs ``log_context`` in ``DBQUEUE["MIDDLEWARE"]``."""

    def filter(self, record: logging.LogRecord) -> bool:
        context = _current.get()
        record.job_id = context.job_id if context is not None else ""
        record.job_name = context.name if context is not None else ""
        record.job_attempt = context.attempt if context is not None else ""
        return True
