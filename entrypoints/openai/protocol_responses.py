"""OpenAI's Responses API: the request body (pydantic), its conversion to the chat request the
engine path knows (serving_chat.plan_chat), the store of finished responses behind
`previous_response_id`, and the output items of a finished answer. Streaming is responses_stream.py.

Input items → chat messages: a string is one user message; `message` items (roles user, system,
developer, assistant; content a string or input_text / output_text parts) keep their role;
`function_call` items become the tool_calls of an assistant message (consecutive ones share it),
`function_call_output` items "tool" messages; `reasoning` items are dropped (as chat drops
earlier reasoning). Output items have the same shapes, so a stored response's history is its input
followed by its output, converted the same way.
"""
from __future__ import annotations

import uuid
from collections import OrderedDict
from typing import Any, Optional, Union

from . import errors as E
from .protocol import ChatCompletionRequest, _Base

_ROLES = ("user", "system", "developer", "assistant")
_TEXT_PARTS = ("input_text", "output_text", "text")


class ResponsesRequest(_Base):
    model: Optional[str] = None
    input: Union[str, list[dict[str, Any]]]
    instructions: Optional[str] = None
    max_output_tokens: Optional[int] = None
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    top_k: Optional[int] = None           # vLLM's extras, through extra_body
    seed: Optional[int] = None
    tools: Optional[list[dict[str, Any]]] = None
    tool_choice: Optional[Union[str, dict[str, Any]]] = None
    parallel_tool_calls: Optional[bool] = None
    text: Optional[dict[str, Any]] = None
    stream: Optional[bool] = False
    store: Optional[bool] = True
    previous_response_id: Optional[str] = None
    reasoning: Optional[dict[str, Any]] = None
    background: Optional[bool] = None
    metadata: Optional[dict[str, Any]] = None
    user: Optional[str] = None
    service_tier: Optional[str] = None       # metadata only, accepted
    prompt_cache_key: Optional[str] = None
    safety_identifier: Optional[str] = None


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _text(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise E.bad_request(f"{where} must be a string or a list of text parts.", where, "invalid_value")
    parts = []
    for j, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") not in _TEXT_PARTS or not isinstance(part.get("text"), str):
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise E.bad_request(f"{where}[{j}]: only text parts are supported, got {kind!r}.", f"{where}[{j}]",
                                "invalid_value")
        parts.append(part["text"])
    return "".join(parts)


def input_messages(items: Union[str, list[dict[str, Any]]], param: str = "input") -> list[dict[str, Any]]:
    """The chat messages of a request's `input` (or of a response's output items)."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    messages: list[dict[str, Any]] = []
    for i, item in enumerate(items):
        where = f"{param}[{i}]"
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            role = item.get("role")
            if role not in _ROLES:
                raise E.bad_request(f"{where}.role must be one of {', '.join(_ROLES)}, got {role!r}.",
                                    f"{where}.role", "invalid_value")
            messages.append({"role": "system" if role == "developer" else role,
                             "content": _text(item.get("content", ""), f"{where}.content")})
        elif kind == "function_call":
            if not all(isinstance(item.get(k), str) for k in ("call_id", "name", "arguments")):
                raise E.bad_request(f"{where}: a function_call item needs call_id, name and arguments.", where,
                                    "invalid_value")
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": item["name"], "arguments": item["arguments"]}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            if not isinstance(item.get("call_id"), str):
                raise E.bad_request(f"{where}: a function_call_output item needs a call_id.", where, "invalid_value")
            messages.append({"role": "tool", "tool_call_id": item["call_id"],
                             "content": _text(item.get("output", ""), f"{where}.output")})
        elif kind == "reasoning":
            continue
        else:
            raise E.bad_request(f"{where}: input items of type {kind!r} are not supported (message, function_call, "
                                "function_call_output, reasoning).", f"{where}.type", "invalid_value")
    return messages


def _tools(tools: Optional[list[dict[str, Any]]]) -> Optional[list[dict[str, Any]]]:
    if not tools:
        return None
    out = []
    for i, tool in enumerate(tools):
        if tool.get("type") != "function" or not isinstance(tool.get("name"), str):
            raise E.bad_request(f"tools[{i}]: only function tools ({{'type': 'function', 'name': ...}}) are "
                                f"supported, got type {tool.get('type')!r}.", f"tools[{i}]", "invalid_value")
        fn = {k: tool[k] for k in ("name", "description", "parameters") if tool.get(k) is not None}
        out.append({"type": "function", "function": fn})
    return out


def _tool_choice(choice: Any) -> Any:
    if choice is None or choice in ("auto", "none", "required"):
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise E.bad_request(f"tool_choice must be 'auto', 'none', 'required' or {{'type': 'function', 'name': NAME}}, "
                        f"got {choice!r}.", "tool_choice", "invalid_value")


def _response_format(text: Optional[dict[str, Any]]) -> Optional[dict[str, Any]]:
    """Chat's response_format for `text.format` (text, json_object, json_schema)."""
    fmt = (text or {}).get("format")
    if not fmt or fmt.get("type", "text") == "text":
        return None
    if fmt.get("type") == "json_object":
        return {"type": "json_object"}
    if fmt.get("type") == "json_schema":
        schema = fmt.get("schema", {"type": "object"})
        if not isinstance(schema, dict):
            raise E.bad_request("text.format.schema must be a JSON schema object.", "text.format", "invalid_value")
        return {"type": "json_schema", "json_schema": {"name": fmt.get("name", "response"), "schema": schema}}
    raise E.bad_request(f"text.format type {fmt.get('type')!r} is not supported (text, json_object, json_schema).",
                        "text.format", "invalid_value")


def to_chat_request(req: ResponsesRequest, messages: list[dict[str, Any]]) -> ChatCompletionRequest:
    """The chat request the engine path runs: `messages` is the whole conversation (instructions first)."""
    return ChatCompletionRequest(messages=messages, tools=_tools(req.tools), tool_choice=_tool_choice(req.tool_choice),
                                 parallel_tool_calls=req.parallel_tool_calls, max_tokens=req.max_output_tokens,
                                 temperature=req.temperature, top_p=req.top_p, top_k=req.top_k, seed=req.seed,
                                 response_format=_response_format(req.text))


def output_items(message: dict[str, Any], incomplete: bool) -> list[dict[str, Any]]:
    """The output items of a finished answer (a chat message: reasoning_content, content, tool_calls)."""
    items: list[dict[str, Any]] = []
    if message.get("reasoning_content"):
        items.append(reasoning_item(new_id("rs"), message["reasoning_content"], "completed"))
    calls = message.get("tool_calls") or []
    if message.get("content") or not calls:
        items.append(message_item(new_id("msg"), message.get("content") or "",
                                  "incomplete" if incomplete else "completed"))
    for call in calls:
        items.append(function_call_item(new_id("fc"), call["id"], call["function"]["name"],
                                        call["function"]["arguments"], "completed"))
    return items


def message_item(item_id: str, text: Optional[str], status: str) -> dict[str, Any]:
    content = [] if text is None else [output_text_part(text)]
    return {"type": "message", "id": item_id, "status": status, "role": "assistant", "content": content}


def output_text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def reasoning_item(item_id: str, text: Optional[str], status: str) -> dict[str, Any]:
    content = [] if text is None else [{"type": "reasoning_text", "text": text}]
    return {"type": "reasoning", "id": item_id, "summary": [], "content": content, "status": status}


def function_call_item(item_id: str, call_id: str, name: str, arguments: str, status: str) -> dict[str, Any]:
    return {"type": "function_call", "id": item_id, "call_id": call_id, "name": name, "arguments": arguments,
            "status": status}


class ResponseStore:
    """Finished responses kept in memory for GET /v1/responses/{id} and `previous_response_id`:
    (the response body, the conversation so far as chat messages), least recently used dropped first."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._items: "OrderedDict[str, tuple[dict[str, Any], list[dict[str, Any]]]]" = OrderedDict()

    def put(self, response: dict[str, Any], history: list[dict[str, Any]]) -> None:
        if self.capacity <= 0:
            return
        self._items[response["id"]] = (response, history)
        self._items.move_to_end(response["id"])
        while len(self._items) > self.capacity:
            self._items.popitem(last=False)

    def get(self, response_id: str) -> Optional[tuple[dict[str, Any], list[dict[str, Any]]]]:
        entry = self._items.get(response_id)
        if entry is not None:
            self._items.move_to_end(response_id)
        return entry

    def delete(self, response_id: str) -> bool:
        return self._items.pop(response_id, None) is not None

    def __len__(self) -> int:
        return len(self._items)
