"""The OpenAI-compatible app, assembled: routes, error handlers, lifespan.

The engine runs in its own process (core/engine_process.py, driven by engine_client.py); this
process does HTTP, JSON, chat templates, tokenization of prompts and formatting of the engine's
deltas. Where things are:
  http.py                 key/body guard, JSON bodies, SSE, racing work against disconnects
  serving.py              server state, the engine requests behind one HTTP request, streaming
  serving_completions.py  POST /v1/completions
  serving_chat.py         POST /v1/chat/completions (and the chat template)
  serving_tokenize.py     POST /tokenize, /detokenize
  serving_embeddings.py   POST /v1/embeddings (a pooling model: --runner pooling)
  serving_messages.py     POST /v1/messages, /v1/messages/count_tokens (Anthropic's Messages API)
  serving_responses.py    POST /v1/responses, GET/DELETE /v1/responses/{id} (OpenAI's Responses API)
  batch_routes.py         /v1/files, /v1/batches (batch_jobs.py runs them, batch_store.py keeps them on disk,
                          batch_lines.py runs one batch line through this app, as `run-batch` does)
  dashboard.py            GET /dashboard (static/dashboard.html) and /dashboard/data, from the metrics registry
  tracing.py              --otlp-traces-endpoint: an OpenTelemetry span per request
  openapi_doc.py          /openapi.json, with each route's request model (behind the API key)
  errors.py               OpenAI-shaped errors (Anthropic-shaped under /v1/messages); the one
                          translation of engine refusals

The model loads in the background while the server already answers: /health/live at once,
/health/ready (and every route that needs the engine) with 503 until a request can be served.
If the engine process dies, its in-flight requests fail at once and the server exits with status 1
(for a supervisor to restart it), or with --restart-engine starts a new engine (`Serving.engine_died`).
The routes reach the engines through model_router.py (one `Serving` per model: `--models FILE`, and models
loaded at run time; a ReplicaSet for `--data-parallel-size N`), where one model's death is only that model's.
"""
from __future__ import annotations

import asyncio
import logging
from contextlib import asynccontextmanager
from typing import Any, AsyncIterator, Callable, Optional

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from ... import __version__
from . import errors as E
from .batch_routes import add_batch_routes
from .dashboard import add_dashboard_routes
from .engine_client import EngineClient
from .http import Guard, error_response, read_json
from .metrics import CONTENT_TYPE_LATEST
from .model_router import ModelRouter, ModelSelector
from .openapi_doc import install as install_openapi
from .serving import ServerSettings, ServerState
from .serving_chat import create_chat_completion
from .serving_lora import add_lora_routes, lora_model_cards
from .serving_completions import create_completion
from .serving_embeddings import create_embedding
from .serving_messages import count_message_tokens, create_message
from .serving_responses import add_response_routes
from .serving_tokenize import detokenize, tokenize

logger = logging.getLogger("tokenmill.serve")

__all__ = ["ServerSettings", "create_app"]


# How long a one-model server keeps answering (503 engine_dead) after its engine died, before it exits.
ENGINE_DEATH_EXIT_DELAY_S = 1.5


class Serving:
    """The app's hold on the engine: `state` is None until the model is loaded (`load`), and the
    routes ask for it through `require` (503 while loading, or after loading failed)."""

    def __init__(self, client: EngineClient, settings: ServerSettings, tracer: Any = None) -> None:
        self.client = client
        self.settings = settings
        self.tracer = tracer        # tracing.RequestTracer (--otlp-traces-endpoint), or None
        self.state: Optional[ServerState] = None
        self.failed: Optional[str] = None
        self.on_started: list[Callable[[ServerState], None]] = []    # e.g. resuming batch jobs
        self.on_stopping: list[Callable[[], None]] = []
        # The engine process died (or could not be restarted): the server exits non-zero (serve_cmd).
        self.on_engine_failed: Optional[Callable[[BaseException], None]] = None
        self.startup_timeout: Optional[float] = None
        self._restarting: Optional[asyncio.Task] = None

    def require(self) -> ServerState:
        if self.state is None:
            raise E.model_loading(self.failed)
        return self.state

    def require_generation(self) -> ServerState:
        """`require`, for the routes that generate text: a pooling (embedding) model answers them 400."""
        state = self.require()
        if state.info.runner == "pooling":
            raise E.bad_request("This model is a pooling (embedding) model: it does not generate text. Use "
                                "/v1/embeddings, or serve it with --runner generate.", "model", "model_not_supported")
        return state

    def started(self, loop: asyncio.AbstractEventLoop) -> ServerState:
        """The engine process is up (its model loaded): build the state, start routing its outputs."""
        state = ServerState(self.client, self.settings)
        state.tracer = self.tracer
        self.on_stopping.append(state.workers.close)      # the worker threads, the template sandbox's process
        self.client.on_stats = state.metrics.update_stats
        self.client.on_dead = lambda reason: self.engine_died(loop, reason)
        self.client.attach(loop)
        self.state = state
        for callback in self.on_started:
            callback(state)
        return state

    async def load(self, timeout: Optional[float], on_ready: Optional[Callable[[ServerState], None]],
                   on_failed: Optional[Callable[[BaseException], None]]) -> None:
        try:
            await asyncio.to_thread(self.client.start, timeout)
            state = self.started(asyncio.get_running_loop())
        except Exception as exc:
            self.failed = str(exc)
            if on_failed is not None:
                on_failed(exc)
            return
        if on_ready is not None:
            on_ready(state)

    def engine_died(self, loop: asyncio.AbstractEventLoop, reason: str) -> None:
        """The engine process is gone (its in-flight requests have already failed): zero the gauges, then
        restart it (--restart-engine) or have the server exit non-zero, for a supervisor to restart."""
        if self.state is not None:
            self.state.metrics.engine_gone()
        if self.settings.restart_engine:
            self._restarting = loop.create_task(self._restart(loop))
        elif self.on_engine_failed is not None:
            # Keep answering for a moment: probes see the 503 and the failed streams' error events reach
            # their clients before the listening socket closes (the exit still comes well within 5 s).
            loop.call_later(ENGINE_DEATH_EXIT_DELAY_S, self.on_engine_failed,
                            RuntimeError(f"the engine process died ({reason}); exiting"))

    async def _restart(self, loop: asyncio.AbstractEventLoop) -> None:
        logger.warning("restarting the engine process")
        self.client.detach()
        try:
            await asyncio.to_thread(self.client.respawn, self.startup_timeout)
        except Exception as exc:
            logger.error("the engine process could not be restarted: %s", exc)
            self.failed = str(exc)
            if self.on_engine_failed is not None:
                self.on_engine_failed(exc)
            return
        if not self.client.is_closing:
            self.client.attach(loop)
            logger.info("engine process restarted; ready")

    async def drain(self, timeout: float) -> None:
        if self.state is not None:
            await self.state.drain(timeout)


def _add_error_handlers(app: FastAPI) -> None:
    """Every error, FastAPI's own 404/405 included, in OpenAI's shape (Anthropic's under /v1/messages)."""

    def respond(request: Request, err: E.APIError) -> JSONResponse:
        return error_response(err, E.is_anthropic_path(request.url.path))

    @app.exception_handler(E.APIError)
    async def _api_error(request: Request, exc: E.APIError) -> JSONResponse:
        return respond(request, exc)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        if exc.status_code == 404:
            err = E.APIError(404, f"Invalid URL ({request.method} {request.url.path})", "invalid_request_error",
                             None, "not_found")
        elif exc.status_code == 405:
            err = E.APIError(405, f"Method {request.method} is not allowed on {request.url.path}",
                             "invalid_request_error", None, "method_not_allowed",
                             headers={"Allow": ", ".join(_allowed_methods(app, request.scope))})
        else:
            err = E.APIError(exc.status_code, str(exc.detail), "invalid_request_error", None, "invalid_request")
        return respond(request, err)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("unexpected error on %s %s", request.method, request.url.path)
        response = respond(request, E.internal_error())
        # Starlette re-raises after this response and uvicorn then drops the connection: say so.
        response.headers["Connection"] = "close"
        return response


def _allowed_methods(app: FastAPI, scope: dict) -> list[str]:
    """Every method some route serves at this path (a 405's Allow header), not only the first route's."""
    from starlette.routing import Match
    methods: set[str] = set()
    for route in app.router.routes:
        match, _ = route.matches({**scope, "method": "__none__"})
        if match == Match.PARTIAL:
            methods.update(getattr(route, "methods", None) or ())
    return sorted(methods)


def _add_meta_routes(app: FastAPI, serving: ModelRouter) -> None:
    """/health (/ping), /health/live, /health/ready, /version, /metrics, the model list, and loading and
    unloading models (model_router.py; with several models /health reports each one)."""

    @app.get("/health")
    async def health() -> Response:
        if serving.several:
            return await serving.health(ready=False)
        if await serving.require().client.ping(timeout=10.0):
            return Response(status_code=200)
        return error_response(E.engine_dead())

    @app.get("/health/live")
    async def health_live() -> JSONResponse:
        """The process answers (the model may still be loading)."""
        return JSONResponse({"status": "alive"})

    @app.get("/health/ready")
    async def health_ready() -> JSONResponse:
        """200 only when a request can be served now: the model is loaded, the engine process alive and
        answering, the server not shutting down, and its waiting queue not full."""
        if serving.several:
            return await serving.health(ready=True)
        state = serving.require()
        if state.shutting_down:
            raise E.server_shutting_down()
        state.admit(1)
        if not await state.client.ping(timeout=5.0):
            raise E.engine_dead()
        return JSONResponse({"status": "ready"})

    @app.get("/ping")
    async def ping() -> Response:
        return await health()

    @app.get("/version")
    async def version() -> JSONResponse:
        return JSONResponse({"version": __version__})

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(serving.render_metrics(), media_type=CONTENT_TYPE_LATEST)

    def model_card(state: ServerState, name: str) -> dict[str, Any]:
        return {"id": name, "object": "model", "created": state.created, "owned_by": "tokenmill",
                "root": state.info.model_path or state.info.model_name, "parent": None,
                "max_model_len": state.info.max_model_len}

    def model_cards() -> list[dict[str, Any]]:     # the models, then their LoRA adapters (serving_lora.py)
        listed = serving.listed()
        return [model_card(state, m) for state, m in listed] + lora_model_cards(listed, model_card)

    @app.get("/v1/models")
    async def list_models() -> JSONResponse:
        return JSONResponse({"object": "list", "data": model_cards()})

    @app.get("/v1/models/{model_id:path}")
    async def get_model(model_id: str) -> JSONResponse:
        for card in model_cards():
            if card["id"] == model_id:
                return JSONResponse(card)
        raise E.model_not_found(model_id)

    @app.post("/v1/models/load")
    async def load_model(request: Request) -> JSONResponse:
        """Start an engine for another model: {"name", "model" (or "path"), engine options...}."""
        loaded = await serving.load(await read_json(request))
        return JSONResponse(model_card(loaded["state"], loaded["name"]))

    @app.post("/v1/models/unload")
    async def unload_model(request: Request) -> JSONResponse:
        name = await serving.unload(await read_json(request))
        return JSONResponse({"id": name, "object": "model", "deleted": True})


def create_app(client: EngineClient, settings: ServerSettings, *, startup_timeout: Optional[float] = None,
               on_ready: Optional[Callable[[ServerState], None]] = None,
               on_failed: Optional[Callable[[BaseException], None]] = None, tracer: Any = None) -> Guard:
    """The ASGI app for `client`. A client not started yet is started when the app's lifespan begins,
    in the background (`on_ready(state)` / `on_failed(exc)` tell how that went) while the server already
    answers. `.state` is the `Serving` (the server drains it on shutdown); the engine process is shut
    down when the app's lifespan ends. `tracer` (a tracing.RequestTracer) writes a span per request."""
    # `client`: an EngineClient, a ReplicaSet (-dp N) or the ModelTable of --models FILE (model_router.py).
    serving = ModelRouter(lambda c, s: Serving(c, s, tracer), settings, client, on_failed, startup_timeout)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        loading = serving.start(asyncio.get_running_loop(), on_ready, on_failed)    # every model, at once
        try:
            yield
        finally:
            for task in loading:
                task.cancel()
            serving.shutdown()      # the app's callbacks, then every engine process
            if tracer is not None:
                tracer.shutdown()       # flush the spans not exported yet

    app = FastAPI(title="tokenmill", version=__version__, lifespan=lifespan, docs_url=None, redoc_url=None,
                  openapi_url="/openapi.json")
    app.router.redirect_slashes = False     # its redirect's Location comes from the client's Host header
    app.state.tokenmill = serving
    _add_error_handlers(app)
    app.add_middleware(ModelSelector, router=serving)     # with several models: the body's `model` picks one
    _add_meta_routes(app, serving)
    add_lora_routes(app, serving)
    add_dashboard_routes(app, serving)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await create_completion(serving.require_generation(), request)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await create_chat_completion(serving.require_generation(), request)

    @app.post("/v1/embeddings")
    async def embeddings(request: Request) -> Response:
        return await create_embedding(serving.require(), request)

    @app.post("/v1/messages")
    async def messages(request: Request) -> Response:
        return await create_message(serving.require_generation(), request)

    @app.post("/v1/messages/count_tokens")
    async def messages_count_tokens(request: Request) -> JSONResponse:
        return await count_message_tokens(serving.require(), request)

    add_response_routes(app, serving.require_generation, settings.max_stored_responses)
    add_batch_routes(app, serving, settings.batch_dir)

    @app.post("/tokenize")
    async def tokenize_route(request: Request) -> JSONResponse:
        return await tokenize(serving.require(), request)

    @app.post("/detokenize")
    async def detokenize_route(request: Request) -> JSONResponse:
        return await detokenize(serving.require(), request)

    inner: Any = app
    if tracer is not None:
        from .tracing import TraceContextMiddleware
        inner = TraceContextMiddleware(app, tracer)
    install_openapi(app)
    guard = Guard(inner, settings.api_keys, settings.max_request_body_bytes)
    guard.state = serving   # type: ignore[attr-defined]
    return guard
