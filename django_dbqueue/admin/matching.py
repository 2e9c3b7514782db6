"""The "all matching" pages: a bulk action over a change list's whole filter (not only the page shown),
counted and confirmed first, then done a chunk per transaction (``bulk``); and a filter by text."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from django import forms
from django.contrib import admin, messages
from django.contrib.admin.options import IncorrectLookupParameters
from django.contrib.admin.views.main import ERROR_FLAG, PAGE_VAR
from django.core.exceptions import PermissionDenied
from django.db.models import QuerySet
from django.http import HttpRequest, HttpResponse, HttpResponseBadRequest, HttpResponseRedirect

from .. import bulk
from ..validation import MAX_ID


@dataclasses.dataclass(frozen=True)
class BulkAction:
    """One "all matching" action of a change list, its words and what it does."""

    # Whether the user may do it (a ``has_<action>_permission`` method, bound).
    allowed: Callable[[HttpRequest], bool]
    # Counts the rows of a change list's selection it would change (ids up to a confirmed last id).
    count: Callable[[QuerySet[Any], int | None], bulk.Counted]
    # Does it to the rows counted; returns how many it changed.
    act: Callable[[HttpRequest, bulk.Counted], int]
    title: str  # Retry all matching failed jobs
    verb: str  # Retry
    nouns: tuple[str, str]  # failed job, failed jobs
    done: tuple[str, str]  # "%s job was put back on the queue.", "%s jobs were ..." (the count)
    # Said on the confirmation page below the count (rows the action leaves alone), from the selection.
    note: Callable[[QuerySet[Any]], str] = lambda selection: ""


class ConfirmForm(forms.Form):
    last_id = forms.IntegerField(min_value=0, max_value=MAX_ID)


def matching_view(model_admin: Any, request: HttpRequest, action: BulkAction) -> HttpResponse:
    """GET: the count of what ``action`` would change in the change list's current filter, and a form
    to confirm it (nothing changes). POST (the form, CSRF-checked by the admin): do it to the rows
    counted, a chunk per transaction, and go back to the list with how many were changed."""
    if not action.allowed(request):
        raise PermissionDenied
    back = model_admin.url(f"{model_admin.model._meta.model_name}_changelist") + _query_string(request)
    try:
        changelist = model_admin.get_changelist_instance(request)
    except IncorrectLookupParameters:
        return HttpResponseRedirect(f"{back}{'&' if '?' in back else '?'}{ERROR_FLAG}=1")
    selection = changelist.queryset
    if request.method == "POST":
        form = ConfirmForm(request.POST)
        if not form.is_valid():
            return HttpResponseBadRequest("The confirmation is missing or malformed: nothing was changed.")
        counted = action.count(selection, form.cleaned_data["last_id"])
        done = action.act(request, counted) if counted.count else 0
        messages.success(request, action.done[done != 1] % f"{done:,}")
        if done < counted.count:
            messages.warning(
                request,
                f"{counted.count - done:,} of the {counted.count:,} {action.nouns[1]} counted had changed since "
                "(retried, reserved or deleted meanwhile) and were left alone.",
            )
        return HttpResponseRedirect(back)
    counted = action.count(selection, None)
    page: HttpResponse = model_admin.page(
        request,
        "confirm_matching",
        action.title,
        action=action,
        counted=counted,
        count=f"{counted.count:,}",
        noun=action.nouns[counted.count != 1],
        described=describe(changelist),
        note=action.note(selection),
        back=back,
    )
    return page


def describe(changelist: Any) -> str:
    """A change list's filter in words: ``queue=emails, error contains 'timeout'``; ``no filter``."""
    parts = []
    labels = {getattr(spec, "parameter_name", ""): getattr(spec, "describe", None) for spec in changelist.filter_specs}
    for name, values in changelist.get_filters_params().items():
        for value in values:
            label = labels.get(name)
            parts.append(label(value) if label else _lookup(name, value))
    if changelist.query:
        parts.append(f"search {changelist.query!r}")
    return ", ".join(parts) or "no filter (every row)"


# How a field filter's lookups read: ``queue__exact=emails`` as ``queue=emails``.
_LOOKUP_WORDS = {"exact": "=", "gte": " >= ", "lt": " < ", "isnull": " is null: "}


def _lookup(name: str, value: str) -> str:
    field, _, lookup = name.partition("__")
    return f"{field}{_LOOKUP_WORDS[lookup]}{value}" if lookup in _LOOKUP_WORDS else f"{name}={value}"


def _query_string(request: HttpRequest) -> str:
    """The change list's query string, without its page (a bulk action's page is the whole filter)."""
    params = request.GET.copy()
    for name in (PAGE_VAR, ERROR_FLAG):
        params.pop(name, None)
    return f"?{params.urlencode()}" if params else ""


class TextFilter(admin.SimpleListFilter):
    """A list filter by a text the user types (``parameter_name=...``), in a search box of the sidebar."""

    template = "admin/django_dbqueue/text_filter.html"

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, str]]:
        return []

    def has_output(self) -> bool:
        return True

    def choices(self, changelist: Any) -> Any:
        kept = [
            (name, value)
            for name, values in changelist.filter_params.items()
            if name != self.parameter_name
            for value in values
        ]
        yield {"parameter": self.parameter_name, "value": self.value() or "", "kept": kept}

    def describe(self, value: str) -> str:
        return f"{self.title} {value!r}"
