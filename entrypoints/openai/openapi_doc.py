"""/openapi.json with the request bodies the routes really read.

The generating routes take the raw `Request` (they parse the body themselves, into the pydantic
models of protocol*.py, to give OpenAI-shaped errors), so FastAPI alone would publish them with no
body at all. `install` adds each route's request model to the document, with the models' nested
definitions under components/schemas (where a client generator or a fuzzer such as schemathesis
resolves `$ref`s), and marks the multipart upload of /v1/files. The app serves the document behind
the API key when one is set (http.Guard).
"""
from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel

from .protocol import ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest
from .protocol_anthropic import CountTokensRequest, MessagesRequest
from .protocol_responses import ResponsesRequest

_REF = "#/components/schemas/{model}"

# (method, path) -> the request model of its JSON body. Routes added by other modules register theirs
# with `register_body` before the document is first built.
REQUEST_BODIES: dict[tuple[str, str], type[BaseModel]] = {
    ("post", "/v1/completions"): CompletionRequest,
    ("post", "/v1/chat/completions"): ChatCompletionRequest,
    ("post", "/v1/messages"): MessagesRequest,
    ("post", "/v1/messages/count_tokens"): CountTokensRequest,
    ("post", "/v1/responses"): ResponsesRequest,
    ("post", "/tokenize"): TokenizeRequest,
    ("post", "/detokenize"): DetokenizeRequest,
}

# Bodies without a pydantic model: (method, path) -> (content type, schema).
RAW_BODIES: dict[tuple[str, str], tuple[str, dict[str, Any]]] = {
    ("post", "/v1/batches"): ("application/json", {
        "type": "object", "required": ["input_file_id", "endpoint", "completion_window"],
        "properties": {"input_file_id": {"type": "string"}, "endpoint": {"type": "string"},
                       "completion_window": {"type": "string"},
                       "metadata": {"type": "object", "additionalProperties": {"type": "string"}}}}),
    ("post", "/v1/files"): ("multipart/form-data", {
        "type": "object", "required": ["file", "purpose"],
        "properties": {"file": {"type": "string", "format": "binary"}, "purpose": {"type": "string"}}}),
}


def register_body(method: str, path: str, model: type[BaseModel]) -> None:
    """Publish `model` as the JSON body of `method path` (for routes defined outside app.py)."""
    REQUEST_BODIES[(method.lower(), path)] = model


def _model_schema(model: type[BaseModel], components: dict[str, Any]) -> dict[str, Any]:
    schema = model.model_json_schema(ref_template=_REF)
    for name, definition in schema.pop("$defs", {}).items():
        components.setdefault(name, definition)
    components[model.__name__] = schema
    return {"$ref": _REF.format(model=model.__name__)}


def build(app: FastAPI) -> dict[str, Any]:
    doc = get_openapi(title=app.title, version=app.version, routes=app.routes)
    components = doc.setdefault("components", {}).setdefault("schemas", {})
    for (method, path), model in REQUEST_BODIES.items():
        operation = doc["paths"].get(path, {}).get(method)
        if operation is not None:
            operation["requestBody"] = {"required": True, "content": {
                "application/json": {"schema": _model_schema(model, components)}}}
    for (method, path), (content_type, schema) in RAW_BODIES.items():
        operation = doc["paths"].get(path, {}).get(method)
        if operation is not None:
            operation["requestBody"] = {"required": True, "content": {content_type: {"schema": schema}}}
    return doc


def install(app: FastAPI) -> None:
    """Make `app.openapi()` (what /openapi.json serves) the document with the request bodies."""
    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            app.openapi_schema = build(app)
        return app.openapi_schema
    app.openapi = openapi

