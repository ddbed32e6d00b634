"""POST /v1/chat/completions: the model's chat template is applied here (text content parts only),
then one engine request with `n` choices; logprobs in the chat format."""
from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass
from typing import Any, Optional

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from ...core.outputs import RequestDelta
from . import errors as E
from .chat_output import ChatChoiceOutput
from .http import read_json
from .limits import check_prompt_bytes, prompt_too_long
from .protocol import ChatCompletionRequest, parse
from .serving import (LOGPROB_FLOOR, MAX_LOGPROBS, Choice, Event, RequestGroup, ServerState, build_params, clamp,
                      collect, stream, usage)
from .structured import from_response_format
from .tool_choice import ForcedToolParser, forced_name, forced_schema, is_forced
from .workers import TemplateError

_ROLES = ("system", "user", "assistant", "tool")


async def chat_prompt(state: ServerState, messages: list[Any], tools: Any = None, add_generation_prompt: bool = True,
                      continue_final_message: bool = False, kwargs: Optional[dict] = None,
                      template: Optional[str] = None) -> list[int]:
    """The token ids of `messages` rendered by the chat template (also used by /tokenize), off the event loop.
    `template` (or kwargs["chat_template"]): the request's own template, refused (400) unless the server runs
    with --trust-request-chat-template, then rendered in the sandbox (template_sandbox.py)."""
    msgs = _message_dicts(messages)
    extra = dict(kwargs or {})
    param = "chat_template"
    if "chat_template" in extra:
        if template is None:
            template, param = extra["chat_template"], "chat_template_kwargs.chat_template"
        del extra["chat_template"]
    limits = state.settings.limits
    if template is not None and not limits.trust_request_chat_template:
        raise E.bad_request("A request's own chat template is refused: start the server with "
                            "--trust-request-chat-template to allow it.", param, "invalid_value")
    if template is not None and not isinstance(template, str):
        raise E.bad_request("The chat template must be a string.", param, "invalid_type")
    bound, max_len = state.max_prompt_bytes, state.info.max_model_len
    # The messages' text is part of the prompt: beyond the byte bound it cannot fit, whatever the template adds.
    chars = sum(len(m["content"]) for m in msgs if isinstance(m.get("content"), str))
    if bound and chars > bound:
        raise prompt_too_long(chars, bound, max_len, "messages")
    workers = state.workers
    try:
        if template is not None:
            kw = {**state.tokenizer.special_tokens_map, **extra}
            text = await workers.render_in_sandbox(template, msgs, tools or None,
                                                   add_generation_prompt and not continue_final_message,
                                                   continue_final_message, kw, bound or (1 << 62))
        else:
            text = await workers.run_bounded(_render, state.tokenizer, msgs, tools, add_generation_prompt,
                                             continue_final_message, extra)
    except TemplateError as exc:
        raise E.bad_request(f"The chat template could not render these messages: {exc}",
                            param if template is not None else "messages") from None
    check_prompt_bytes(text, bound, max_len, "messages")
    # The template already wrote the special tokens (BOS included) it wants.
    return await workers.encode(text, add_special_tokens=False)


def _message_dicts(messages: list[Any]) -> list[dict[str, Any]]:
    """The messages as chat templates read them: text content parts joined, roles checked."""
    msgs = []
    for i, m in enumerate(messages):
        d = m.model_dump(exclude_none=True)
        content = d.get("content")
        if isinstance(content, list):
            parts = []
            for part in content:
                if part.get("type") == "text" and isinstance(part.get("text"), str):
                    parts.append(part["text"])
                else:
                    raise E.bad_request(f"Only text content parts are supported, got {part.get('type')!r}.",
                                        f"messages[{i}].content", "invalid_value")
            d["content"] = "".join(parts)
        if d.get("role") == "developer":     # OpenAI's newer name for the system role
            d["role"] = "system"
        if d.get("role") not in _ROLES:
            raise E.bad_request(f"Invalid role {d.get('role')!r}.", f"messages[{i}].role", "invalid_value")
        if d.get("tool_calls"):
            _template_tool_calls(d)
        msgs.append(d)
    return msgs


def _render(tokenizer: Any, msgs: list[dict], tools: Any, add_generation_prompt: bool, continue_final_message: bool,
            extra: dict[str, Any]) -> str:
    """The server's own template (in a worker thread): jinja's errors are a template refusing these messages."""
    if tools:
        extra = {**extra, "tools": tools}
    try:
        text = tokenizer.apply_chat_template(
            msgs, add_generation_prompt=add_generation_prompt and not continue_final_message,
            continue_final_message=continue_final_message, tokenize=False, **extra)
    except Exception as exc:
        raise E.bad_request(f"The chat template could not render these messages: {exc}", "messages") from None
    if not isinstance(text, str):
        raise E.internal_error("The chat template did not produce text.")
    return text


def _template_tool_calls(d: dict[str, Any]) -> None:
    """An assistant message that called tools, as chat templates expect it: content "" rather than
    missing (it may be null), and each call's arguments as an object (the API sends a JSON string)."""
    d.setdefault("content", "")
    for call in d["tool_calls"] if isinstance(d["tool_calls"], list) else []:
        fn = call.get("function") if isinstance(call, dict) else None
        if isinstance(fn, dict) and isinstance(fn.get("arguments"), str):
            try:
                fn["arguments"] = json.loads(fn["arguments"])
            except ValueError:
                pass        # left as the text it is


def choice_outputs(state: ServerState, req: ChatCompletionRequest, n: int) -> Optional[list[ChatChoiceOutput]]:
    """One ChatChoiceOutput per choice when a parser reads the output (None: plain text). Tool calls are
    read for tool_choice "auto" (or unset) with tools, when the server enables automatic tool choice,
    and always for a forced tool_choice ("required" or named: read from the constrained JSON)."""
    reasoning = state.reasoning_parser_cls
    if is_forced(req.tool_choice):   # the engine holds the tool-call grammar back until the reasoning is over
        name = forced_name(req.tool_choice)
        return [ChatChoiceOutput(ForcedToolParser(state.tokenizer, name),
                                 reasoning(state.tokenizer) if reasoning else None,
                                 parallel_tool_calls=req.parallel_tool_calls is not False) for _ in range(n)]
    tools = state.tool_parser_cls if (req.tools and req.tool_choice in (None, "auto")
                                      and state.settings.enable_auto_tool_choice) else None
    if tools is None and reasoning is None:
        return None
    return [ChatChoiceOutput(tools(state.tokenizer) if tools else None,
                             reasoning(state.tokenizer) if reasoning else None,
                             parallel_tool_calls=req.parallel_tool_calls is not False) for _ in range(n)]


class _LogprobsFormatter:
    """Chat logprobs: one {"token", "logprob", "bytes", "top_logprobs"} entry per token."""

    def __init__(self, state: ServerState, k: Optional[int], as_ids: bool) -> None:
        self.state = state
        self.k = k
        self.as_ids = as_ids

    def logprobs(self, token_ids: list[int], lps: Optional[list[dict[int, float]]]) -> Optional[list[dict]]:
        if self.k is None or lps is None:
            return None
        st = self.state
        content = []
        for tid, entry in zip(token_ids, lps):
            s = st.token_str(tid, self.as_ids)
            top = sorted(entry.items(), key=lambda kv: -kv[1])[: self.k]
            content.append({
                "token": s, "logprob": clamp(entry.get(tid, LOGPROB_FLOOR)), "bytes": list(s.encode("utf-8")),
                "top_logprobs": [{"token": (ts := st.token_str(t, self.as_ids)), "logprob": clamp(v),
                                  "bytes": list(ts.encode("utf-8"))} for t, v in top],
            })
        return content


def _check(req: ChatCompletionRequest, enable_auto_tool_choice: bool = False) -> Optional[int]:
    """The parameters this server does not support or bounds; returns top_logprobs' k (None: no logprobs)."""
    if from_response_format(req.response_format) is not None and req.structured_outputs is not None:
        raise E.bad_request("Set response_format or structured_outputs, not both.", "structured_outputs",
                            "invalid_value")
    if is_forced(req.tool_choice):
        if from_response_format(req.response_format) is not None or req.structured_outputs is not None:
            raise E.bad_request("tool_choice 'required' or a named function cannot be combined with "
                                "response_format or structured_outputs.", "tool_choice", "invalid_value")
    elif req.tool_choice == "auto" and not enable_auto_tool_choice:
        raise E.bad_request('"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be '
                            "set: start the server with --enable-auto-tool-choice --tool-call-parser NAME.",
                            "tool_choice", "invalid_value")
    elif req.tool_choice is not None and req.tool_choice not in ("none", "auto"):
        raise E.bad_request(f"tool_choice must be 'none', 'auto', 'required' or "
                            f"{{'type': 'function', 'function': {{'name': NAME}}}}, got {req.tool_choice!r}.",
                            "tool_choice", "invalid_value")
    if req.top_logprobs is not None:
        if not req.logprobs:
            raise E.bad_request("top_logprobs requires logprobs to be true.", "top_logprobs", "invalid_value")
        if not 0 <= req.top_logprobs <= MAX_LOGPROBS:
            raise E.bad_request(f"top_logprobs must be in [0, {MAX_LOGPROBS}], got {req.top_logprobs}.",
                                "top_logprobs", "invalid_value")
    return (req.top_logprobs or 0) if req.logprobs else None


def finished_choice(index: int, ch: Choice, output: Optional[ChatChoiceOutput], logprobs: bool) -> dict[str, Any]:
    """One choice of a finished (not streamed) response."""
    text = "".join(ch.text)
    message = output.message(text) if output is not None else {"role": "assistant", "content": text}
    finish = output.finish_reason(ch.finish_reason) if output is not None else ch.finish_reason
    return {"index": index, "message": message, "logprobs": {"content": ch.lp or []} if logprobs else None,
            "finish_reason": finish, "stop_reason": ch.stop_reason}


def streamed_choice(index: int, text: str, lp: Any, finish: Optional[str], stop_reason: Any,
                    output: Optional[ChatChoiceOutput]) -> Optional[dict[str, Any]]:
    """One choice of a streamed chunk: the new text as a delta of the assistant message (read by the
    parsers when `output` is set: reasoning_content, content, tool_calls). None: nothing to send yet."""
    if output is None:
        delta: dict[str, Any] = {"content": text} if text else {}
    else:
        delta = output.feed(text)
        if finish is not None:
            for key, value in output.finish().items():
                delta[key] = delta.get(key, type(value)()) + value
            finish = output.finish_reason(finish)
        if not delta and lp is None and finish is None:
            return None
    choice: dict[str, Any] = {"index": index, "delta": delta,
                              "logprobs": {"content": lp} if lp is not None else None, "finish_reason": finish}
    if finish is not None:
        choice["stop_reason"] = stop_reason
    return choice


@dataclass
class ChatPlan:
    """A chat request made ready for the engine: the prompt's token ids, the SamplingParams, the engine's
    parameter names as the route calls them, top_logprobs' k (None: no logprobs), and the parsers that
    read each choice's output (None: plain text). Shared by /v1/chat/completions, /v1/messages and
    /v1/responses, which convert their bodies to a ChatCompletionRequest first."""
    ids: list[int]
    params: Any
    rename: dict[str, str]
    k: Optional[int]
    outputs: Optional[list[ChatChoiceOutput]]


async def plan_chat(state: ServerState, req: ChatCompletionRequest, rename: Optional[dict[str, str]] = None,
              structured_param: str = "response_format") -> ChatPlan:
    """Check `req`, render its prompt, build its SamplingParams. `rename` adds to the engine → route
    parameter names; `structured_param` is what a refused response_format is called."""
    k = _check(req, state.settings.enable_auto_tool_choice)
    # The engine's names for what this route calls "messages" and (when used) max_completion_tokens.
    names = {"prompt": "messages"}
    if req.max_completion_tokens is not None:
        names["max_tokens"] = "max_completion_tokens"
    names.update(rename or {})
    state.settings.limits.check(req, 1, names)
    ids = await chat_prompt(state, req.messages, req.tools, bool(req.add_generation_prompt),
                            bool(req.continue_final_message), req.chat_template_kwargs,
                            getattr(req, "chat_template", None))
    requested = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    # None: until the context is full (the engine knows how far that is).
    extra: dict[str, Any] = {}
    structured = from_response_format(req.response_format)
    if structured is not None:     # the engine's errors about it name response_format
        extra["structured_outputs"], names["structured_outputs"] = structured, structured_param
    elif is_forced(req.tool_choice):   # the tools' schemas, enforced; a schema the backend refuses names tools
        schema = forced_schema(req.tools, req.tool_choice, req.parallel_tool_calls)
        extra["structured_outputs"], names["structured_outputs"] = {"json": schema}, "tools"
    params = build_params(req, k, names, max_tokens=requested, **extra)
    n = req.n if req.n is not None else 1
    return ChatPlan(ids, params, names, k, choice_outputs(state, req, n))


async def create_chat_completion(state: ServerState, request: Request) -> Response:
    arrival = time.monotonic()
    req = parse(ChatCompletionRequest, await read_json(request))
    model = state.check_model(req.model)
    plan = await plan_chat(state, req)
    ids, params, rename, k, outputs = plan.ids, plan.params, plan.rename, plan.k, plan.outputs
    n = req.n if req.n is not None else 1
    state.admit(1)
    request_id = f"chatcmpl-{uuid.uuid4().hex}"
    group = RequestGroup(state, request_id, [ids], params, req.priority or 0, arrival, rename)
    fmt = _LogprobsFormatter(state, k, bool(req.return_tokens_as_token_ids))
    created = int(time.time())
    choices = [Choice() for _ in range(n)]
    cached = [0]

    def absorb(_sub: int, d: RequestDelta) -> list[Event]:
        """Update the choices; return per changed choice (index, text, logprobs, finish, stop_reason)."""
        cached[0] = max(cached[0], d.num_cached_tokens)
        events = []
        for c in d.outputs:
            if not 0 <= c.index < n:
                continue
            ch = choices[c.index]
            if c.text:
                ch.text.append(c.text)
            ch.num_tokens += len(c.token_ids)
            lp = fmt.logprobs(c.token_ids, c.logprobs)
            if lp is not None:
                if ch.lp is None:
                    ch.lp = []
                ch.lp.extend(lp)
            if c.finish_reason is not None:
                ch.finish_reason, ch.stop_reason = c.finish_reason, c.stop_reason
            if c.text or lp or c.finish_reason is not None:
                events.append((c.index, c.text, lp, c.finish_reason, c.stop_reason))
        return events

    def total_usage() -> dict[str, Any]:
        return usage(len(ids), sum(ch.num_tokens for ch in choices), cached[0])

    if not req.stream:
        if not await collect(request, group, absorb):
            return Response(status_code=499)
        out = [finished_choice(j, ch, outputs[j] if outputs else None, k is not None)
               for j, ch in enumerate(choices)]
        return JSONResponse({"id": request_id, "object": "chat.completion", "created": created, "model": model,
                             "choices": out, "usage": total_usage()})

    def shape(index: int, text: str, lp: Any, finish: Optional[str], stop_reason: Any) -> Optional[dict[str, Any]]:
        return streamed_choice(index, text, lp, finish, stop_reason, outputs[index] if outputs else None)

    def opening() -> list[dict[str, Any]]:
        """The stream opens with an empty assistant message per choice."""
        return [{"index": j, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
                for j in range(n)]

    head = {"id": request_id, "object": "chat.completion.chunk", "created": created, "model": model}
    return await stream(request, group, head=head,
                        include_usage=bool(req.stream_options and req.stream_options.include_usage),
                        opening=opening, absorb=absorb, shape=shape, usage=total_usage)
