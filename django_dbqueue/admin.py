"""Admin pages: jobs with their state, failed jobs with retry, progress, and a queue overview."""

from __future__ import annotations

from typing import Any

from django.contrib import admin, messages
from django.core.exceptions import PermissionDenied
from django.db.models import QuerySet
from django.http import HttpRequest, HttpResponse, HttpResponseRedirect
from django.template.response import TemplateResponse
from django.urls import path, reverse
from django.utils.html import format_html
from django.utils.translation import ngettext
from django.views.decorators.http import require_POST

from . import payload
from .db import DbNow
from .models import FailedJob, Job, JobProgress
from .operations import job_state, queue_overview, release_expired, retry_failed, run_now


class StateFilter(admin.SimpleListFilter):
    title = "state"
    parameter_name = "state"

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, str]]:
        return [
            ("waiting", "waiting"),
            ("delayed", "delayed"),
            ("reserved", "reserved"),
            ("expired", "reservation expired"),
        ]

    def queryset(self, request: HttpRequest, queryset: QuerySet[Job]) -> QuerySet[Job]:
        value = self.value()
        if value == "waiting":
            return queryset.filter(reserved_at__isnull=True, available_at__lte=DbNow())
        if value == "delayed":
            return queryset.filter(reserved_at__isnull=True, available_at__gt=DbNow())
        if value in ("reserved", "expired"):
            expired = [job.pk for job in Job.objects.expired()]
            if value == "expired":
                return queryset.filter(pk__in=expired)
            return queryset.filter(reserved_at__isnull=False).exclude(pk__in=expired)
        return queryset


class ReadOnlyMixin:
    def has_add_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False


@admin.register(Job)
class JobAdmin(ReadOnlyMixin, admin.ModelAdmin):  # type: ignore[type-arg]
    list_display = [
        "id",
        "name",
        "queue",
        "state",
        "priority",
        "attempts",
        "available_at",
        "reserved_at",
        "reserved_by",
    ]
    list_filter = [StateFilter, "queue"]
    search_fields = ["name"]
    readonly_fields = [
        "id",
        "name",
        "queue",
        "priority",
        "attempts",
        "max_tries",
        "retry_after",
        "timeout",
        "available_at",
        "reserved_at",
        "reserved_by",
        "created_at",
        "pretty_payload",
    ]
    exclude = ["payload"]
    actions = ["run_now", "release_expired"]
    change_list_template = "admin/django_dbqueue/job/change_list.html"

    def get_queryset(self, request: HttpRequest) -> QuerySet[Job]:
        queryset: QuerySet[Job] = super().get_queryset(request).annotate(**{"db_now": DbNow()})
        return queryset

    @admin.display(description="state")
    def state(self, job: Job) -> str:
        return job_state(job, getattr(job, "db_now", None))

    @admin.display(description="payload")
    def pretty_payload(self, job: Job) -> str:
        return format_html("<pre>{}</pre>", payload.pretty(job.payload))

    def has_run_permission(self, request: HttpRequest) -> bool:
        return request.user.has_perm("django_dbqueue.change_job")

    @admin.action(description="Run selected jobs now", permissions=["run"])
    def run_now(self, request: HttpRequest, queryset: QuerySet[Job]) -> None:
        count = run_now(queryset)
        self.message_user(
            request, ngettext("%d job is available now.", "%d jobs are available now.", count) % count, messages.SUCCESS
        )

    @admin.action(description="Release expired reservations", permissions=["run"])
    def release_expired(self, request: HttpRequest, queryset: QuerySet[Job]) -> None:
        count = release_expired(queryset)
        self.message_user(
            request,
            ngettext("%d expired reservation was released.", "%d expired reservations were released.", count) % count,
            messages.SUCCESS,
        )

    def get_urls(self) -> list[Any]:
        return [
            path("overview/", self.admin_site.admin_view(self.overview_view), name="django_dbqueue_overview"),
            *super().get_urls(),
        ]

    def overview_view(self, request: HttpRequest) -> HttpResponse:
        if not self.has_view_permission(request):
            raise PermissionDenied
        context = {
            **self.admin_site.each_context(request),
            "title": "Queue overview",
            "opts": self.model._meta,
            "rows": queue_overview(),
            "jobs_url": reverse("admin:django_dbqueue_job_changelist"),
            "failed_url": reverse("admin:django_dbqueue_failedjob_changelist"),
        }
        return TemplateResponse(request, "admin/django_dbqueue/overview.html", context)


@admin.register(FailedJob)
class FailedJobAdmin(ReadOnlyMixin, admin.ModelAdmin):  # type: ignore[type-arg]
    list_display = ["id", "name", "queue", "attempts", "failed_at", "exception_class", "short_error"]
    list_filter = ["queue", "name", "exception_class", "failed_at"]
    search_fields = ["name", "error"]
    date_hierarchy = "failed_at"
    fields = (
        "id",
        "job_id",
        "name",
        "queue",
        "attempts",
        "exception_class",
        "created_at",
        "failed_at",
        "pretty_payload",
        "traceback",
    )
    readonly_fields = fields
    actions = ["retry_selected"]
    change_form_template = "admin/django_dbqueue/failedjob/change_form.html"

    @admin.display(description="error")
    def short_error(self, failed: FailedJob) -> str:
        summary = failed.error_summary
        return summary if len(summary) <= 120 else summary[:119] + "…"

    @admin.display(description="payload")
    def pretty_payload(self, failed: FailedJob) -> str:
        return format_html("<pre>{}</pre>", payload.pretty(failed.payload))

    @admin.display(description="error")
    def traceback(self, failed: FailedJob) -> str:
        return format_html("<pre>{}</pre>", failed.error)

    def has_retry_permission(self, request: HttpRequest) -> bool:
        opts = self.model._meta
        return request.user.has_perm(f"{opts.app_label}.change_{opts.model_name}") and request.user.has_perm(
            "django_dbqueue.add_job"
        )

    @admin.action(description="Retry selected failed jobs", permissions=["retry"])
    def retry_selected(self, request: HttpRequest, queryset: QuerySet[FailedJob]) -> None:
        count = retry_failed(queryset)
        self.message_user(
            request,
            ngettext("%d job was put back on the queue.", "%d jobs were put back on the queue.", count) % count,
            messages.SUCCESS,
        )

    def get_urls(self) -> list[Any]:
        return [
            path(
                "<int:pk>/retry/",
                self.admin_site.admin_view(require_POST(self.retry_view)),
                name="django_dbqueue_failedjob_retry",
            ),
            *super().get_urls(),
        ]

    def retry_view(self, request: HttpRequest, pk: int) -> HttpResponse:
        if not self.has_retry_permission(request):
            raise PermissionDenied
        if FailedJob.objects.retry([pk]):
            self.message_user(request, f"Failed job {pk} was put back on the queue.", messages.SUCCESS)
        else:
            self.message_user(request, f"Failed job {pk} no longer exists.", messages.WARNING)
        return HttpResponseRedirect(reverse("admin:django_dbqueue_failedjob_changelist"))

    def change_view(
        self, request: HttpRequest, object_id: str, form_url: str = "", extra_context: dict[str, Any] | None = None
    ) -> HttpResponse:
        extra = {**(extra_context or {}), "can_retry": self.has_retry_permission(request)}
        return super().change_view(request, object_id, form_url, extra_context=extra)


@admin.register(JobProgress)
class JobProgressAdmin(ReadOnlyMixin, admin.ModelAdmin):  # type: ignore[type-arg]
    list_display = ["key", "bar", "stage", "finished", "failed", "updated_at"]
    list_filter = ["finished", "failed"]
    search_fields = ["key", "stage"]

    @admin.display(description="percent")
    def bar(self, progress: JobProgress) -> str:
        color = "#ba2121" if progress.failed else "#417690"
        return format_html(
            '<div style="width:160px;background:#eee;border-radius:3px" title="{}%">'
            '<div style="width:{}%;background:{};height:12px;border-radius:3px"></div></div>',
            f"{progress.percent:.0f}",
            f"{progress.percent:.1f}",
            color,
        )
