"""Transport pieces: the server-sent-event response that cancels its job when it ends
(finished or its client gone), a watcher of a client's disconnect while its request waits
or runs, and the middleware that counts answers by endpoint and status."""
from __future__ import annotations

import asyncio

from starlette.responses import StreamingResponse

# paths counted under their own name in kvcompile_requests_total; the rest as "other"
ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/models", "/health", "/metrics")
GONE = 499       # nginx's "client closed request": the status counted for a vanished client


class EventStream(StreamingResponse):
    """text/event-stream; `on_close()` runs however the response ends (a client that
    disconnects ends it: Starlette stops the stream, then on_close cancels the job)."""

    def __init__(self, content, on_close):
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()


def watch_disconnect(request, job) -> asyncio.Task:
    """A task that, once the request's body is read, waits for the client to go away: then
    the job is cancelled and ("gone", None) reaches its handler. Cancel it before a
    streamed response takes over the receive channel."""
    async def watch():
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                job.cancel()
                job.events.put_nowait(("gone", None))
                return
    return asyncio.create_task(watch())


def endpoint_label(path: str) -> str:
    if path in ENDPOINTS:
        return path
    if "/v1" + path in ENDPOINTS:
        return "/v1" + path
    return "/slots" if path.startswith("/slots/") else "other"


class CountRequests:
    """ASGI middleware: kvcompile_requests_total{endpoint, status} for every answer."""

    def __init__(self, app, metrics):
        self.app, self.metrics = app, metrics

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = [500]

        async def send_status(message):
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)
        try:
            await self.app(scope, receive, send_status)
        finally:
            self.metrics.requests.labels(endpoint_label(scope["path"]), str(status[0])).inc()
