"""The OpenAI-compatible app, assembled: routes, error handlers, lifespan.

The engine runs in its own process (core/engine_process.py, driven by engine_client.py); this
process does HTTP, JSON, chat templates, tokenization of prompts and formatting of the engine's
deltas. Where things are:
  http.py                 key/body guard, JSON bodies, SSE, racing work against disconnects
  serving.py              server state, the engine requests behind one HTTP request, streaming
  serving_completions.py  POST /v1/completions
  serving_chat.py         POST /v1/chat/completions (and the chat template)
  serving_tokenize.py     POST /tokenize, /detokenize
  errors.py               OpenAI-shaped errors; the one translation of engine refusals
"""
from __future__ import annotations

import asyncio
import logging
from contextlib import asynccontextmanager
from typing import Any, AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from ... import __version__
from . import errors as E
from .engine_client import EngineClient
from .http import Guard, error_response
from .metrics import CONTENT_TYPE_LATEST
from .serving import ServerSettings, ServerState
from .serving_chat import create_chat_completion
from .serving_completions import create_completion
from .serving_tokenize import detokenize, tokenize

logger = logging.getLogger("tokenmill.serve")

__all__ = ["ServerSettings", "create_app"]


def _add_error_handlers(app: FastAPI) -> None:
    """Every error, FastAPI's own 404/405 included, in OpenAI's shape."""

    @app.exception_handler(E.APIError)
    async def _api_error(request: Request, exc: E.APIError) -> JSONResponse:
        return error_response(exc)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        if exc.status_code == 404:
            err = E.APIError(404, f"Invalid URL ({request.method} {request.url.path})", "invalid_request_error",
                             None, "not_found")
        elif exc.status_code == 405:
            err = E.APIError(405, f"Method {request.method} is not allowed on {request.url.path}",
                             "invalid_request_error", None, "method_not_allowed")
        else:
            err = E.APIError(exc.status_code, str(exc.detail), "invalid_request_error")
        return error_response(err)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("unexpected error on %s %s", request.method, request.url.path)
        return error_response(E.internal_error())


def _add_meta_routes(app: FastAPI, state: ServerState) -> None:
    """/health, /ping, /version, /metrics and the model list."""
    client = state.client

    @app.get("/health")
    async def health() -> Response:
        if await client.ping(timeout=10.0):
            return Response(status_code=200)
        return error_response(E.engine_dead())

    @app.get("/ping")
    async def ping() -> Response:
        return await health()

    @app.get("/version")
    async def version() -> JSONResponse:
        return JSONResponse({"version": __version__})

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(state.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    def model_card(name: str) -> dict[str, Any]:
        return {"id": name, "object": "model", "created": state.created, "owned_by": "tokenmill",
                "root": state.info.model_path or state.info.model_name, "parent": None,
                "max_model_len": state.info.max_model_len}

    @app.get("/v1/models")
    async def list_models() -> JSONResponse:
        return JSONResponse({"object": "list", "data": [model_card(m) for m in state.model_names]})

    @app.get("/v1/models/{model_id:path}")
    async def get_model(model_id: str) -> JSONResponse:
        if model_id not in state.model_names:
            raise E.model_not_found(model_id)
        return JSONResponse(model_card(model_id))


def create_app(client: EngineClient, settings: ServerSettings) -> Guard:
    """The ASGI app for a started `client`. `.state` is the ServerState (the server drains it on
    shutdown); the engine process is shut down when the app's lifespan ends."""
    state = ServerState(client, settings)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        client.on_stats = state.metrics.update_stats
        client.attach(asyncio.get_running_loop())
        logger.info("OpenAI-compatible API for model %r at http://%s:%d/v1", state.model_name,
                    settings.host, settings.port)
        try:
            yield
        finally:
            client.shutdown()

    app = FastAPI(title="tokenmill", version=__version__, lifespan=lifespan, docs_url=None, redoc_url=None,
                  openapi_url=None)
    app.state.tokenmill = state
    _add_error_handlers(app)
    _add_meta_routes(app, state)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await create_completion(state, request)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await create_chat_completion(state, request)

    @app.post("/tokenize")
    async def tokenize_route(request: Request) -> JSONResponse:
        return await tokenize(state, request)

    @app.post("/detokenize")
    async def detokenize_route(request: Request) -> JSONResponse:
        return await detokenize(state, request)

    guard = Guard(app, settings.api_keys, settings.max_request_body_bytes)
    guard.state = state   # type: ignore[attr-defined]
    return guard
