"""The Starlette app: OpenAI's /v1/chat/completions, /v1/completions and /v1/models, plus
/health, /metrics and llama.cpp's /slots, over one Engine run by one worker thread.

A request's life: body read (size limit) and fields checked -> a job queued for the Engine's
thread (a full queue: 503) -> the Engine checks it ("start", or an error: 400) -> text
pieces, streamed as server-sent events or gathered -> the result and its usage. A client that
disconnects cancels its job, waiting or running.
"""
from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass
from pathlib import Path

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from kvcompile.errors import KvcompileError
from kvcompile.server import api_error
from kvcompile.server.api_error import ApiError
from kvcompile.server.asgi import GONE, CountRequests, EventStream, watch_disconnect
from kvcompile.server.body import read_json
from kvcompile.server.fields import parse_request
from kvcompile.server.generation import generation_work
from kvcompile.server.metrics import ServerMetrics
from kvcompile.server.shapes import Shapes, sse
from kvcompile.server.slots import check_slot, session_path, slot_work
from kvcompile.server.worker import EngineWorker, Job, QueueFull


@dataclass
class ServerSettings:
    model_name: str = "kvcompile"         # the id /v1/models lists and requests may name
    queue_size: int = 16                  # requests that may wait for the Engine
    max_body_bytes: int = 8 * 2**20       # a larger request body: 413
    default_max_tokens: int = -1          # when a request gives none; -1: the context's rest
    slot_save_path: Path | None = None    # the session folder (None: /slots answers 501)
    api_key: str | None = None            # if set: "Authorization: Bearer KEY" on /v1, /slots


def model_name_of(engine) -> str:
    return Path(engine.path).stem if engine.path else "kvcompile"


def failure(value, started: bool, prompt_param: str | None = None) -> ApiError:
    """What a job's error becomes: the Engine's refusal before it ran a 400, else a 500."""
    if isinstance(value, ApiError):
        return value
    if isinstance(value, KvcompileError) and not started:
        return api_error.from_request_error(value, prompt_param)
    return api_error.internal(value)


def error_response(e: ApiError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status, headers=e.headers)


class Server:
    def __init__(self, engine, settings: ServerSettings):
        self.engine, self.settings = engine, settings
        self.worker = EngineWorker(engine, settings.queue_size)
        self.metrics = ServerMetrics(self.worker)
        self.created = int(time.time())

    @contextlib.asynccontextmanager
    async def lifespan(self, app):
        self.worker.start()
        try:
            yield
        finally:
            self.worker.stop()

    # ---- helpers ---------------------------------------------------------------------------
    def _authorize(self, request) -> None:
        key = self.settings.api_key
        if key is not None and request.headers.get("authorization") != f"Bearer {key}":
            raise ApiError(401, "a valid API key is required: Authorization: Bearer KEY",
                           code="invalid_api_key")

    def _model(self, name: str | None) -> str:
        served = self.settings.model_name
        if name is not None and name != served:
            raise api_error.model_not_found(name, [served])
        return served

    def _submit(self, work) -> Job:
        job = Job(work, asyncio.get_running_loop())
        try:
            self.worker.submit(job)
        except QueueFull:
            raise api_error.queue_full(self.settings.queue_size) from None
        return job

    # ---- generation --------------------------------------------------------------------------
    async def chat(self, request):
        return await self._generate(request, chat=True)

    async def completions(self, request):
        return await self._generate(request, chat=False)

    async def _generate(self, request, chat: bool):
        self._authorize(request)
        body = await read_json(request, self.settings.max_body_bytes)
        req = parse_request(body, chat=chat, ctx_size=self.engine.ctx_size,
                            default_max_tokens=self.settings.default_max_tokens,
                            cache_prompt=self.engine.config.cache_prompt)
        shapes = Shapes(chat, self._model(req.model), req.return_tokens)
        job = self._submit(generation_work(req, self.metrics))
        watcher = watch_disconnect(request, job)
        streaming = False
        try:
            kind, value = await job.events.get()          # after the queue: start or not
            if kind == "gone":
                return Response(status_code=GONE)
            if kind != "start":
                raise failure(value, False, "messages" if chat else "prompt")
            if req.stream:
                watcher.cancel()                          # the response listens from here
                streaming = True
                return EventStream(self._events(job, shapes, req.include_usage), job.cancel)
            while kind in ("start", "piece"):
                kind, value = await job.events.get()
            if kind == "gone":
                return Response(status_code=GONE)
            if kind != "done":
                raise failure(value, started=True)
            return JSONResponse(shapes.body(value))
        finally:
            watcher.cancel()
            if not streaming:
                job.cancel()                              # (a finished job: no effect)

    async def _events(self, job: Job, shapes: Shapes, include_usage: bool):
        if shapes.chat:
            yield sse(shapes.chunk(first=True))
        while True:
            kind, value = await job.events.get()
            if kind == "piece":
                yield sse(shapes.chunk(value))
            elif kind == "done" and value is None:        # no result: the server stopping
                return
            elif kind == "done":
                yield sse(shapes.chunk(finish=value.finish_reason))
                if include_usage:
                    yield sse(shapes.usage_chunk(value))
                break
            else:                                         # failed mid-stream: OpenAI's way
                yield sse(failure(value, started=True).body())
                return
        yield sse("[DONE]")

    # ---- the rest -----------------------------------------------------------------------------
    async def models(self, request):
        self._authorize(request)
        e = self.engine
        return JSONResponse({"object": "list", "data": [{
            "id": self.settings.model_name, "object": "model", "created": self.created,
            "owned_by": "kvcompile",
            "meta": {"ctx_size": e.ctx_size, "n_vocab": e.model.config.vocab_size,
                     "path": str(e.path) if e.path else None}}]})

    async def health(self, request):
        return JSONResponse({"status": "ok", "queue_depth": self.worker.depth,
                             "running": self.worker.running})

    async def prometheus(self, request):
        return Response(self.metrics.exposition(), media_type=self.metrics.content_type)

    async def slots(self, request):
        self._authorize(request)
        action = request.query_params.get("action")
        check_slot(request.path_params["slot_id"], action)
        path = None
        if action != "erase":
            body = await read_json(request, self.settings.max_body_bytes)
            if not isinstance(body, dict):
                raise api_error.invalid("the body must be a JSON object {\"filename\": NAME}")
            path = session_path(self.settings.slot_save_path, body.get("filename"))
        job = self._submit(slot_work(action, path))
        kind, value = await job.events.get()
        if kind != "done":
            raise failure(value, started=False)
        return JSONResponse(value)


async def _api_error(request, e: ApiError):
    return error_response(e)


async def _http_error(request, e: HTTPException):
    code = {404: "not_found", 405: "method_not_allowed"}.get(e.status_code)
    return error_response(ApiError(e.status_code, f"{request.method} {request.url.path}: "
                                   f"{e.detail}", code=code))


async def _internal_error(request, e: Exception):
    return error_response(api_error.internal(e))


def create_app(engine, settings: ServerSettings | None = None) -> Starlette:
    """The app over `engine` (its worker thread starts with the app's lifespan)."""
    settings = settings or ServerSettings(model_name=model_name_of(engine))
    s = Server(engine, settings)
    # OpenAI's paths, also without /v1 (as llama-server takes them)
    routes = [Route(prefix + path, handler, methods=[method])
              for prefix in ("/v1", "") for path, handler, method in (
                  ("/chat/completions", s.chat, "POST"),
                  ("/completions", s.completions, "POST"), ("/models", s.models, "GET"))]
    routes += [Route("/health", s.health, methods=["GET"]),
              Route("/metrics", s.prometheus, methods=["GET"]),
              Route("/slots/{slot_id}", s.slots, methods=["POST"])]
    app = Starlette(routes=routes, lifespan=s.lifespan,
                    middleware=[Middleware(CountRequests, metrics=s.metrics)],
                    exception_handlers={ApiError: _api_error, HTTPException: _http_error,
                                        Exception: _internal_error})
    app.state.server = s
    return app
