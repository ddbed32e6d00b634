"""POST /v1/responses, GET and DELETE /v1/responses/{id}: OpenAI's Responses API on the chat path.

The request becomes a chat request (protocol_responses.py: instructions, then the stored history of
`previous_response_id`, then `input`; function tools; `text.format` as response_format, so through
the structured-outputs machinery) planned by serving_chat.plan_chat; the engine's deltas are read by
the per-choice parsers (chat_output.ChatChoiceOutput) into output items -- reasoning (with
--reasoning-parser), message, function_call -- finished, or streamed (responses_stream.py).
Finished responses are kept in memory (LRU, at most --max-stored-responses, default 1000) unless
`store: false`; errors have OpenAI's shape.
"""
from __future__ import annotations

import time
from typing import Any, AsyncIterator, Callable, Optional

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from ...core.outputs import RequestDelta
from . import errors as E
from .http import read_json
from .protocol import parse
from .protocol_responses import (ResponsesRequest, ResponseStore, input_messages, new_id, output_items,
                                 to_chat_request)
from .responses_stream import StreamedItems
from .serving import Choice, RequestGroup, ServerState, chat_deltas, collect, open_stream
from .serving_chat import plan_chat

# The engine's parameter names as this route calls them.
_RENAME = {"prompt": "input", "max_tokens": "max_output_tokens"}


def not_found(response_id: str) -> E.APIError:
    return E.APIError(404, f"Response with id '{response_id}' not found.", "invalid_request_error", "response_id",
                      "not_found")


def _usage(prompt_tokens: int, output_tokens: int) -> dict[str, Any]:
    return {"input_tokens": prompt_tokens, "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
            "output_tokens": output_tokens, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": prompt_tokens + output_tokens}


async def create_response(state: ServerState, store: ResponseStore, request: Request) -> Response:
    arrival = time.monotonic()
    req = parse(ResponsesRequest, await read_json(request))
    model = state.check_model(req.model)
    if req.background:
        raise E.bad_request("background responses are not supported.", "background", "unsupported_parameter")
    history: list[dict[str, Any]] = []
    if req.previous_response_id is not None:
        entry = store.get(req.previous_response_id)
        if entry is None:
            raise E.bad_request(f"Previous response with id '{req.previous_response_id}' not found.",
                                "previous_response_id", "previous_response_not_found")
        history = entry[1]
    conversation = history + input_messages(req.input)     # what a next turn continues
    instructions = [{"role": "system", "content": req.instructions}] if req.instructions else []
    if not instructions + conversation:     # a 400 here, not the chat request's validation error (a 500)
        raise E.bad_request("input must hold at least one message (or give instructions).", "input",
                            "invalid_value")
    plan = await plan_chat(state, to_chat_request(req, instructions + conversation), rename=_RENAME,
                           structured_param="text.format")
    state.admit(1)
    response_id = new_id("resp")
    group = RequestGroup(state, response_id, [plan.ids], plan.params, 0, arrival, plan.rename)
    output = plan.outputs[0] if plan.outputs else None
    created = int(time.time())
    ch = Choice()

    def absorb(_sub: int, d: RequestDelta) -> tuple[str, bool]:
        return ch.absorb_first(d)

    def body(status: str, items: list[dict[str, Any]], error: Optional[dict[str, Any]] = None) -> dict[str, Any]:
        incomplete = status == "incomplete"
        return {"id": response_id, "object": "response", "created_at": created, "status": status, "error": error,
                "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
                "instructions": req.instructions, "max_output_tokens": req.max_output_tokens, "model": model,
                "output": items, "parallel_tool_calls": req.parallel_tool_calls is not False,
                "previous_response_id": req.previous_response_id, "reasoning": req.reasoning or {},
                "store": req.store is not False, "temperature": req.temperature,
                "text": req.text or {"format": {"type": "text"}}, "tool_choice": req.tool_choice or "auto",
                "tools": req.tools or [], "top_p": req.top_p, "truncation": "disabled", "metadata": req.metadata or {},
                "user": req.user, "usage": None if status == "in_progress" else _usage(len(plan.ids), ch.num_tokens)}

    def finish(items: list[dict[str, Any]]) -> dict[str, Any]:
        """The finished response, stored (with the conversation it continues) unless store is false."""
        response = body("incomplete" if ch.finish_reason == "length" else "completed", items)
        if req.store is not False:
            store.put(response, conversation + input_messages(items, "output"))
        return response

    if not req.stream:
        if not await collect(request, group, absorb):
            return Response(status_code=499)
        text = "".join(ch.text)
        message = output.message(text) if output is not None else {"role": "assistant", "content": text}
        return JSONResponse(finish(output_items(message, ch.finish_reason == "length")))

    stream = StreamedItems()

    async def events(item: Optional[tuple[int, RequestDelta]]) -> AsyncIterator[str]:
        yield stream.event("response.created", response=body("in_progress", []))
        yield stream.event("response.in_progress", response=body("in_progress", []))
        while item is not None:
            text, done = absorb(*item)
            for delta in chat_deltas(output, text, done):
                for piece in stream.feed(delta):
                    yield piece
            item = await group.next()
        for piece in stream.ensure_output() + stream.close(incomplete=ch.finish_reason == "length"):
            yield piece
        response = finish(stream.items)
        kind = "response.incomplete" if response["status"] == "incomplete" else "response.completed"
        yield stream.event(kind, response=response)

    def on_error(err: E.APIError) -> list[str]:
        failed = body("failed", stream.items, {"code": err.code or err.type, "message": err.message})
        return [stream.event("response.failed", response=failed)]

    return await open_stream(request, group, events, on_error)


def add_response_routes(app: FastAPI, require: Callable[[], ServerState], max_stored: int = 1000) -> ResponseStore:
    """The /v1/responses routes on `app`; returns their store."""
    store = ResponseStore(max_stored)

    @app.post("/v1/responses")
    async def responses_create(request: Request) -> Response:
        return await create_response(require(), store, request)

    @app.get("/v1/responses/{response_id}")
    async def responses_retrieve(response_id: str) -> JSONResponse:
        require()
        entry = store.get(response_id)
        if entry is None:
            raise not_found(response_id)
        return JSONResponse(entry[0])

    @app.delete("/v1/responses/{response_id}")
    async def responses_delete(response_id: str) -> JSONResponse:
        require()
        if not store.delete(response_id):
            raise not_found(response_id)
        return JSONResponse({"id": response_id, "object": "response", "deleted": True})

    return store
