"""LoRA adapters at run time (issue 14), with vLLM's endpoints and bodies:

    POST /v1/load_lora_adapter    {"lora_name": "legal", "lora_path": "/adapters/legal"}
    POST /v1/unload_lora_adapter  {"lora_name": "legal"}

Both are behind the API key (the Guard covers every route). The engine process reads and validates a
loaded adapter at once (core/engine_process.py `lora_command`): an adapter it cannot serve (a rank above
--max-lora-rank, a target module the model does not have, modules_to_save, ...) is a 400 naming why,
an unknown one to unload a 404. Adapters are listed by /v1/models with `parent` = the base model and
`root` = their path, and a request names one by its `model` (served_names.py).
"""
from __future__ import annotations

from typing import Any, Callable

from fastapi import FastAPI, Request
from fastapi.responses import PlainTextResponse

from ...core.errors import RequestError
from . import errors as E
from .http import read_json
from .served_names import lora_adapters

_LOAD_FIELDS = {"lora_name", "lora_path", "load_inplace"}
_UNLOAD_FIELDS = {"lora_name", "lora_int_id"}


def _body(body: Any, allowed: set[str], required: tuple[str, ...]) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise E.bad_request("The request body must be a JSON object.", None, "invalid_type")
    unknown = sorted(set(body) - allowed)
    if unknown:
        raise E.bad_request(f"Unrecognized request argument supplied: {unknown[0]}", unknown[0], "unknown_parameter")
    for key in required:
        value = body.get(key)
        if value is None:
            raise E.bad_request(f"'{key}' is a required property", key, "missing_required_parameter")
        if not isinstance(value, str) or not value:
            raise E.bad_request(f"'{key}' must be a non-empty string", key, "invalid_type")
    return body


async def _engine_call(state: Any, op: str, *args: Any) -> dict[str, str]:
    call = getattr(state.client, "call", None)
    if call is None:       # a ReplicaSet (-dp N) does not forward commands to its replicas
        raise E.bad_request("Loading LoRA adapters at run time is not supported with data-parallel replicas.",
                            None, "unsupported")
    try:
        adapters = await call(op, *args)
    except RequestError as exc:
        if exc.code == "model_not_found":
            raise E.APIError(404, exc.message, "NotFoundError", exc.param, "model_not_found") from None
        raise E.from_exception(exc) from None
    except Exception as exc:
        raise E.from_exception(exc) from None
    state.info.lora_adapters = adapters      # what check_model and /v1/models read from now on
    return adapters


def lora_model_cards(listed: list[tuple[Any, str]], card: Callable[[Any, str], dict[str, Any]]) -> list[dict[str, Any]]:
    """/v1/models entries of the adapters of every listed model: parent = its base model, root = its path."""
    cards, seen = [], set()
    for state, _ in listed:
        if id(state) in seen:
            continue
        seen.add(id(state))
        for name, path in lora_adapters(state.info).items():
            cards.append({**card(state, name), "root": path, "parent": state.model_name})
    return cards


def add_lora_routes(app: FastAPI, serving: Any) -> None:
    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(request: Request) -> PlainTextResponse:
        body = _body(await read_json(request), _LOAD_FIELDS, ("lora_name", "lora_path"))
        state = serving.require_generation()
        name = body["lora_name"]
        if name in state.model_names:
            raise E.bad_request(f"The lora adapter name '{name}' is the base model's.", "lora_name")
        await _engine_call(state, "load_lora", name, body["lora_path"])
        return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(request: Request) -> PlainTextResponse:
        body = _body(await read_json(request), _UNLOAD_FIELDS, ("lora_name",))
        state = serving.require_generation()
        await _engine_call(state, "unload_lora", body["lora_name"])
        return PlainTextResponse(f"Success: LoRA adapter '{body['lora_name']}' removed successfully.")
