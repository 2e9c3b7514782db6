"""A page that starts a long chain of jobs and shows its progress live."""

from django.http import HttpRequest, HttpResponse
from django.shortcuts import redirect, render
from django.urls import reverse
from django.views.decorators.http import require_GET, require_http_methods

from django_dbqueue import set_progress

from . import jobs


@require_http_methods(["GET", "POST"])
def index(request: HttpRequest) -> HttpResponse:
    """GET: the start button. POST: enqueue a "render a video" chain and go to its progress page."""
    if request.method == "POST":
        title = request.POST.get("title", "").strip()[:100] or "Untitled"
        pipeline = jobs.render_video(title)
        # Stored before the first step exists, so no worker can have written a
        # newer value yet: the page shows "waiting for a worker" until one starts.
        set_progress(pipeline.progress_key, 0, "waiting for a worker")
        pipeline.enqueue()
        return redirect("demo:progress", key=pipeline.progress_key)
    return render(request, "demo/index.html")


@require_GET
def progress(request: HttpRequest, key: str) -> HttpResponse:
    """A progress bar that polls django_dbqueue's JSON view for ``key`` (``chain:<id>``)."""
    # Chain ids are random (uuid4), so knowing the URL is the only key to it. A real
    # project would check that the chain belongs to request.user, here and in front
    # of the JSON view.
    poll_url = reverse("django_dbqueue:progress", kwargs={"key": key})
    return render(request, "demo/progress.html", {"key": key, "poll_url": poll_url})
