"""The OpenAI-compatible FastAPI app: routes, validation, streaming, cancellation, metrics.

The engine runs in its own process (see engine_client.py); this process does HTTP, JSON,
chat templates, tokenization of prompts and formatting of the engine's deltas.

One request, from HTTP to tokens (`_completions` and `_chat` follow the same path):
  1. parse and check the body, tokenize the prompt(s), build the SamplingParams;
  2. `_Group` adds one engine request per prompt; the engine's deltas arrive on the group's queue;
  3. the route's `absorb` folds each delta into its `_Choice`s and says which choices changed;
  4. non-streamed: `_collect` absorbs until the end, then the route builds one JSON body;
     streamed: `_stream` turns every change into an SSE chunk shaped by the route's `shape`.
A client that disconnects gets its engine requests aborted (`_Group.close`) in both cases.
"""
from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
import uuid
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable, Iterable, Optional

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ... import __version__
from ...core.sampling_params import SamplingParams
from . import errors as E
from .engine_client import EngineClient, EngineDeadError, EngineError, RequestDelta
from .metrics import CONTENT_TYPE_LATEST, ServerMetrics
from .protocol import (ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest,
                       parse)

logger = logging.getLogger("tokenmill.serve")

MAX_LOGPROBS = 20
MAX_N = 128
_LOGPROB_FLOOR = -9999.0


@dataclass
class ServerSettings:
    served_model_names: list[str]
    api_keys: list[str] = field(default_factory=list)
    max_waiting_requests: Optional[int] = None
    max_request_body_bytes: int = 8 * 1024 * 1024
    host: str = "127.0.0.1"
    port: int = 8000


# ================================================================================== helpers
def _dumps(obj: Any) -> str:
    return json.dumps(obj, separators=(",", ":"))


def _sse(obj: Any) -> str:
    return f"data: {_dumps(obj)}\n\n"


def _error_response(err: E.APIError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status, headers=err.headers)


class _Guard:
    """Pure-ASGI middleware: API-key check on /v1/*, /tokenize, /detokenize; body-size limit (413)."""

    PROTECTED_PREFIXES = ("/v1/", "/tokenize", "/detokenize")

    def __init__(self, app: Any, settings: ServerSettings) -> None:
        self.app = app
        self.keys = [k.encode() for k in settings.api_keys]
        self.limit = settings.max_request_body_bytes

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope.get("path", "")
        headers = dict(scope.get("headers") or [])
        if self.keys and (path == "/v1" or path.startswith(self.PROTECTED_PREFIXES)):
            auth = headers.get(b"authorization", b"")
            token = auth[7:].strip() if auth[:7].lower() == b"bearer " else b""
            if not token or not any(hmac.compare_digest(token, k) for k in self.keys):
                return await _error_response(E.invalid_api_key(bool(auth)))(scope, receive, send)
        if scope.get("method") in ("POST", "PUT", "PATCH"):
            length = headers.get(b"content-length")
            try:
                if length is not None and int(length) > self.limit:
                    return await _error_response(E.request_too_large(self.limit))(scope, receive, send)
            except ValueError:
                return await _error_response(E.bad_request("Invalid Content-Length header."))(scope, receive, send)
            # Buffer the body (chunked uploads included) up to the limit, then replay it.
            chunks: list[bytes] = []
            size = 0
            while True:
                message = await receive()
                if message["type"] == "http.disconnect":
                    return
                chunk = message.get("body", b"")
                size += len(chunk)
                if size > self.limit:
                    return await _error_response(E.request_too_large(self.limit))(scope, receive, send)
                chunks.append(chunk)
                if not message.get("more_body", False):
                    break
            body = b"".join(chunks)
            replayed = False

            async def replay() -> dict:
                nonlocal replayed
                if not replayed:
                    replayed = True
                    return {"type": "http.request", "body": body, "more_body": False}
                return await receive()

            return await self.app(scope, replay, send)
        return await self.app(scope, receive, send)


async def _read_json(request: Request) -> Any:
    raw = await request.body()
    try:
        return json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        raise E.bad_request("We could not parse the JSON body of your request. The body must be valid JSON.",
                            None, "invalid_json") from None


async def _wait_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


class _ClientGone(Exception):
    pass


async def _race_disconnect(request: Request, coro: Any) -> Any:
    """Await `coro`, but give up (raise _ClientGone) as soon as the client disconnects."""
    task = asyncio.ensure_future(coro)
    watcher = asyncio.ensure_future(_wait_disconnect(request))
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:
        task.cancel()
        watcher.cancel()
        raise
    if task in done:
        watcher.cancel()
        return task.result()
    task.cancel()
    raise _ClientGone()


class _SSEResponse(StreamingResponse):
    """A streaming response that always runs `on_close` (abort whatever is unfinished), even when the
    client goes away before the body iterator started."""

    def __init__(self, content: AsyncIterator[str], on_close: Any) -> None:
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._on_close = on_close

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()


# ================================================================================== request group
class _Choice:
    __slots__ = ("text", "num_tokens", "finish_reason", "stop_reason", "lp", "offset")

    def __init__(self) -> None:
        self.text: list[str] = []
        self.num_tokens = 0
        self.finish_reason: Optional[str] = None
        self.stop_reason: Any = None
        self.lp: Any = None       # accumulated logprobs (format depends on the route)
        self.offset = 0           # text offset for completions logprobs


class _Group:
    """The engine requests behind one HTTP request (one per prompt), sharing one output queue."""

    def __init__(self, state: "_State", request_id: str, prompts: list[list[int]], params: SamplingParams,
                 priority: int, arrival: float) -> None:
        self.state = state
        self.client = state.client
        self.q: asyncio.Queue = asyncio.Queue()
        self.sub_ids = [request_id if len(prompts) == 1 else f"{request_id}-{i}" for i in range(len(prompts))]
        self.index = {sid: i for i, sid in enumerate(self.sub_ids)}
        self.unfinished: set[str] = set()
        self.arrival = arrival
        self.first: dict[str, float] = {}
        self.last: dict[str, float] = {}
        self.itls: dict[str, list[float]] = {sid: [] for sid in self.sub_ids}
        self.reasons: dict[str, Optional[str]] = {}
        self.closed = False
        state.groups.add(self)
        try:
            for sid, ids in zip(self.sub_ids, prompts):
                self.client.add(sid, {"prompt_token_ids": ids}, params, priority, q=self.q)
                self.unfinished.add(sid)
        except EngineDeadError:
            self.close(count_aborts=False)
            raise E.engine_dead() from None

    async def next(self) -> Optional[tuple[int, RequestDelta]]:
        if not self.unfinished:
            return None
        item = await self.q.get()
        if isinstance(item, RequestDelta):
            sid = item.request_id
            now = time.monotonic()
            if sid not in self.first:
                self.first[sid] = now
            else:
                self.itls[sid].append(now - self.last[sid])
            self.last[sid] = now
            for c in item.outputs:
                if c.index == 0 and c.finish_reason is not None:
                    self.reasons[sid] = c.finish_reason
            if item.finished:
                self.unfinished.discard(sid)
                reason = self.reasons.get(sid) or next(
                    (c.finish_reason for c in item.outputs if c.finish_reason), "stop")
                m = self.state.metrics
                ttft = self.first[sid] - self.arrival
                if reason == "abort":
                    m.request_was_aborted(ttft, self.itls[sid])
                else:
                    m.request_finished(reason, ttft, self.itls[sid], now - self.arrival, item.queue_time)
            return self.index[sid], item
        if isinstance(item, _ShuttingDown):
            self.close()
            raise E.APIError(503, "The server is shutting down; the request was aborted.", "server_error", None,
                             "server_shutting_down")
        if isinstance(item, EngineError):
            self.unfinished.discard(item.request_id)
            self.close(count_aborts=False)
            if item.kind == "value":
                exc = ValueError(item.message)
                exc.param = item.param  # type: ignore[attr-defined]
                raise E.from_engine_value_error(exc, "prompt")
            raise E.internal_error(f"The engine refused the request: {item.message}")
        self.unfinished.clear()
        raise E.engine_dead()

    def close(self, count_aborts: bool = True) -> None:
        """Abort every engine request that has not finished (idempotent)."""
        if self.closed:
            return
        self.closed = True
        self.state.groups.discard(self)
        if self.unfinished:
            rids = list(self.unfinished)
            self.unfinished.clear()
            self.client.abort(rids)
            if count_aborts:
                for sid in rids:
                    ttft = self.first[sid] - self.arrival if sid in self.first else None
                    self.state.metrics.request_was_aborted(ttft, self.itls.get(sid))


class _ShuttingDown:
    """Put into a group's queue to end it: the server is shutting down."""


# ================================================================================== app state
class _State:
    def __init__(self, client: EngineClient, settings: ServerSettings) -> None:
        assert client.info is not None
        self.client = client
        self.settings = settings
        self.info = client.info
        self.tokenizer = client.tokenizer
        self.model_name = settings.served_model_names[0] if settings.served_model_names else client.info.model_name
        self.model_names = settings.served_model_names or [self.model_name]
        self.metrics = ServerMetrics(self.model_name)
        self.created = int(time.time())
        self._tok_str: dict[int, str] = {}
        self.groups: set[_Group] = set()

    async def drain(self, timeout: float) -> None:
        """On shutdown: let in-flight requests finish for `timeout` seconds, then abort the rest (their
        streams end with an error event, non-streamed ones get a 503)."""
        deadline = time.monotonic() + timeout
        while self.groups and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if self.groups:
            logger.info("aborting %d in-flight request(s) for shutdown", len(self.groups))
        for group in list(self.groups):
            group.q.put_nowait(_ShuttingDown())

    # ---------------------------------------------------------------- checks
    def check_model(self, model: Optional[str]) -> str:
        if model is None or model == "" or model in self.model_names:
            return self.model_name
        raise E.model_not_found(model)

    def admit(self, num_requests: int) -> None:
        limit = self.settings.max_waiting_requests
        if limit is not None and self.client.num_waiting_estimate + num_requests > limit:
            raise E.server_overloaded()
        if not self.client.is_alive:
            raise E.engine_dead()

    def check_ids(self, ids: list[int], param: str) -> None:
        vocab = self.info.vocab_size
        for t in ids:
            if not isinstance(t, int) or isinstance(t, bool) or t < 0 or t >= vocab:
                raise E.bad_request(f"Token id {t!r} is out of vocabulary (0..{vocab - 1}).", param, "invalid_value")

    def check_length(self, prompt_len: int, max_tokens: Optional[int], param: str) -> int:
        """Return the max_tokens to use; raise context_length_exceeded when it cannot fit."""
        limit = self.info.max_model_len
        if prompt_len == 0:
            raise E.bad_request("The prompt is empty.", param, "invalid_value")
        if prompt_len + 1 > limit:
            raise E.context_length_exceeded(
                f"This model's maximum context length is {limit} tokens. However, your prompt has "
                f"{prompt_len} tokens. Please reduce the length of the prompt.", param)
        if max_tokens is not None and prompt_len + max_tokens > limit:
            raise E.context_length_exceeded(
                f"This model's maximum context length is {limit} tokens. However, you requested "
                f"{prompt_len + max_tokens} tokens ({prompt_len} in the prompt, {max_tokens} in the completion). "
                f"Please reduce the length of the prompt or of max_tokens.", "max_tokens")
        return limit - prompt_len

    # ---------------------------------------------------------------- tokenizer
    def token_str(self, tid: int, as_id: bool = False) -> str:
        if as_id:
            return f"token_id:{tid}"
        s = self._tok_str.get(tid)
        if s is None:
            s = self.tokenizer.decode([tid])
            self._tok_str[tid] = s
        return s

    def chat_prompt(self, messages: list[Any], tools: Any = None, add_generation_prompt: bool = True,
                    continue_final_message: bool = False, kwargs: Optional[dict] = None) -> list[int]:
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
                                            f"messages.[{i}].content", "invalid_value")
                d["content"] = "".join(parts)
            if d.get("role") == "developer":
                d["role"] = "system"
            if d.get("role") not in ("system", "user", "assistant", "tool"):
                raise E.bad_request(f"Invalid role {d.get('role')!r}.", f"messages.[{i}].role", "invalid_value")
            msgs.append(d)
        extra = dict(kwargs or {})
        if tools:
            extra["tools"] = tools
        try:
            text = self.tokenizer.apply_chat_template(
                msgs, add_generation_prompt=add_generation_prompt and not continue_final_message,
                continue_final_message=continue_final_message, tokenize=False, **extra)
        except Exception as exc:   # jinja errors: a template that refuses these messages
            raise E.bad_request(f"The chat template could not render these messages: {exc}", "messages") from None
        if not isinstance(text, str):
            raise E.internal_error("The chat template did not produce text.")
        return list(self.tokenizer.encode(text, add_special_tokens=False))


def _build_params(req: Any, max_tokens: int, logprobs: Optional[int]) -> SamplingParams:
    kw: dict[str, Any] = {}
    for name in ("n", "temperature", "top_p", "top_k", "min_p", "seed", "presence_penalty", "frequency_penalty",
                 "repetition_penalty", "min_tokens", "stop", "stop_token_ids", "ignore_eos",
                 "include_stop_str_in_output", "skip_special_tokens", "spaces_between_special_tokens",
                 "logit_bias"):
        value = getattr(req, name, None)
        if value is not None:
            kw[name] = value
    if req.n is not None and req.n > MAX_N:
        raise E.bad_request(f"n must be at most {MAX_N}, got {req.n}.", "n", "invalid_value")
    kw["max_tokens"] = max_tokens
    if logprobs is not None:
        kw["logprobs"] = logprobs
    try:
        return SamplingParams(**kw)
    except ValueError as exc:
        raise E.from_engine_value_error(exc) from None


def _clamp(lp: float) -> float:
    return lp if lp == lp and lp > _LOGPROB_FLOOR else _LOGPROB_FLOOR


def _usage(prompt_tokens: int, completion_tokens: int, cached: int = 0) -> dict[str, Any]:
    usage: dict[str, Any] = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                             "total_tokens": prompt_tokens + completion_tokens}
    return usage


# ================================================================================== driving a group
# A change to one choice, as `absorb` reports it: (index, new text, new logprobs, finish_reason, stop_reason).
_Event = tuple[int, str, Any, Optional[str], Any]
# A route's `absorb(prompt_index, delta)`: fold one engine delta into its choices, return what changed.
_Absorb = Callable[[int, RequestDelta], Iterable[_Event]]


async def _collect(request: Request, group: _Group, absorb: _Absorb) -> bool:
    """Non-streamed: feed every delta to `absorb` until the engine is done. Returns False when the client
    disconnected first. Either way the group is closed (unfinished engine requests aborted) on return."""
    async def drain() -> None:
        while (item := await group.next()) is not None:
            absorb(*item)
    try:
        await _race_disconnect(request, drain())
    except _ClientGone:
        return False
    finally:
        group.close()
    return True


async def _stream(request: Request, group: _Group, *, head: dict[str, Any], include_usage: bool,
                  opening: list[dict[str, Any]], absorb: _Absorb, shape: Callable[..., dict[str, Any]],
                  usage: Callable[[], dict[str, Any]]) -> Response:
    """Streamed: an SSE response of chunks `{**head, "choices": [choice]}` — first the `opening` choices,
    then `shape(*event)` for every event `absorb` reports, then (with include_usage) a usage chunk, then
    [DONE]. An API error mid-stream becomes an error event. The group is closed when the stream ends or
    the client disconnects."""
    try:   # wait for the first output, so that errors the engine finds are still a plain HTTP error
        first = await _race_disconnect(request, group.next())
    except _ClientGone:
        group.close()
        return Response(status_code=499)
    except BaseException:
        group.close()
        raise

    def chunk(choice: dict[str, Any]) -> str:
        obj = {**head, "choices": [choice]}
        if include_usage:
            obj["usage"] = None
        return _sse(obj)

    async def events() -> AsyncIterator[str]:
        try:
            for choice in opening:
                yield chunk(choice)
            item = first
            while item is not None:
                for event in absorb(*item):
                    yield chunk(shape(*event))
                item = await group.next()
            if include_usage:
                yield _sse({**head, "choices": [], "usage": usage()})
            yield "data: [DONE]\n\n"
        except E.APIError as err:
            yield err.sse()
            yield "data: [DONE]\n\n"
        finally:
            group.close()

    return _SSEResponse(events(), group.close)


# ================================================================================== completions
class _CompletionFormatter:
    def __init__(self, state: _State, req: CompletionRequest, k: Optional[int]) -> None:
        self.state = state
        self.k = k
        self.as_ids = bool(req.return_tokens_as_token_ids)

    def logprobs(self, choice: _Choice, token_ids: list[int], lps: Optional[list[dict[int, float]]]
                 ) -> Optional[dict[str, Any]]:
        if self.k is None or lps is None:
            return None
        st = self.state
        out: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for tid, entry in zip(token_ids, lps):
            s = st.token_str(tid, self.as_ids)
            out["tokens"].append(s)
            out["token_logprobs"].append(_clamp(entry.get(tid, _LOGPROB_FLOOR)))
            top = sorted(entry.items(), key=lambda kv: -kv[1])[: self.k]
            if tid not in dict(top):
                top.append((tid, entry.get(tid, _LOGPROB_FLOOR)))
            out["top_logprobs"].append({st.token_str(t, self.as_ids): _clamp(v) for t, v in top})
            out["text_offset"].append(choice.offset)
            choice.offset += len(s)
        return out


@dataclass
class _Prepared:
    request_id: str
    model: str
    prompts: list[list[int]]
    prompt_texts: list[Optional[str]]
    params: SamplingParams
    priority: int
    arrival: float
    n: int


def _prepare_completion(state: _State, req: CompletionRequest, arrival: float) -> _Prepared:
    model = state.check_model(req.model)
    if req.suffix is not None:
        raise E.bad_request("suffix is not supported.", "suffix", "unsupported_parameter")
    n = req.n if req.n is not None else 1
    if req.best_of is not None and req.best_of != n:
        raise E.bad_request("best_of must equal n (beam search is not supported).", "best_of", "unsupported_parameter")
    if req.logprobs is not None and not 0 <= req.logprobs <= MAX_LOGPROBS:
        raise E.bad_request(f"logprobs must be in [0, {MAX_LOGPROBS}], got {req.logprobs}.", "logprobs",
                            "invalid_value")
    raw = req.prompt
    if isinstance(raw, str):
        items: list[Any] = [raw]
    elif len(raw) == 0:
        raise E.bad_request("The prompt is empty.", "prompt", "invalid_value")
    elif all(isinstance(x, int) for x in raw):
        items = [list(raw)]
    else:
        items = list(raw)
    prompts: list[list[int]] = []
    texts: list[Optional[str]] = []
    tok = state.tokenizer
    add_special = req.add_special_tokens if req.add_special_tokens is not None else True
    for item in items:
        if isinstance(item, str):
            ids = list(tok.encode(item, add_special_tokens=add_special))
            texts.append(item)
        else:
            ids = list(item)
            state.check_ids(ids, "prompt")
            texts.append(None)
        prompts.append(ids)
    room = min(state.check_length(len(ids), req.max_tokens, "prompt") for ids in prompts)
    max_tokens = req.max_tokens if req.max_tokens is not None else min(16, room)
    params = _build_params(req, max_tokens, req.logprobs)
    if req.echo:
        texts = [t if t is not None else tok.decode(ids) for t, ids in zip(texts, prompts)]
    return _Prepared(f"cmpl-{uuid.uuid4().hex}", model, prompts, texts, params, req.priority or 0, arrival, n)


async def _completions(state: _State, request: Request) -> Response:
    arrival = time.monotonic()
    req = parse(CompletionRequest, await _read_json(request))
    p = _prepare_completion(state, req, arrival)
    state.admit(len(p.prompts))
    group = _Group(state, p.request_id, p.prompts, p.params, p.priority, arrival)
    fmt = _CompletionFormatter(state, req, req.logprobs)
    created = int(time.time())
    choices = {(i, j): _Choice() for i in range(len(p.prompts)) for j in range(p.n)}
    echo = bool(req.echo)
    if echo:
        for (i, j), ch in choices.items():
            ch.offset = len(p.prompt_texts[i] or "")

    def absorb(sub: int, d: RequestDelta) -> list[_Event]:
        """Update the choices; return per changed choice (index, text, logprobs, finish, stop_reason)."""
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
                events.append((sub * p.n + c.index, c.text, lp, c.finish_reason, c.stop_reason))
        return events

    def usage() -> dict[str, Any]:
        return _usage(sum(len(x) for x in p.prompts), sum(ch.num_tokens for ch in choices.values()))

    def shape(index: int, text: str, lp: Any, finish: Optional[str], stop_reason: Any) -> dict[str, Any]:
        """One choice of a response body or of a streamed chunk (both have the same shape here)."""
        return {"index": index, "text": text, "logprobs": lp, "finish_reason": finish, "stop_reason": stop_reason}

    if not req.stream:
        if not await _collect(request, group, absorb):
            return Response(status_code=499)
        out = []
        for (i, j), ch in sorted(choices.items()):
            text = "".join(ch.text)
            if echo:
                text = (p.prompt_texts[i] or "") + text
            out.append(shape(i * p.n + j, text, ch.lp, ch.finish_reason, ch.stop_reason))
        return JSONResponse({"id": p.request_id, "object": "text_completion", "created": created, "model": p.model,
                             "choices": out, "usage": usage()})

    # With echo, the stream opens with each prompt's text, once per choice of that prompt.
    opening = [shape(i * p.n + j, t or "", None, None, None)
               for i, t in enumerate(p.prompt_texts) for j in range(p.n)] if echo else []
    return await _stream(
        request, group, head={"id": p.request_id, "object": "text_completion", "created": created, "model": p.model},
        include_usage=bool(req.stream_options and req.stream_options.include_usage),
        opening=opening, absorb=absorb, shape=shape, usage=usage)


# ================================================================================== chat
class _ChatFormatter:
    def __init__(self, state: _State, k: Optional[int], as_ids: bool) -> None:
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
                "token": s, "logprob": _clamp(entry.get(tid, _LOGPROB_FLOOR)), "bytes": list(s.encode("utf-8")),
                "top_logprobs": [{"token": (ts := st.token_str(t, self.as_ids)), "logprob": _clamp(v),
                                  "bytes": list(ts.encode("utf-8"))} for t, v in top],
            })
        return content


async def _chat(state: _State, request: Request) -> Response:
    arrival = time.monotonic()
    req = parse(ChatCompletionRequest, await _read_json(request))
    model = state.check_model(req.model)
    if req.response_format and req.response_format.get("type", "text") != "text":
        raise E.bad_request("Only response_format {\"type\": \"text\"} is supported.", "response_format",
                            "unsupported_parameter")
    if req.tool_choice is not None and req.tool_choice not in ("none", "auto"):
        raise E.bad_request("tool_choice other than 'none' or 'auto' is not supported (no tool-call parser).",
                            "tool_choice", "unsupported_parameter")
    if req.top_logprobs is not None:
        if not req.logprobs:
            raise E.bad_request("top_logprobs requires logprobs to be true.", "top_logprobs", "invalid_value")
        if not 0 <= req.top_logprobs <= MAX_LOGPROBS:
            raise E.bad_request(f"top_logprobs must be in [0, {MAX_LOGPROBS}], got {req.top_logprobs}.",
                                "top_logprobs", "invalid_value")
    k = (req.top_logprobs or 0) if req.logprobs else None
    ids = state.chat_prompt(req.messages, req.tools, bool(req.add_generation_prompt),
                            bool(req.continue_final_message), req.chat_template_kwargs)
    requested = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
    if requested is not None and requested < 1:
        raise E.bad_request(f"{param} must be at least 1, got {requested}.", param, "invalid_value")
    room = state.check_length(len(ids), requested, "messages")
    params = _build_params(req, requested if requested is not None else room, k)
    n = req.n if req.n is not None else 1
    state.admit(1)
    request_id = f"chatcmpl-{uuid.uuid4().hex}"
    group = _Group(state, request_id, [ids], params, req.priority or 0, arrival)
    fmt = _ChatFormatter(state, k, bool(req.return_tokens_as_token_ids))
    created = int(time.time())
    choices = [_Choice() for _ in range(n)]

    def absorb(_sub: int, d: RequestDelta) -> list[_Event]:
        """Update the choices; return per changed choice (index, text, logprobs, finish, stop_reason)."""
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
                ch.lp = (ch.lp or []) + lp
            if c.finish_reason is not None:
                ch.finish_reason, ch.stop_reason = c.finish_reason, c.stop_reason
            if c.text or lp or c.finish_reason is not None:
                events.append((c.index, c.text, lp, c.finish_reason, c.stop_reason))
        return events

    def usage() -> dict[str, Any]:
        return _usage(len(ids), sum(ch.num_tokens for ch in choices))

    if not req.stream:
        if not await _collect(request, group, absorb):
            return Response(status_code=499)
        out = [{"index": j, "message": {"role": "assistant", "content": "".join(ch.text)},
                "logprobs": {"content": ch.lp or []} if k is not None else None,
                "finish_reason": ch.finish_reason, "stop_reason": ch.stop_reason}
               for j, ch in enumerate(choices)]
        return JSONResponse({"id": request_id, "object": "chat.completion", "created": created, "model": model,
                             "choices": out, "usage": usage()})

    def shape(index: int, text: str, lp: Any, finish: Optional[str], stop_reason: Any) -> dict[str, Any]:
        """One choice of a streamed chunk: the new text as a delta of the assistant message."""
        choice: dict[str, Any] = {"index": index, "delta": {"content": text} if text else {},
                                  "logprobs": {"content": lp} if lp is not None else None, "finish_reason": finish}
        if finish is not None:
            choice["stop_reason"] = stop_reason
        return choice

    # The stream opens with an empty assistant message per choice.
    opening = [{"index": j, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
               for j in range(n)]
    return await _stream(
        request, group, head={"id": request_id, "object": "chat.completion.chunk", "created": created, "model": model},
        include_usage=bool(req.stream_options and req.stream_options.include_usage),
        opening=opening, absorb=absorb, shape=shape, usage=usage)


# ================================================================================== app
def create_app(client: EngineClient, settings: ServerSettings) -> FastAPI:
    state = _State(client, settings)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        client.on_stats = state.metrics.update_stats
        client.attach(asyncio.get_running_loop())
        logger.info("OpenAI-compatible API for model %r at http://%s:%d/v1", state.model_name,
                    settings.host, settings.port)
        try:
            yield
        finally:
            client.shutdown()

    app = FastAPI(title="tokenmill", version=__version__, lifespan=lifespan, docs_url=None, redoc_url=None,
                  openapi_url=None)
    app.state.tokenmill = state

    @app.exception_handler(E.APIError)
    async def _api_error(request: Request, exc: E.APIError) -> JSONResponse:
        return _error_response(exc)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        if exc.status_code == 404:
            err = E.APIError(404, f"Invalid URL ({request.method} {request.url.path})", "invalid_request_error",
                             None, "not_found")
        elif exc.status_code == 405:
            err = E.APIError(405, f"Method {request.method} is not allowed on {request.url.path}",
                             "invalid_request_error", None, "method_not_allowed")
        else:
            err = E.APIError(exc.status_code, str(exc.detail), "invalid_request_error")
        return _error_response(err)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("unexpected error on %s %s", request.method, request.url.path)
        return _error_response(E.internal_error())

    @app.get("/health")
    async def health() -> Response:
        if await client.ping(timeout=10.0):
            return Response(status_code=200)
        return _error_response(E.engine_dead())

    @app.get("/ping")
    async def ping() -> Response:
        return await health()

    @app.get("/version")
    async def version() -> JSONResponse:
        return JSONResponse({"version": __version__})

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(state.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    def model_card(name: str) -> dict[str, Any]:
        return {"id": name, "object": "model", "created": state.created, "owned_by": "tokenmill",
                "root": state.info.model_path or state.info.model_name, "parent": None,
                "max_model_len": state.info.max_model_len}

    @app.get("/v1/models")
    async def list_models() -> JSONResponse:
        return JSONResponse({"object": "list", "data": [model_card(m) for m in state.model_names]})

    @app.get("/v1/models/{model_id:path}")
    async def get_model(model_id: str) -> JSONResponse:
        if model_id not in state.model_names:
            raise E.model_not_found(model_id)
        return JSONResponse(model_card(model_id))

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await _completions(state, request)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await _chat(state, request)

    @app.post("/tokenize")
    async def tokenize(request: Request) -> JSONResponse:
        req = parse(TokenizeRequest, await _read_json(request))
        state.check_model(req.model)
        if req.messages is not None:
            if not req.messages:
                raise E.bad_request("messages must not be empty.", "messages", "invalid_value")
            ids = state.chat_prompt(req.messages, None, bool(req.add_generation_prompt),
                                    bool(req.continue_final_message))
        elif req.prompt is not None:
            add_special = req.add_special_tokens if req.add_special_tokens is not None else True
            ids = list(state.tokenizer.encode(req.prompt, add_special_tokens=add_special))
        else:
            raise E.bad_request("Either prompt or messages is required.", "prompt", "missing_required_parameter")
        body: dict[str, Any] = {"count": len(ids), "max_model_len": state.info.max_model_len, "tokens": ids}
        if req.return_token_strs:
            body["token_strs"] = state.tokenizer.convert_ids_to_tokens(ids)
        return JSONResponse(body)

    @app.post("/detokenize")
    async def detokenize(request: Request) -> JSONResponse:
        req = parse(DetokenizeRequest, await _read_json(request))
        state.check_model(req.model)
        state.check_ids(req.tokens, "tokens")
        return JSONResponse({"prompt": state.tokenizer.decode(req.tokens)})

    guard = _Guard(app, settings)
    guard.state = state   # type: ignore[attr-defined]
    return guard  # type: ignore[return-value]
