"""Structured outputs on the OpenAI routes: chat's `response_format` mapped to the engine's
`structured_outputs` (vLLM's body field of the same name is read by build_params directly).

`response_format: {"type": "structural_tag", ...}` (vLLM's) is passed whole as the structural tag:
free text in which each trigger starts a begin / JSON schema / end structure (legacy form:
`structures` + `triggers`; xgrammar's newer form: `format`), e.g. tool calls in the model's own
syntax. The engine checks it; its errors name response_format (the chat route renames them)."""
from __future__ import annotations

from typing import Any, Optional

from . import errors as E


def from_response_format(response_format: Optional[dict[str, Any]]) -> Optional[dict[str, Any]]:
    """The structured_outputs of a chat `response_format` (None for {"type": "text"} or none);
    a 400 with param response_format for a shape this server does not know."""
    if not response_format:
        return None
    kind = response_format.get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"json_object": True}
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        if not isinstance(spec, dict):
            raise E.bad_request("response_format of type 'json_schema' needs a 'json_schema' object.",
                                "response_format", "invalid_value")
        schema = spec.get("schema")
        if schema is None:
            schema = {"type": "object"}   # OpenAI's schema is optional: any JSON object
        if not isinstance(schema, (dict, str)):
            raise E.bad_request("response_format.json_schema.schema must be a JSON schema object.",
                                "response_format", "invalid_value")
        return {"json": schema}
    if kind == "structural_tag":
        return {"structural_tag": dict(response_format)}
    raise E.bad_request(f"response_format type {kind!r} is not supported "
                        "(text, json_object, json_schema, structural_tag).",
                        "response_format", "invalid_value")
