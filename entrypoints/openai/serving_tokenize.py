"""POST /tokenize and /detokenize (vLLM's extras): the server's tokenizer, no engine round trip."""
from __future__ import annotations

from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse

from . import errors as E
from .http import read_json
from .limits import check_prompt_bytes
from .protocol import DetokenizeRequest, TokenizeRequest, parse
from .serving import ServerState
from .serving_chat import chat_prompt


async def tokenize(state: ServerState, request: Request) -> JSONResponse:
    req = parse(TokenizeRequest, await read_json(request))
    state.check_model(req.model)
    if req.messages is not None:
        if not req.messages:
            raise E.bad_request("messages must not be empty.", "messages", "invalid_value")
        ids = await chat_prompt(state, req.messages, None, bool(req.add_generation_prompt),
                                bool(req.continue_final_message), req.chat_template_kwargs, req.chat_template)
    elif req.prompt is not None:
        add_special = req.add_special_tokens if req.add_special_tokens is not None else True
        # Beyond the byte bound it provably cannot fit the context: refused, not tokenized (limits.py).
        check_prompt_bytes(req.prompt, state.max_prompt_bytes, state.info.max_model_len, "prompt")
        ids = await state.workers.encode(req.prompt, add_special)
    else:
        raise E.bad_request("Either prompt or messages is required.", "prompt", "missing_required_parameter")
    body: dict[str, Any] = {"count": len(ids), "max_model_len": state.info.max_model_len, "tokens": ids}
    if req.return_token_strs:
        body["token_strs"] = state.tokenizer.convert_ids_to_tokens(ids)
    return JSONResponse(body)


async def detokenize(state: ServerState, request: Request) -> JSONResponse:
    req = parse(DetokenizeRequest, await read_json(request))
    state.check_model(req.model)
    # No engine sees these ids, so the vocabulary check is this route's own (the tokenizer would
    # crash on a negative id or quietly drop an unknown one).
    vocab = state.info.vocab_size
    for t in req.tokens:
        if isinstance(t, bool) or not 0 <= t < vocab:
            raise E.bad_request(f"Token id {t!r} is out of vocabulary (0..{vocab - 1}).", "tokens", "invalid_value")
    return JSONResponse({"prompt": await state.workers.run(state.tokenizer.decode, req.tokens)})
