"""The engine pool behind one server: served name -> the `Serving` (app.py) of that model's engine (an
EngineClient, or a ReplicaSet of -dp replicas). One model (`serve MODEL`) is a router with one entry; `--models
FILE` gives several, and POST /v1/models/load and /v1/models/unload change them at run time.

A route asks `require()` / `require_generation()` as before; with several models the request's `model` (read
from the JSON body by `ModelSelector`, before routing) picks the entry, and an unknown one is the usual 404
model_not_found. With one model, every request goes to it and its own `check_model` decides, exactly as before.

Engine deaths: the model of `serve MODEL` exits the server (or restarts, --restart-engine) as before; a model of
--models, or one loaded at run time, is only marked down: its requests get 503 (its in-flight streams an error
event) and the others keep serving. /health is 503 while a configured model is still loading or when every model
is down, else 200 with each model's status.
"""
from __future__ import annotations

import asyncio
import contextvars
import dataclasses
import json
import logging
import time
from typing import Any, Callable, Optional

from fastapi.responses import JSONResponse, Response
from prometheus_client import CollectorRegistry, generate_latest

from . import errors as E
from .engine_client import EngineDeadError
from .model_config import ModelEntryError, ModelTable, available_cores, make_engines, spec_from_entry

logger = logging.getLogger("tokenmill.serve")

# The `model` of the request being served (ModelSelector sets it); None: the default model.
CURRENT_MODEL: contextvars.ContextVar[Optional[str]] = contextvars.ContextVar("tokenmill_model", default=None)


class ModelSelector:
    """ASGI middleware (inside the FastAPI app, so batch lines pass through it too): with several models,
    read the `model` of a POST's JSON body into CURRENT_MODEL, then replay the body to the routes."""

    def __init__(self, app: Any, router: "ModelRouter") -> None:
        self.app, self.router = app, router

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope.get("method") != "POST" or not self.router.several:
            return await self.app(scope, receive, send)
        chunks, message = [], {"more_body": True}
        while message.get("more_body", False):
            message = await receive()
            if message["type"] != "http.request":
                return await self.app(scope, _replay([message], receive), send)
            chunks.append(message.get("body", b""))
        body = b"".join(chunks)
        token = CURRENT_MODEL.set(_peek_model(body))
        try:
            await self.app(scope, _replay([{"type": "http.request", "body": body, "more_body": False}], receive), send)
        finally:
            CURRENT_MODEL.reset(token)


def _model_engine_died(name: Optional[str], client: Any) -> None:
    """A model of several lost its engine (or a replica of it): only that model is affected."""
    if client.is_alive:      # a ReplicaSet whose other replicas live
        logger.error("model %r: a data-parallel replica died; the others keep serving it", name)
    else:
        logger.error("model %r is down: its requests get 503; the other models keep serving", name)


def _replay(messages: list[dict], receive: Any) -> Any:
    async def replay() -> dict:
        return messages.pop(0) if messages else await receive()
    return replay


def _peek_model(body: bytes) -> Optional[str]:
    """The body's `model`, when it is a JSON object with a string one (the route reports anything else)."""
    if b'"model"' not in body:
        return None
    try:
        obj = json.loads(body)
    except (ValueError, RecursionError):
        return None
    model = obj.get("model") if isinstance(obj, dict) else None
    return model if isinstance(model, str) else None


class ModelRouter:
    """name -> Serving. `make_serving(client, settings)` builds one (app.py's Serving class)."""

    def __init__(self, make_serving: Callable[[Any, Any], Any], settings: Any, engines: Any,
                 on_failed: Optional[Callable[[BaseException], None]] = None,
                 startup_timeout: Optional[float] = None) -> None:
        self.make_serving = make_serving
        self.settings = settings
        self.registry = CollectorRegistry()     # every model's metrics, labelled by model_name (and replica)
        self.servings: dict[str, Any] = {}      # model name -> Serving, the default (first) first
        self.on_started: list[Callable[[Any], None]] = []     # the default model's (dashboard, batch jobs)
        self.on_stopping: list[Callable[[], None]] = []
        self.on_failed, self.startup_timeout = on_failed, startup_timeout
        self.multi = isinstance(engines, ModelTable)      # --models FILE (or a model loaded at run time)
        self._reserved: set[str] = set()
        if self.multi:
            self.base_kwargs, self.factory, self.log_level = engines.base_kwargs, engines.factory, engines.log_level
            for spec, client in zip(engines.specs, engines.clients):
                self._add(spec.name, client, spec.settings, exit_on_death=False)
        else:
            self.base_kwargs = {k: v for k, v in engines.engine_kwargs.items()
                                if k not in ("model", "served_model_name")}
            self.factory, self.log_level = engines.factory, engines.log_level
            self._add(None, engines, {}, exit_on_death=True)

    def _add(self, name: Optional[str], client: Any, overrides: dict[str, Any], exit_on_death: bool) -> Any:
        settings = dataclasses.replace(self.settings, metrics_registry=self.registry, **overrides)
        serving = self.make_serving(client, settings)
        serving.startup_timeout = self.startup_timeout
        if not self.servings:     # the default model holds the app-wide callbacks
            serving.on_started, serving.on_stopping = self.on_started, self.on_stopping
        if exit_on_death:
            serving.on_engine_failed = self.on_failed
        else:
            serving.on_engine_failed = lambda exc, n=name, c=client: _model_engine_died(n, c)
        self.servings[name if name is not None else ""] = serving
        return serving

    # -------------------------------------------------------------- picking the model
    @property
    def several(self) -> bool:
        """Models are picked by name (and /health reports each): --models, or once one was loaded at run time."""
        return self.multi or len(self.servings) > 1

    @property
    def default(self) -> Any:
        if not self.servings:
            raise E.APIError(503, "No model is loaded; load one with POST /v1/models/load.", "server_error", None,
                             "model_not_loaded")
        return next(iter(self.servings.values()))

    def select(self, model: Optional[str]) -> Any:
        """The Serving for a request's `model` (None or "": the default model); 404 for an unknown name."""
        if not self.several:
            return self.default
        if not model:
            return self.default
        for serving in self.servings.values():      # served names, then whatever else a model accepts (adapters)
            if model in serving.settings.served_model_names:
                return serving
        for serving in self.servings.values():
            if serving.state is not None:
                try:
                    serving.state.check_model(model)
                    return serving
                except E.APIError:
                    pass
        raise E.model_not_found(model)

    def require(self) -> Any:
        return self.select(CURRENT_MODEL.get()).require()

    def require_generation(self) -> Any:
        return self.select(CURRENT_MODEL.get()).require_generation()

    @property
    def state(self) -> Any:
        return self.default.state

    def listed(self) -> list[tuple[Any, str]]:
        """(state, served name) of every model /v1/models lists: the loaded ones (503 while the one model of
        `serve MODEL` loads)."""
        if not self.several:
            state = self.default.require()
            return [(state, name) for name in state.model_names]
        return [(s.state, name) for s in self.servings.values() if s.state is not None for name in s.state.model_names]

    # -------------------------------------------------------------- lifecycle
    def _bind(self, serving: Any, state: Any) -> None:
        bind = getattr(serving.client, "bind_metrics", None)
        if bind is not None:
            bind(self.registry, state.model_name)

    def started(self, loop: asyncio.AbstractEventLoop) -> Any:
        """Every engine already started (run-batch): build the states; the default model's is returned."""
        states = []
        for serving in self.servings.values():
            states.append(serving.started(loop))
            self._bind(serving, states[-1])
        return states[0]

    def start(self, loop: asyncio.AbstractEventLoop, on_ready: Optional[Callable[[Any], None]],
              on_failed: Optional[Callable[[BaseException], None]]) -> list[asyncio.Task]:
        """Load every model at the same time (the app's lifespan); returns the loading tasks."""
        tasks = []
        for name, serving in self.servings.items():
            def ready(state: Any, serving: Any = serving) -> None:
                self._bind(serving, state)
                if on_ready is not None:
                    on_ready(state)

            def failed(exc: BaseException, name: str = name) -> None:
                if on_failed is not None:
                    on_failed(RuntimeError(f"model {name!r}: {exc}") if self.multi else exc)
            if serving.client.info is None:
                tasks.append(loop.create_task(serving.load(self.startup_timeout, ready, failed)))
            else:
                ready(serving.started(loop))
        return tasks

    def shutdown(self) -> None:
        for callback in self.on_stopping:
            callback()
        for serving in self.servings.values():
            if serving.on_stopping is not self.on_stopping:
                for callback in serving.on_stopping:
                    callback()
            # An engine still loading its model reads no command: do not wait long for it to obey one.
            serving.client.shutdown(timeout=10.0 if serving.state is not None else 1.0)

    async def drain(self, timeout: float) -> None:
        await asyncio.gather(*(s.drain(timeout) for s in list(self.servings.values())))

    def render_metrics(self) -> bytes:
        if not self.several:
            self.default.require()      # 503 while the model loads, as before
        return generate_latest(self.registry)

    # -------------------------------------------------------------- health
    async def statuses(self) -> dict[str, str]:
        """Each model's status: loading, failed, down (its engine died) or ready (its engine answers)."""
        async def status(serving: Any) -> str:
            if serving.state is None:
                return "failed" if serving.failed else "loading"
            if not serving.client.is_alive or not await serving.client.ping(timeout=5.0):
                return "down"
            return "ready"
        names = [s.state.model_name if s.state is not None else (n or "default") for n, s in self.servings.items()]
        return dict(zip(names, await asyncio.gather(*(status(s) for s in self.servings.values()))))

    async def health(self, ready: bool) -> Response:
        """/health (ready=False) and /health/ready with several models: 200 when every configured model has
        loaded and one at least serves, with each model's status; else 503."""
        statuses = await self.statuses()
        values = list(statuses.values())
        shutting_down = any(s.state is not None and s.state.shutting_down for s in self.servings.values())
        up = "ready" in values and "loading" not in values and not shutting_down
        overall = "ready" if values and all(v == "ready" for v in values) else ("degraded" if up else "unavailable")
        return JSONResponse({"status": overall, "models": statuses}, status_code=200 if up else 503)

    # -------------------------------------------------------------- load / unload
    async def load(self, body: Any) -> dict[str, Any]:
        """POST /v1/models/load: start an engine for a new model (blocking this request until it serves)."""
        if not isinstance(body, dict):
            raise E.bad_request("The body must be a JSON object with `name` and `model` (or `path`).", None,
                                "invalid_type")
        try:
            spec = spec_from_entry(body, self.base_kwargs, "POST /v1/models/load")
        except ModelEntryError as exc:
            raise E.bad_request(str(exc), exc.key, "unknown_parameter" if exc.unknown else "invalid_value") from None
        names = set(spec.settings["served_model_names"])
        taken = {n for s in self.servings.values() for n in s.settings.served_model_names} | self._reserved
        if self.servings and self.default.state is not None:
            taken |= set(self.default.state.model_names)
        clash = sorted(names & taken)
        if clash:
            raise E.APIError(409, f"A model named {clash[0]!r} is already served (or being loaded); unload it first.",
                             "invalid_request_error", "name", "model_exists")
        if spec.engine_kwargs.get("num_threads") is None:
            engines = sum(len(getattr(s.client, "replicas", [s.client])) for s in self.servings.values())
            spec.engine_kwargs["num_threads"] = max(1, available_cores() // (engines + spec.data_parallel_size))
        client = make_engines(spec, self.factory, self.log_level)
        self._reserved |= names
        try:
            try:
                await asyncio.to_thread(client.start, self.startup_timeout)
            except Exception as exc:
                client.shutdown(timeout=1.0)
                logger.error("model %r could not be loaded: %s", spec.name, exc)
                reason = (str(exc).strip().splitlines() or [type(exc).__name__])[-1]   # a traceback's last line
                raise E.bad_request(f"Model {spec.name!r} could not be loaded: {reason}", "model",
                                    "model_load_failed") from None
            serving = self._add(spec.name, client, spec.settings, exit_on_death=False)
            self.multi = True       # from now on models are picked by name, whatever is unloaded later
            state = serving.started(asyncio.get_running_loop())
            self._bind(serving, state)
        finally:
            self._reserved -= names
        info = state.info
        logger.info("model %r loaded (%s); KV cache: %d blocks of %d tokens; max_model_len %d", spec.name,
                    spec.engine_kwargs["model"] or "the default model", info.num_kv_blocks, info.block_size,
                    info.max_model_len)
        return {"name": spec.name, "state": state}

    async def unload(self, body: Any) -> str:
        """POST /v1/models/unload {"name", "timeout"}: stop routing to the model, give its in-flight requests
        `timeout` seconds (default 5) to finish, fail the rest (503), stop its engine."""
        name = body.get("name") if isinstance(body, dict) else None
        if not isinstance(name, str) or not name:
            raise E.bad_request("The body must be a JSON object with the `name` of the model to unload.", "name",
                                "missing_required_parameter")
        for key in body:
            if key not in ("name", "timeout"):
                raise E.bad_request(f"Unknown field {key!r} (an unload takes `name` and `timeout`).", key,
                                    "unknown_parameter")
        timeout = body.get("timeout", 5.0)
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout < 0:
            raise E.bad_request(f"timeout must be a number of seconds >= 0, got {timeout!r}.", "timeout")
        key = next((k for k, s in self.servings.items() if name == k or name in s.settings.served_model_names
                    or (s.state is not None and name == s.state.model_name)), None)
        if key is None:
            raise E.model_not_found(name)
        serving = self.servings.pop(key)
        client = serving.client
        deadline = time.monotonic() + timeout
        while client.num_in_flight and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        client.on_dead = None       # an unloaded model's engine stopping is no death
        client.abort_all(EngineDeadError(f"model {name!r} was unloaded"))
        await asyncio.to_thread(client.shutdown, 5.0)
        if serving.state is not None:
            serving.state.metrics.engine_gone()
            serving.state.workers.close()
        logger.info("model %r unloaded", name)
        return name
