"""Jobs that wait (bench/waiting.py): 50 ms of sleep, or an HTTP GET to the bench's local server.

Registered on import; bench/benchapp/apps.py imports this module.
"""

from bench.drivers import waiting_common
from django_dbqueue import job


@job(name="bench.wait_sync")
def wait_sync(i: int) -> None:
    """time.sleep(BENCH_WAIT_SECONDS), then note the finish."""
    waiting_common.wait_sync(i)


@job(name="bench.wait_async")
async def wait_async(i: int) -> None:
    """await asyncio.sleep(BENCH_WAIT_SECONDS), then note the finish."""
    await waiting_common.wait_async(i)


@job(name="bench.http_sync")
def http_sync(i: int) -> None:
    """A GET to BENCH_WAIT_URL with http.client (the server answers after the wait)."""
    waiting_common.http_sync(i)


@job(name="bench.http_async")
async def http_async(i: int) -> None:
    """The same GET with asyncio streams."""
    await waiting_common.http_async(i)


KINDS = {"sync": wait_sync, "async": wait_async, "http_sync": http_sync, "http_async": http_async}
