"""POST /v1/embeddings: one engine pooling request per input (a string, token ids, or a list of either),
all sent at once so the scheduler batches them; `encoding_format` float or base64 (little-endian
float32 bytes, what the OpenAI SDK decodes), `dimensions` for Matryoshka models (the engine checks
the model allows it), vLLM's `truncate_prompt_tokens` and `normalize`. On a generating model the engine refuses the
request (400: the model does not support the Embeddings API)."""
from __future__ import annotations

import base64
import struct
import time
import uuid
from typing import Any, Optional

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from ...core.outputs import RequestDelta
from ...core.pooling_params import PoolingParams
from . import errors as E
from .http import read_json
from .openapi_doc import register_body
from .protocol import EmbeddingRequest, parse
from .serving import RequestGroup, ServerState, collect

MAX_INPUTS = 2048                  # OpenAI's limit on inputs per request
RENAME = {"prompt": "input"}       # the engine's name for what this route calls `input`
register_body("post", "/v1/embeddings", EmbeddingRequest)


def _truncation(state: ServerState, req: EmbeddingRequest) -> Optional[int]:
    k = req.truncate_prompt_tokens
    if k is None:
        return None
    limit = state.info.max_model_len
    if k == -1:
        return limit
    if not 1 <= k <= limit:
        raise E.bad_request(f"truncate_prompt_tokens must be -1 or in 1..{limit} (max_model_len), got {k}.",
                            "truncate_prompt_tokens", "invalid_value")
    return k


def _inputs(state: ServerState, req: EmbeddingRequest) -> list[list[int]]:
    """Token ids of every input; text is tokenized here (with the model's special tokens, as
    sentence-transformers does), token ids go to the engine as they are (it checks the vocabulary)."""
    raw = req.input
    if isinstance(raw, str):
        items: list[Any] = [raw]
    elif raw and all(isinstance(x, int) for x in raw):
        items = [list(raw)]
    else:
        items = list(raw)
    if not items:
        raise E.bad_request("input must not be empty.", "input", "invalid_value")
    if len(items) > MAX_INPUTS:
        raise E.bad_request(f"input may hold at most {MAX_INPUTS} items, got {len(items)}.", "input", "invalid_value")
    keep = _truncation(state, req)
    add_special = req.add_special_tokens if req.add_special_tokens is not None else True
    prompts = []
    for item in items:
        if isinstance(item, str) and not item:      # OpenAI refuses them (the special tokens alone are no text)
            raise E.bad_request("input must not contain empty strings.", "input", "invalid_value")
        if isinstance(item, str):
            if keep is None:
                ids = state.tokenizer.encode(item, add_special_tokens=add_special)
            else:        # the tokenizer's own truncation keeps the closing special tokens
                ids = state.tokenizer.encode(item, add_special_tokens=add_special, truncation=True, max_length=keep)
            prompts.append(list(ids))
        else:
            prompts.append(list(item)[-keep:] if keep else list(item))
    return prompts


def _encode(vector: list[float], encoding_format: str) -> Any:
    if encoding_format == "base64":
        return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode("ascii")
    return vector


async def create_embedding(state: ServerState, request: Request) -> Response:
    arrival = time.monotonic()
    req = parse(EmbeddingRequest, await read_json(request))
    model = state.check_model(req.model)
    # In the tokenizer's thread (workers.py): off the event loop, and never beside another encode (truncation)
    prompts = await state.workers.run(_inputs, state, req)
    try:
        params = PoolingParams(dimensions=req.dimensions, normalize=req.normalize)
    except ValueError as exc:
        raise E.from_exception(exc) from None
    state.admit(len(prompts))
    request_id = f"embd-{uuid.uuid4().hex}"
    group = RequestGroup(state, request_id, prompts, params, req.priority or 0, arrival, rename=RENAME)
    vectors: list[Optional[list[float]]] = [None] * len(prompts)

    def absorb(index: int, delta: RequestDelta) -> list:
        if delta.pooled is not None:
            vectors[index] = delta.pooled
        return []

    if not await collect(request, group, absorb):
        return Response(status_code=499)
    if any(v is None for v in vectors):      # an engine that finished a pooling request without its vector
        raise E.internal_error("The engine finished an embedding request without its vector.")
    data = [{"object": "embedding", "index": i, "embedding": _encode(v, req.encoding_format)}
            for i, v in enumerate(vectors)]
    num_tokens = sum(len(p) for p in prompts)
    return JSONResponse({"id": request_id, "object": "list", "created": int(time.time()), "model": model,
                         "data": data, "usage": {"prompt_tokens": num_tokens, "total_tokens": num_tokens}})
