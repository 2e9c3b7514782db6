"""Pages that start a long chain of jobs, or a batch of them, and show its progress live."""

from django.http import Http404, HttpRequest, HttpResponse
from django.shortcuts import redirect, render
from django.urls import reverse
from django.views.decorators.http import require_GET, require_http_methods, require_POST

from django_dbqueue import progress_token, set_progress

from . import jobs

# The session remembers the chains and batches this browser started (their
# progress keys), newest last; only they get a progress page.
STARTED = "demo_started"
REMEMBERED = 20


def _remember(request: HttpRequest, key: str) -> None:
    request.session[STARTED] = [*request.session.get(STARTED, []), key][-REMEMBERED:]


@require_http_methods(["GET", "POST"])
def index(request: HttpRequest) -> HttpResponse:
    """GET: the start buttons. POST: enqueue a "render a video" chain and go to its progress page."""
    if request.method == "POST":
        title = request.POST.get("title", "").strip()[:100] or "Untitled"
        pipeline = jobs.render_video(title)
        # Stored before the first step exists, so no worker can have written a
        # newer value yet: the page shows "waiting for a worker" until one starts.
        set_progress(pipeline.progress_key, 0, "waiting for a worker")
        pipeline.enqueue()
        _remember(request, pipeline.progress_key)
        return redirect("demo:progress", key=pipeline.progress_key)
    return render(request, "demo/index.html", {"images": jobs.IMAGES})


@require_POST
def start_batch(request: HttpRequest) -> HttpResponse:
    """Enqueue a "process 40 images" batch and go to its progress page."""
    album = request.POST.get("album", "").strip()[:100] or "Untitled"
    # The batch's progress is its counters (batch:<id>): "0 of 40 done" from the
    # moment it is stored, so nothing needs to be written for the page beforehand.
    handle = jobs.process_album(album).enqueue()
    _remember(request, handle.progress_key)
    return redirect("demo:progress", key=handle.progress_key)


@require_GET
def progress(request: HttpRequest, key: str) -> HttpResponse:
    """A progress bar that polls django_dbqueue's JSON view for ``key`` (``chain:<id>`` or
    ``batch:<id>``) with a progress token."""
    # Only the browser that started the chain or batch may watch it. The JSON
    # view serves anonymous visitors nothing without a token, and a token opens
    # this one key, for PROGRESS_TOKEN_MAX_AGE seconds.
    if key not in request.session.get(STARTED, []):
        raise Http404("nothing with this key was started in this browser session")
    # The page sends the token as "Authorization: Bearer <token>": in the URL it
    # would be written to the access log.
    poll_url = reverse("django_dbqueue:progress", kwargs={"key": key})
    template = "demo/batch_progress.html" if key.startswith("batch:") else "demo/progress.html"
    return render(request, template, {"key": key, "poll_url": poll_url, "token": progress_token(key)})
