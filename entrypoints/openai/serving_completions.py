"""POST /v1/completions: one engine request per prompt (string, token ids, or a list of either),
`n` choices each, optional echo and logprobs in the legacy format."""
from __future__ import annotations

import time
import uuid
from typing import Any, Optional

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from ...core.outputs import RequestDelta
from . import errors as E
from .http import read_json
from .limits import check_prompt_bytes
from .protocol import CompletionRequest, parse
from .serving import (LOGPROB_FLOOR, MAX_LOGPROBS, Choice, Event, RequestGroup, ServerState, build_params, clamp,
                      collect, stream, usage)


class _LogprobsFormatter:
    """Legacy completions logprobs: parallel lists tokens / token_logprobs / top_logprobs / text_offset."""

    def __init__(self, state: ServerState, k: Optional[int], as_ids: bool) -> None:
        self.state = state
        self.k = k
        self.as_ids = as_ids

    def logprobs(self, choice: Choice, token_ids: list[int], lps: Optional[list[dict[int, float]]]
                 ) -> Optional[dict[str, Any]]:
        if self.k is None or lps is None:
            return None
        st = self.state
        out: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for tid, entry in zip(token_ids, lps):
            s = st.token_str(tid, self.as_ids)
            out["tokens"].append(s)
            out["token_logprobs"].append(clamp(entry.get(tid, LOGPROB_FLOOR)))
            top = sorted(entry.items(), key=lambda kv: -kv[1])[: self.k]
            if tid not in dict(top):
                top.append((tid, entry.get(tid, LOGPROB_FLOOR)))
            out["top_logprobs"].append({st.token_str(t, self.as_ids): clamp(v) for t, v in top})
            out["text_offset"].append(choice.offset)
            choice.offset += len(s)
        return out


def _check(req: CompletionRequest) -> int:
    """The parameters this server does not support or bounds; returns n. (The prompt itself, its
    length and max_tokens are the engine's to check.)"""
    if req.suffix is not None:
        raise E.bad_request("suffix is not supported.", "suffix", "unsupported_parameter")
    n = req.n if req.n is not None else 1
    if req.best_of is not None and req.best_of != n:
        raise E.bad_request("best_of must equal n (beam search is not supported).", "best_of", "unsupported_parameter")
    if req.logprobs is not None and not 0 <= req.logprobs <= MAX_LOGPROBS:
        raise E.bad_request(f"logprobs must be in [0, {MAX_LOGPROBS}], got {req.logprobs}.", "logprobs",
                            "invalid_value")
    return n


def _prompt_items(req: CompletionRequest) -> list[Any]:
    """The request's prompts: each a text or a list of token ids."""
    raw = req.prompt
    if isinstance(raw, str):
        return [raw]
    if all(isinstance(x, int) for x in raw):     # one prompt of token ids ([] included: the engine refuses it)
        return [list(raw)]
    return list(raw)


async def _prompts(state: ServerState, req: CompletionRequest, items: list[Any]
                   ) -> tuple[list[list[int]], list[Optional[str]]]:
    """Token ids of every prompt (tokenized off the event loop, a text too long in bytes for the context
    refused first), and the text of those given as text (for echo)."""
    add_special = req.add_special_tokens if req.add_special_tokens is not None else True
    texts: list[Optional[str]] = [item if isinstance(item, str) else None for item in items]
    for text in texts:
        if text is not None:
            check_prompt_bytes(text, state.max_prompt_bytes, state.info.max_model_len, "prompt")
    prompts = [await state.workers.encode(item, add_special) if isinstance(item, str) else list(item)
               for item in items]
    return prompts, texts


async def create_completion(state: ServerState, request: Request) -> Response:
    arrival = time.monotonic()
    req = parse(CompletionRequest, await read_json(request))
    model = state.check_model(req.model)
    n = _check(req)
    items = _prompt_items(req)
    state.settings.limits.check(req, len(items))
    prompts, given_texts = await _prompts(state, req, items)
    # max_tokens left out: SamplingParams' default (16, as OpenAI's legacy API), which the engine
    # clips to the context; an explicit one the engine refuses when it does not fit.
    extra = {"max_tokens": req.max_tokens} if req.max_tokens is not None else {}
    params = build_params(req, req.logprobs, **extra)
    state.admit(len(prompts))
    request_id = f"cmpl-{uuid.uuid4().hex}"
    group = RequestGroup(state, request_id, prompts, params, req.priority or 0, arrival)
    fmt = _LogprobsFormatter(state, req.logprobs, bool(req.return_tokens_as_token_ids))
    created = int(time.time())
    choices = {(i, j): Choice() for i in range(len(prompts)) for j in range(n)}
    echo = bool(req.echo)
    echo_texts: list[str] = []
    cached = [0] * len(prompts)        # per prompt: its tokens the prefix cache served

    def prompt_texts() -> list[str]:
        """The echoed prompt texts, decoded only once the engine has accepted the prompts (an invalid
        token id must be the engine's 400, not a tokenizer crash here)."""
        if not echo_texts:
            echo_texts.extend(t if t is not None else state.tokenizer.decode(ids)
                              for t, ids in zip(given_texts, prompts))
            for (i, _), ch in choices.items():
                ch.offset = len(echo_texts[i])
        return echo_texts

    def absorb(sub: int, d: RequestDelta) -> list[Event]:
        """Update the choices; return per changed choice (index, text, logprobs, finish, stop_reason)."""
        if echo:
            prompt_texts()
        if 0 <= sub < len(cached):
            cached[sub] = max(cached[sub], d.num_cached_tokens)
        events = []
        for c in d.outputs:
            ch = choices.get((sub, c.index))
            if ch is None:
                continue
            if c.text:
                ch.text.append(c.text)
            ch.num_tokens += len(c.token_ids)
            lp = fmt.logprobs(ch, c.token_ids, c.logprobs)
            if lp is not None:
                if ch.lp is None:
                    ch.lp = {k: [] for k in lp}
                for k, v in lp.items():
                    ch.lp[k].extend(v)
            if c.finish_reason is not None:
                ch.finish_reason, ch.stop_reason = c.finish_reason, c.stop_reason
            if c.text or c.token_ids or c.finish_reason is not None:
                events.append((sub * n + c.index, c.text, lp, c.finish_reason, c.stop_reason))
        return events

    def total_usage() -> dict[str, Any]:
        return usage(sum(len(x) for x in prompts), sum(ch.num_tokens for ch in choices.values()), sum(cached))

    def shape(index: int, text: str, lp: Any, finish: Optional[str], stop_reason: Any) -> dict[str, Any]:
        """One choice of a response body or of a streamed chunk (both have the same shape here)."""
        return {"index": index, "text": text, "logprobs": lp, "finish_reason": finish, "stop_reason": stop_reason}

    head = {"id": request_id, "object": "text_completion", "created": created, "model": model}
    if not req.stream:
        if not await collect(request, group, absorb):
            return Response(status_code=499)
        texts = prompt_texts() if echo else []
        out = [shape(i * n + j, (texts[i] if echo else "") + "".join(ch.text), ch.lp, ch.finish_reason,
                     ch.stop_reason) for (i, j), ch in sorted(choices.items())]
        return JSONResponse({**head, "choices": out, "usage": total_usage()})

    def opening() -> list[dict[str, Any]]:
        """With echo, the stream opens with each prompt's text, once per choice of that prompt."""
        return [shape(i * n + j, t, None, None, None) for i, t in enumerate(prompt_texts())
                for j in range(n)] if echo else []

    return await stream(request, group, head=head,
                        include_usage=bool(req.stream_options and req.stream_options.include_usage),
                        opening=opening, absorb=absorb, shape=shape, usage=total_usage)
