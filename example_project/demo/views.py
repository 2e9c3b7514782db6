"""A page that starts a long chain of jobs and shows its progress live."""

from urllib.parse import urlencode

from django.http import Http404, HttpRequest, HttpResponse
from django.shortcuts import redirect, render
from django.urls import reverse
from django.views.decorators.http import require_GET, require_http_methods

from django_dbqueue import progress_token, set_progress

from . import jobs

# The session remembers the chains this browser started, newest last; only they get a progress page.
STARTED = "demo_started_chains"
REMEMBERED = 20


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
        started = [*request.session.get(STARTED, []), pipeline.progress_key][-REMEMBERED:]
        request.session[STARTED] = started
        return redirect("demo:progress", key=pipeline.progress_key)
    return render(request, "demo/index.html")


@require_GET
def progress(request: HttpRequest, key: str) -> HttpResponse:
    """A progress bar that polls django_dbqueue's JSON view for ``key`` (``chain:<id>``) with a progress token."""
    # Only the browser that started the chain may watch it. The JSON view
    # serves anonymous visitors nothing without a token, and a token opens
    # this one key, for PROGRESS_TOKEN_MAX_AGE seconds.
    if key not in request.session.get(STARTED, []):
        raise Http404("no chain with this key was started in this browser session")
    query = urlencode({"token": progress_token(key)})
    poll_url = f"{reverse('django_dbqueue:progress', kwargs={'key': key})}?{query}"
    return render(request, "demo/progress.html", {"key": key, "poll_url": poll_url})
