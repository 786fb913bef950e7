"""call_app: one HTTP request through an ASGI app in this process, its response as it comes.

A replica (replicas.py) gets its requests from the router as Python objects, not as HTTP: it runs
them through the very app `pellucid serve` runs, so every route, error and stream behaves the
same. What comes out is the status and headers first, then the body's pieces as the app sends
them (a stream's SSE events one by one). When the caller stops reading (its client went away),
the app is told the client disconnected, which aborts the request in the engine.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass

from fastapi import FastAPI


@dataclass(frozen=True)
class HTTPCall:
    method: str
    path: str
    query: bytes = b""
    headers: tuple[tuple[bytes, bytes], ...] = ()
    body: bytes = b""


@dataclass(frozen=True)
class ResponseHead:
    status: int
    headers: tuple[tuple[bytes, bytes], ...]


async def call_app(app: FastAPI, call: HTTPCall) -> AsyncIterator[ResponseHead | bytes]:
    """Yields a ResponseHead, then the body's pieces, until the app's last one."""
    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": call.method,
        "scheme": "http",
        "path": call.path,
        "raw_path": call.path.encode(),
        "query_string": call.query,
        "root_path": "",
        "headers": list(call.headers),
        "client": ("127.0.0.1", 0),
        "server": ("pellucid-replica", 0),
    }
    sent: asyncio.Queue[dict | None] = asyncio.Queue()
    gone = asyncio.Event()
    body_read = False

    async def receive() -> dict:
        nonlocal body_read
        if not body_read:
            body_read = True
            return {"type": "http.request", "body": call.body, "more_body": False}
        await gone.wait()  # the app listens for a disconnect while it streams
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        await sent.put(message)

    task = asyncio.create_task(app(scope, receive, send))
    task.add_done_callback(lambda _: sent.put_nowait(None))
    try:
        while (message := await sent.get()) is not None:
            if message["type"] == "http.response.start":
                yield ResponseHead(message["status"], tuple(message.get("headers", ())))
            elif message["type"] == "http.response.body":
                if message.get("body"):
                    yield message["body"]
                if not message.get("more_body", False):
                    break
        else:  # the app ended without a whole response: it raised
            task.result()
    finally:
        gone.set()  # a reader that stops early is a client that went away
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await asyncio.wait_for(task, timeout=30)
