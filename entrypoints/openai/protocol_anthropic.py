"""Anthropic's Messages API: its request bodies (pydantic), and their conversion to the chat request
the engine path already knows (serving_chat.plan_chat): the system prompt and content blocks become
chat messages (tool_use → an assistant's tool_calls, tool_result → a "tool" message), the tools
OpenAI function tools, tool_choice auto / any / tool / none → "auto" / "required" / a named
function / "none". Nothing here formats output (serving_messages.py does).
"""
from __future__ import annotations

import json
from typing import Any, Literal, Optional, Union

from pydantic import Field

from . import errors as E
from .protocol import ChatCompletionRequest, ChatMessage, _Base


class AnthropicTool(_Base):
    name: str
    description: Optional[str] = None
    input_schema: dict[str, Any] = Field(default_factory=lambda: {"type": "object"})
    type: Optional[str] = None       # "custom" (or absent); Anthropic's server tools are refused


class AnthropicMessage(_Base):
    role: Literal["user", "assistant"]
    content: Union[str, list[dict[str, Any]]]


class CountTokensRequest(_Base):
    model: str
    messages: list[AnthropicMessage] = Field(min_length=1)
    system: Optional[Union[str, list[dict[str, Any]]]] = None
    tools: Optional[list[AnthropicTool]] = None
    tool_choice: Optional[dict[str, Any]] = None


class MessagesRequest(CountTokensRequest):
    max_tokens: int = Field(ge=1)            # required, as Anthropic requires it
    stop_sequences: Optional[list[str]] = None
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    top_k: Optional[int] = None
    stream: Optional[bool] = False
    metadata: Optional[dict[str, Any]] = None     # accepted, ignored
    service_tier: Optional[str] = None            # accepted, ignored
    thinking: Optional[dict[str, Any]] = None     # accepted: reasoning shows when --reasoning-parser is on


def _text_of(blocks: Any, param: str) -> str:
    """The text of a string or of a list of text blocks (the system prompt, a tool_result's content)."""
    if blocks is None:
        return ""
    if isinstance(blocks, str):
        return blocks
    if not isinstance(blocks, list):
        raise E.bad_request(f"{param} must be a string or a list of text blocks.", param, "invalid_value")
    parts = []
    for j, block in enumerate(blocks):
        if not isinstance(block, dict) or block.get("type") != "text" or not isinstance(block.get("text"), str):
            kind = block.get("type") if isinstance(block, dict) else type(block).__name__
            raise E.bad_request(f"{param}[{j}]: only text blocks are supported here, got {kind!r}.",
                                f"{param}[{j}]", "invalid_value")
        parts.append(block["text"])
    return "".join(parts)


def _message(i: int, m: AnthropicMessage) -> list[dict[str, Any]]:
    """The chat messages of one Anthropic message: its tool results (as "tool" messages, first: they
    answer the previous assistant turn), then its text; an assistant's tool_use blocks as tool_calls."""
    if isinstance(m.content, str):
        return [{"role": m.role, "content": m.content}]
    texts: list[str] = []
    calls: list[dict[str, Any]] = []
    results: list[dict[str, Any]] = []
    for j, block in enumerate(m.content):
        kind = block.get("type")
        where = f"messages[{i}].content[{j}]"
        if kind == "text" and isinstance(block.get("text"), str):
            texts.append(block["text"])
        elif kind == "tool_use" and m.role == "assistant":
            if not isinstance(block.get("name"), str) or not isinstance(block.get("id"), str):
                raise E.bad_request(f"{where}: a tool_use block needs an 'id' and a 'name'.", where,
                                    "invalid_value")
            calls.append({"id": block["id"], "type": "function",
                          "function": {"name": block["name"], "arguments": json.dumps(block.get("input") or {})}})
        elif kind == "tool_result" and m.role == "user":
            if not isinstance(block.get("tool_use_id"), str):
                raise E.bad_request(f"{where}: a tool_result block needs a 'tool_use_id'.", where, "invalid_value")
            text = _text_of(block.get("content"), f"{where}.content")
            if block.get("is_error"):
                text = f"Error: {text}"
            results.append({"role": "tool", "tool_call_id": block["tool_use_id"], "content": text})
        elif kind in ("thinking", "redacted_thinking") and m.role == "assistant":
            continue      # earlier reasoning is not shown to the model again
        else:
            raise E.bad_request(f"{where}: content blocks of type {kind!r} are not supported in a {m.role} "
                                "message (text, tool_use in assistant messages, tool_result in user messages).",
                                f"{where}.type", "invalid_value")
    if m.role == "assistant":
        msg: dict[str, Any] = {"role": "assistant", "content": "".join(texts)}
        if calls:
            msg["tool_calls"] = calls
        return [msg]
    out = results
    if texts or not results:
        out = out + [{"role": "user", "content": "".join(texts)}]
    return out


def _tools(tools: Optional[list[AnthropicTool]]) -> Optional[list[dict[str, Any]]]:
    if not tools:
        return None
    out = []
    for i, tool in enumerate(tools):
        if tool.type not in (None, "custom"):
            raise E.bad_request(f"tools[{i}]: tool type {tool.type!r} is not supported (only custom tools "
                                "with an input_schema).", f"tools[{i}].type", "invalid_value")
        fn: dict[str, Any] = {"name": tool.name, "parameters": tool.input_schema}
        if tool.description is not None:
            fn["description"] = tool.description
        out.append({"type": "function", "function": fn})
    return out


def _tool_choice(choice: Optional[dict[str, Any]]) -> tuple[Any, Optional[bool]]:
    """(the chat tool_choice, parallel_tool_calls) of an Anthropic tool_choice."""
    if choice is None:
        return None, None
    kind = choice.get("type")
    parallel = False if choice.get("disable_parallel_tool_use") else None
    if kind == "auto":
        return "auto", parallel
    if kind == "any":
        return "required", parallel
    if kind == "none":
        return "none", None
    if kind == "tool":
        if not isinstance(choice.get("name"), str):
            raise E.bad_request("tool_choice of type 'tool' needs the tool's 'name'.", "tool_choice.name",
                                "missing_required_parameter")
        return {"type": "function", "function": {"name": choice["name"]}}, parallel
    raise E.bad_request(f"tool_choice type must be auto, any, tool or none, got {kind!r}.", "tool_choice.type",
                        "invalid_value")


def to_chat_request(req: CountTokensRequest) -> ChatCompletionRequest:
    """The chat request the engine path runs for a Messages (or count_tokens) request."""
    messages: list[dict[str, Any]] = []
    system = _text_of(req.system, "system")
    if system:
        messages.append({"role": "system", "content": system})
    for i, m in enumerate(req.messages):
        messages.extend(_message(i, m))
    tool_choice, parallel = _tool_choice(req.tool_choice)
    fields: dict[str, Any] = {"messages": [ChatMessage(**m) for m in messages], "tools": _tools(req.tools),
                              "tool_choice": tool_choice, "parallel_tool_calls": parallel}
    if isinstance(req, MessagesRequest):
        fields.update(max_tokens=req.max_tokens, stop=req.stop_sequences, temperature=req.temperature,
                      top_p=req.top_p, top_k=req.top_k)
    return ChatCompletionRequest(**fields)
