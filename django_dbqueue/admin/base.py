"""What the admin's pages share: read-only model admins, a filter by state, permissions by codename."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import django
from django.contrib import admin
from django.contrib.admin.views.main import ChangeList
from django.db.models import Model, QuerySet
from django.http import HttpRequest, HttpResponse, HttpResponseRedirect
from django.template.response import TemplateResponse
from django.urls import reverse
from django.utils.html import format_html

from .. import payload

# How this Django marks up the admin's breadcrumbs, which its CSS styles: a list (<ol> of <li>,
# the page's with aria-current) from Django 6.1 on, a <div> of links in 6.0 and 5.2.
LIST_BREADCRUMBS = django.VERSION >= (6, 1)


class StateFilter(admin.SimpleListFilter):
    """A list filter by state; ``states``: each value's label and what selects its rows."""

    title = parameter_name = "state"
    states: dict[str, tuple[str, Callable[[Any], QuerySet[Any]]]]

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, str]]:
        return [(value, label) for value, (label, _) in self.states.items()]

    def queryset(self, request: HttpRequest, queryset: QuerySet[Any]) -> QuerySet[Any]:
        value = self.value()
        return self.states[value][1](queryset) if value in self.states else queryset


class DeferringChangeList(ChangeList):
    def get_queryset(self, request: HttpRequest, exclude_parameters: Any = None) -> QuerySet[Any]:
        queryset: QuerySet[Any] = super().get_queryset(request, exclude_parameters)
        return queryset.defer(*getattr(self.model_admin, "changelist_defer", ()))


class ReadOnlyAdmin(admin.ModelAdmin):  # type: ignore[type-arg]
    """A model admin for rows only the library writes: nobody adds or edits one; actions and buttons change them."""

    # Big texts no column shows, left out of the change list's query.
    changelist_defer: Sequence[str] = ()

    def has_add_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def get_changelist(self, request: HttpRequest, **kwargs: Any) -> type[ChangeList]:
        return DeferringChangeList

    def may_view(self, request: HttpRequest, model: type[Model]) -> bool:
        """Whether the user may view ``model`` on this admin site (not if it is not registered)."""
        site = self.admin_site
        return site.is_registered(model) and bool(site.get_model_admin(model).has_view_permission(request))

    def page(self, request: HttpRequest, template: str, title: str, **context: Any) -> HttpResponse:
        """Render this app's admin page ``template`` with the site's context (the header, the sidebar)
        and the breadcrumbs Home, the app, ``title`` (``breadcrumbs.html``, in this Django's markup)."""
        context = {
            **self.admin_site.each_context(request),
            "title": title,
            "opts": self.model._meta,
            "app_url": reverse(f"{self.admin_site.name}:app_list", kwargs={"app_label": self.model._meta.app_label}),
            "list_breadcrumbs": LIST_BREADCRUMBS,
            **context,
        }
        return TemplateResponse(request, f"admin/django_dbqueue/{template}.html", context)

    def url(self, name: str, *args: Any) -> str:
        """This site's URL of this app's page ``name`` (``job_changelist``, ``overview`` ...)."""
        return reverse(f"{self.admin_site.name}:django_dbqueue_{name}", args=args)

    def redirect(self, name: str, *args: Any) -> HttpResponse:
        return HttpResponseRedirect(self.url(name, *args))


def pretty_payload(text: str) -> str:
    """A stored payload as indented JSON in a ``<pre>``; as stored when it is nested deeper than the
    parser goes (a row written by raw SQL may be)."""
    try:
        return format_html("<pre>{}</pre>", payload.pretty(text))
    except RecursionError:
        return format_html("<pre>{}</pre>", text)


def permission(*codenames: str) -> Callable[[Any, HttpRequest], bool]:
    """A ``has_<action>_permission`` method: whether the user has each of this app's ``codenames``."""

    def has_permission(self: Any, request: HttpRequest) -> bool:
        return request.user.has_perms([f"django_dbqueue.{codename}" for codename in codenames])

    return has_permission


class GoneError(Exception):
    """A row chosen for deletion changed before the DELETE ran (a job was reserved, a batch reopened);
    raised inside the delete view's transaction, so its log entry is rolled back."""
