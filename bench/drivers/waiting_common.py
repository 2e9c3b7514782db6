"""What the jobs that wait (bench/waiting.py) share, in every system's environment: standard library only.

Every job waits (``time.sleep`` / ``await asyncio.sleep``, or an HTTP GET to the bench's local
server, which answers after the same wait), then appends ``index time.time()`` to
``BENCH_WAIT_FILE``: the orchestrator counts finished jobs, and times the steady rate, from
that file.

    BENCH_WAIT_FILE      where finished jobs are recorded (unset: not recorded)
    BENCH_WAIT_SECONDS   how long a job waits (0.05)
    BENCH_WAIT_URL       the local server of the HTTP variants (http://127.0.0.1:PORT/)
"""

from __future__ import annotations

import asyncio
import http.client
import os
import time
from urllib.parse import urlsplit


def wait_seconds() -> float:
    return float(os.environ.get("BENCH_WAIT_SECONDS", "0.05"))


def record(i: int) -> None:
    """Note that job ``i`` finished (one short O_APPEND write: whole lines even from many processes)."""
    path = os.environ.get("BENCH_WAIT_FILE")
    if path:
        with open(path, "a") as out:
            out.write(f"{i} {time.time()!r}\n")


def _target() -> tuple[str, int, str]:
    url = urlsplit(os.environ["BENCH_WAIT_URL"])
    return url.hostname or "127.0.0.1", url.port or 80, url.path or "/"


def http_get_sync(i: int) -> None:
    """One GET on a new connection with http.client; the server answers after the wait."""
    host, port, path = _target()
    conn = http.client.HTTPConnection(host, port, timeout=30)
    try:
        conn.request("GET", f"{path}?job={i}")
        response = conn.getresponse()
        response.read()
        if response.status != 200:
            raise RuntimeError(f"the bench's server answered {response.status}")
    finally:
        conn.close()


async def http_get_async(i: int) -> None:
    """The same GET with asyncio streams (no client library)."""
    host, port, path = _target()
    reader, writer = await asyncio.open_connection(host, port)
    try:
        writer.write(f"GET {path}?job={i} HTTP/1.1\r\nHost: {host}:{port}\r\nConnection: close\r\n\r\n".encode())
        await writer.drain()
        status = await reader.readline()
        await reader.read()  # headers and body, up to the server's close
        if b" 200 " not in status:
            raise RuntimeError(f"the bench's server answered {status!r}")
    finally:
        writer.close()
        await writer.wait_closed()


def wait_sync(i: int) -> None:
    time.sleep(wait_seconds())
    record(i)


async def wait_async(i: int) -> None:
    await asyncio.sleep(wait_seconds())
    record(i)


def http_sync(i: int) -> None:
    http_get_sync(i)
    record(i)


async def http_async(i: int) -> None:
    await http_get_async(i)
    record(i)
