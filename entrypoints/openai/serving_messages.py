"""POST /v1/messages and /v1/messages/count_tokens: Anthropic's Messages API on the chat path.

The body is converted to a chat request (protocol_anthropic.py) and planned like one
(serving_chat.plan_chat: chat template, forced tool choice, parsers); the engine's deltas are read
by the same per-choice parsers (chat_output.ChatChoiceOutput) and turned into Anthropic's content
blocks -- thinking (with --reasoning-parser), text, tool_use -- finished, or streamed as Anthropic's
events: message_start, ping, content_block_start / _delta (text_delta, input_json_delta,
thinking_delta) / _stop per block, message_delta (stop_reason, usage), message_stop. Errors have
Anthropic's shape (app.py / http.py choose it for every /v1/messages path; mid-stream: an `error`
event).
"""
from __future__ import annotations

import json
import time
import uuid
from typing import Any, AsyncIterator, Optional

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from ...core.outputs import RequestDelta
from .chat_output import ChatChoiceOutput
from .http import dumps, read_json
from .protocol import parse
from .protocol_anthropic import CountTokensRequest, MessagesRequest, to_chat_request
from .serving import Choice, RequestGroup, ServerState, chat_deltas, collect, open_stream
from .serving_chat import chat_prompt, plan_chat


def _event(kind: str, data: dict[str, Any]) -> str:
    """One Anthropic server-sent event (the SDK reads the `event:` line)."""
    return f"event: {kind}\ndata: {dumps(data)}\n\n"


def tool_use_id() -> str:
    return f"toolu_{uuid.uuid4().hex[:24]}"


def stop_reason(ch: Choice, called: bool, stop_sequences: Optional[list[str]]) -> tuple[str, Optional[str]]:
    """Anthropic's (stop_reason, stop_sequence) for a finished choice."""
    if ch.finish_reason == "length":
        return "max_tokens", None
    if called:
        return "tool_use", None
    if isinstance(ch.stop_reason, str) and ch.stop_reason in (stop_sequences or []):
        return "stop_sequence", ch.stop_reason
    return "end_turn", None


def _tool_input(arguments: str) -> dict[str, Any]:
    try:
        value = json.loads(arguments)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {"value": value}


def finished_blocks(output: Optional[ChatChoiceOutput], text: str) -> list[dict[str, Any]]:
    """The content blocks of a finished answer."""
    if output is None:
        return [{"type": "text", "text": text}]
    msg = output.message(text)
    blocks: list[dict[str, Any]] = []
    if msg.get("reasoning_content"):
        blocks.append({"type": "thinking", "thinking": msg["reasoning_content"], "signature": ""})
    if msg.get("content"):
        blocks.append({"type": "text", "text": msg["content"]})
    for call in msg.get("tool_calls") or []:
        fn = call["function"]
        blocks.append({"type": "tool_use", "id": tool_use_id(), "name": fn["name"],
                       "input": _tool_input(fn["arguments"])})
    return blocks or [{"type": "text", "text": ""}]


class StreamedBlocks:
    """Turns the chat deltas of one answer (reasoning_content, content, tool_calls) into Anthropic's
    content block events: a block opens when its kind of output starts and closes when another starts."""

    def __init__(self) -> None:
        self.index = -1
        self.open: Optional[str] = None         # "thinking", "text", or "tool:<chat call index>"

    def _start(self, kind: str, block: dict[str, Any]) -> list[str]:
        out = self.close()
        self.index += 1
        self.open = kind
        out.append(_event("content_block_start", {"type": "content_block_start", "index": self.index,
                                                  "content_block": block}))
        return out

    def _delta(self, delta: dict[str, Any]) -> str:
        return _event("content_block_delta", {"type": "content_block_delta", "index": self.index, "delta": delta})

    def feed(self, delta: dict[str, Any]) -> list[str]:
        out: list[str] = []
        if delta.get("reasoning_content"):
            if self.open != "thinking":
                out += self._start("thinking", {"type": "thinking", "thinking": "", "signature": ""})
            out.append(self._delta({"type": "thinking_delta", "thinking": delta["reasoning_content"]}))
        if delta.get("content"):
            if self.open != "text":
                out += self._start("text", {"type": "text", "text": ""})
            out.append(self._delta({"type": "text_delta", "text": delta["content"]}))
        for call in delta.get("tool_calls") or []:
            fn = call.get("function") or {}
            kind = f"tool:{call['index']}"
            if call.get("id") is not None:      # a new call
                out += self._start(kind, {"type": "tool_use", "id": tool_use_id(), "name": fn.get("name") or "",
                                          "input": {}})
            elif self.open != kind:             # a fragment of a call that is not the open block
                continue
            if fn.get("arguments"):
                out.append(self._delta({"type": "input_json_delta", "partial_json": fn["arguments"]}))
        return out

    def close(self) -> list[str]:
        if self.open is None:
            return []
        self.open = None
        return [_event("content_block_stop", {"type": "content_block_stop", "index": self.index})]


async def create_message(state: ServerState, request: Request) -> Response:
    arrival = time.monotonic()
    req = parse(MessagesRequest, await read_json(request))
    model = state.check_model(req.model)
    chat = to_chat_request(req)
    plan = await plan_chat(state, chat, rename={"stop": "stop_sequences"})
    state.admit(1)
    message_id = f"msg_{uuid.uuid4().hex}"
    group = RequestGroup(state, message_id, [plan.ids], plan.params, 0, arrival, plan.rename)
    output = plan.outputs[0] if plan.outputs else None
    ch = Choice()

    def absorb(_sub: int, d: RequestDelta) -> tuple[str, bool]:
        return ch.absorb_first(d)

    def usage() -> dict[str, Any]:
        return {"input_tokens": len(plan.ids), "output_tokens": ch.num_tokens}

    head = {"id": message_id, "type": "message", "role": "assistant", "model": model}
    if not req.stream:
        if not await collect(request, group, absorb):
            return Response(status_code=499)
        blocks = finished_blocks(output, "".join(ch.text))
        reason, sequence = stop_reason(ch, any(b["type"] == "tool_use" for b in blocks), req.stop_sequences)
        return JSONResponse({**head, "content": blocks, "stop_reason": reason, "stop_sequence": sequence,
                             "usage": usage()})

    async def events(item: Optional[tuple[int, RequestDelta]]) -> AsyncIterator[str]:
        yield _event("message_start", {"type": "message_start", "message": {
            **head, "content": [], "stop_reason": None, "stop_sequence": None,
            "usage": {"input_tokens": len(plan.ids), "output_tokens": 0}}})
        yield _event("ping", {"type": "ping"})
        blocks = StreamedBlocks()
        called = False
        while item is not None:
            text, done = absorb(*item)
            for delta in chat_deltas(output, text, done):
                called = called or bool(delta.get("tool_calls"))
                for piece in blocks.feed(delta):
                    yield piece
            item = await group.next()
        for piece in blocks.close():
            yield piece
        reason, sequence = stop_reason(ch, called, req.stop_sequences)
        yield _event("message_delta", {"type": "message_delta",
                                       "delta": {"stop_reason": reason, "stop_sequence": sequence},
                                       "usage": {"output_tokens": ch.num_tokens}})
        yield _event("message_stop", {"type": "message_stop"})

    return await open_stream(request, group, events, lambda err: [_event("error", err.anthropic_body())])


async def count_message_tokens(state: ServerState, request: Request) -> JSONResponse:
    """The prompt's token count, exactly as /v1/messages would render it (`usage.input_tokens`)."""
    req = parse(CountTokensRequest, await read_json(request))
    state.check_model(req.model)
    chat = to_chat_request(req)
    ids = await chat_prompt(state, chat.messages, chat.tools)
    return JSONResponse({"input_tokens": len(ids)})

