"""The jobs about an object, on its change page: a mixin for a project's own ``ModelAdmin``.

    class OrderAdmin(JobsAboutMixin, admin.ModelAdmin): ...

The page lists the jobs whose arguments hold the object (``about.jobs_for``) with their states: a
kind to the users who may view it (``view_job``, ``view_failedjob``, ``view_finishedjob``), with
Retry for a failed job (``change_failedjob`` and ``add_job``, as the failed jobs' page asks) and
Cancel for one in the queue (``cancel_job``). The buttons POST, with the page's CSRF token, to a
view of this admin that checks the permissions and that the job is about the object.
"""

from __future__ import annotations

import dataclasses
from datetime import datetime
from typing import Any

from django.contrib import messages
from django.contrib.admin.utils import quote, unquote
from django.core.exceptions import PermissionDenied
from django.db.models import Model
from django.http import Http404, HttpRequest, HttpResponse, HttpResponseRedirect
from django.urls import NoReverseMatch, path, reverse
from django.views.decorators.http import require_POST

from .. import about, lifecycle
from ..models import CANCELLED_CLASS, FailedJob, FinishedJob, Job
from ..operations import cancel_jobs, job_state

RETRY_PERMISSIONS = ("django_dbqueue.change_failedjob", "django_dbqueue.add_job")
CANCEL_PERMISSIONS = ("django_dbqueue.cancel_job",)


@dataclasses.dataclass(frozen=True)
class Line:
    """One job of the table: ``action`` is the button it shows ("retry", "cancel" or none)."""

    job_id: int
    link: str
    name: str
    queue: str
    state: str
    attempts: int
    enqueued_at: datetime | None
    ended_at: datetime | None
    note: str = ""
    action: str = ""


class JobsAboutMixin:
    """Show the jobs about the object on its change page, with Retry and Cancel. A ``ModelAdmin``
    that has its own ``change_form_template`` includes ``admin/django_dbqueue/about/jobs.html``
    inside its form and ``about/form.html`` after it instead (docs/howto/jobs-about-objects.md)."""

    # Jobs listed of each kind (in the queue, failed, finished), newest first.
    jobs_about_limit = 20
    change_form_template = "admin/django_dbqueue/about/change_form.html"

    admin_site: Any
    model: type[Model]

    def get_urls(self) -> list[Any]:
        opts = self.model._meta
        view = self.admin_site.admin_view(require_POST(self.jobs_about_view))
        name = f"{opts.app_label}_{opts.model_name}_jobs_about"
        return [path("<path:object_id>/jobs-about/", view, name=name), *super().get_urls()]  # type: ignore[misc]

    def render_change_form(
        self, request: HttpRequest, context: dict[str, Any], add: bool = False, change: bool = False,
        form_url: str = "", obj: Model | None = None,
    ) -> HttpResponse:  # fmt: skip
        if obj is not None and obj.pk is not None:
            context["jobs_about"] = self.jobs_about_context(request, obj)
        response: HttpResponse = super().render_change_form(request, context, add, change, form_url, obj)  # type: ignore[misc]
        return response

    def jobs_about_context(self, request: HttpRequest, obj: Model) -> dict[str, Any]:
        """What ``about/jobs.html`` shows: the lines by kind, and where its buttons post."""
        user = request.user
        view = {kind: user.has_perm(f"django_dbqueue.view_{kind}") for kind in ("job", "failedjob", "finishedjob")}
        if not any(view.values()):
            return {"shown": False}
        found = about.jobs_for(obj, limit=self.jobs_about_limit, history=view["finishedjob"])
        can_retry, can_cancel = user.has_perms(RETRY_PERMISSIONS), user.has_perms(CANCEL_PERMISSIONS)
        queued = [self._queued(request, job, can_cancel) for job in found.queued_rows] if view["job"] else []
        failed = [self._failed(request, row, can_retry) for row in found.failed_rows] if view["failedjob"] else []
        # A failed job's history row says what its failed row says: listed once, where it can be retried.
        listed = {line.job_id for line in failed}
        kept = [self._finished(request, row) for row in found.finished if row.job_id not in listed]
        sections = [("In the queue", queued), ("Failed or cancelled", failed), ("Finished (history)", kept)]
        opts = self.model._meta
        action = reverse(f"{self.admin_site.name}:{opts.app_label}_{opts.model_name}_jobs_about", args=[quote(obj.pk)])
        return {
            "sections": [(title, lines) for title, lines in sections if lines],
            "shown": True,
            "limit": self.jobs_about_limit,
            "action": action,
            "title": f"Jobs about this {opts.verbose_name}",
        }

    def _queued(self, request: HttpRequest, job: Job, can_cancel: bool) -> Line:
        return Line(
            job.pk, self._link(request, Job, job.pk), job.name, job.queue, job_state(job, job.db_now), job.attempts,
            job.created_at, None, action="cancel" if can_cancel else "",
        )  # fmt: skip

    def _failed(self, request: HttpRequest, row: FailedJob, can_retry: bool) -> Line:
        return Line(
            row.job_id, self._link(request, FailedJob, row.pk), row.name, row.queue,
            "cancelled" if row.exception_class == CANCELLED_CLASS else "failed", row.attempts, row.created_at,
            row.failed_at, row.error_summary, "retry" if can_retry else "",
        )  # fmt: skip

    def _finished(self, request: HttpRequest, row: FinishedJob) -> Line:
        return Line(
            row.job_id, self._link(request, FinishedJob, row.pk), row.name, row.queue, row.outcome, row.attempts,
            row.created_at, row.finished_at, row.error_summary,
        )  # fmt: skip

    def _link(self, request: HttpRequest, model: type[Model], pk: Any) -> str:
        """The row's page on this admin site, if it has one the user may view; else ""."""
        site = self.admin_site
        if not site.is_registered(model) or not site.get_model_admin(model).has_view_permission(request):
            return ""
        try:
            return reverse(f"{site.name}:django_dbqueue_{model._meta.model_name}_change", args=[pk])
        except NoReverseMatch:
            return ""

    def jobs_about_view(self, request: HttpRequest, object_id: str) -> HttpResponse:
        """Retry or cancel one job about the object (``jobs_about`` = "retry:<job id>" or "cancel:<job id>")."""
        obj = self.get_object(request, unquote(object_id))  # type: ignore[attr-defined]
        if obj is None:
            raise Http404(f"no {self.model._meta.verbose_name} with the id {object_id!r}")
        if not self.has_view_or_change_permission(request, obj):  # type: ignore[attr-defined]
            raise PermissionDenied
        action, _, number = request.POST.get("jobs_about", "").partition(":")
        if action not in ("retry", "cancel") or not number.isdigit():
            return HttpResponse("jobs_about must be retry:<job id> or cancel:<job id>", status=400)
        if not request.user.has_perms(RETRY_PERMISSIONS if action == "retry" else CANCEL_PERMISSIONS):
            raise PermissionDenied
        job_id = int(number)
        if not about.is_about(obj, job_id):
            messages.error(request, f"Job {job_id} is not about this {self.model._meta.verbose_name}.")
        elif action == "retry":
            retried = lifecycle.retry(FailedJob.objects.filter(job_id=job_id))
            if retried:
                messages.success(request, f"Job {job_id} was put back on the queue as job {retried[0].pk}.")
            else:
                messages.warning(request, f"Job {job_id} is no longer failed.")
        else:
            reason = f"cancelled in the admin by {request.user.get_username()}"
            outcome = cancel_jobs([job_id], reason=reason)[job_id]
            if outcome == "cancelled":
                messages.success(request, f"Job {job_id} was cancelled; it is listed with the failed jobs.")
            elif outcome == "requested":
                messages.success(request, f"Job {job_id} is running: it was asked to stop when it next checks.")
            else:
                messages.warning(request, f"Job {job_id} had finished already.")
        opts = self.model._meta
        return HttpResponseRedirect(
            reverse(f"{self.admin_site.name}:{opts.app_label}_{opts.model_name}_change", args=[quote(obj.pk)])
        )
