"""Views used by the tests."""

from django.http import HttpRequest, JsonResponse

from . import jobs


async def enqueue_async(request: HttpRequest) -> JsonResponse:
    """An async view that enqueues a job and reads its handle back, without blocking its event loop."""
    handle = await jobs.keep_result.aenqueue(int(request.GET.get("x", "1")))
    await handle.arefresh()
    return JsonResponse({"id": handle.id, "status": handle.status})
