"""What the generating routes share: server state, the engine requests behind one HTTP request,
and the two ways of answering (one JSON body, or an SSE stream).

One request, from HTTP to tokens (serving_completions.py and serving_chat.py follow this path):
  1. parse and check the body, tokenize the prompt(s), build the SamplingParams; the engine
     validates the rest (prompt length, vocabulary, max_tokens) and refuses with a RequestError;
  2. `RequestGroup` adds one engine request per prompt; their deltas arrive on the group's queue;
  3. the route's `absorb` folds each delta into its `Choice`s and says which choices changed;
  4. non-streamed: `collect` absorbs until the end, then the route builds one JSON body;
     streamed: `stream` turns every change into an SSE chunk shaped by the route's `shape`.
A client that disconnects gets its engine requests aborted (`RequestGroup.close`) in both cases.
"""
from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable, Iterable, Mapping, Optional

from fastapi import Request
from fastapi.responses import Response

from ...core.outputs import RequestDelta
from ...core.sampling_params import SamplingParams
from . import errors as E
from .chat_output import parser_class
from .engine_client import EngineClient, EngineDeadError
from .http import SSE_DONE, ClientGone, SSEResponse, race_disconnect, sse
from .limits import RequestLimits, prompt_byte_bound
from .metrics import ServerMetrics
from .served_names import check_served_model, default_served_name, engine_prompt  # noqa: F401 (re-exported)
from .workers import Workers

logger = logging.getLogger("tokenmill.serve")

MAX_LOGPROBS = 20
DEFAULT_QUEUE_FACTOR = 4    # without --max-waiting-requests: at most 4 x max_num_seqs requests wait
LOGPROB_FLOOR = -9999.0     # what -inf / nan logprobs are reported as (JSON has no -inf)


@dataclass
class ServerSettings:
    served_model_names: list[str]
    api_keys: list[str] = field(default_factory=list)
    max_waiting_requests: Optional[int] = None  # None: DEFAULT_QUEUE_FACTOR x max_num_seqs
    restart_engine: bool = False                # --restart-engine: a dead engine process is started again
    max_request_body_bytes: int = 8 * 1024 * 1024
    host: str = "127.0.0.1"
    port: int = 8000
    tool_call_parser: Optional[str] = None      # a registered tool parser's name (chat_output.py)
    enable_auto_tool_choice: bool = False       # tool_choice "auto" reads tool calls with it
    reasoning_parser: Optional[str] = None
    chat_template: Optional[str] = None         # --chat-template: replaces the tokenizer's own
    generation_defaults: dict[str, Any] = field(default_factory=dict)   # --generation-config FOLDER
    max_stored_responses: int = 1000            # /v1/responses kept for previous_response_id (LRU)
    batch_dir: Optional[str] = None             # /v1/files, /v1/batches state (None: ~/.cache/tokenmill/batches)
    limits: RequestLimits = field(default_factory=RequestLimits)   # per-request bounds and templates (limits.py)
    metrics_registry: Any = None                # a prometheus registry several models share (model_router.py)


class ServerState:
    """Everything the routes need: the engine client, the tokenizer, the served names, metrics."""

    def __init__(self, client: EngineClient, settings: ServerSettings) -> None:
        assert client.info is not None, "start the engine client first"
        self.client = client
        self.settings = settings
        self.info = client.info
        self.tokenizer = client.tokenizer
        if settings.chat_template is not None:     # the server's own copy of the tokenizer
            self.tokenizer.chat_template = settings.chat_template
        self.model_name = (settings.served_model_names[0] if settings.served_model_names
                           else default_served_name(client.info.model_name))
        self.model_names = settings.served_model_names or [self.model_name]
        self.shutting_down = False
        self.workers = Workers(settings.limits, self.tokenizer)     # tokenizing and templating, off the loop
        self.max_prompt_bytes = prompt_byte_bound(settings.limits, self.info.max_model_len, self.tokenizer)
        self.metrics = ServerMetrics(self.model_name, settings.metrics_registry)
        self.tracer: Any = None     # a tracing.RequestTracer under --otlp-traces-endpoint (app.py sets it)
        self.created = int(time.time())
        self._tok_str: dict[int, str] = {}
        # The parser classes (ValueError for an unknown name); one instance per choice of a request.
        self.tool_parser_cls = parser_class("tool_parser", settings.tool_call_parser)
        self.reasoning_parser_cls = parser_class("reasoning_parser", settings.reasoning_parser)

    async def drain(self, timeout: float) -> None:
        """On shutdown: let in-flight requests finish for `timeout` seconds, then abort the rest (their
        streams end with an error event, non-streamed ones get a 503)."""
        self.shutting_down = True
        deadline = time.monotonic() + timeout
        while self.client.num_in_flight and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if self.client.num_in_flight:
            logger.info("aborting %d in-flight request(s) for shutdown", self.client.num_in_flight)
            self.client.abort_all(E.ServerShuttingDown())

    def check_model(self, model: Optional[str]) -> str:
        """The name to answer with (a LoRA adapter's own: the request then runs on it), else 404."""
        return check_served_model(self, model)

    @property
    def max_waiting_requests(self) -> int:
        """--max-waiting-requests, else DEFAULT_QUEUE_FACTOR x max_num_seqs: drained in a few batch rounds."""
        limit = self.settings.max_waiting_requests
        return DEFAULT_QUEUE_FACTOR * self.info.max_num_seqs if limit is None else limit

    def admit(self, num_requests: int) -> None:
        """Refuse (503 + Retry-After) when `num_requests` more would make more than max_waiting_requests
        wait in the engine, or when the engine is gone. Waiting means not scheduled: requests the engine
        reports waiting, plus those sent but not yet acknowledged beyond its free running slots."""
        if not self.client.is_alive:
            raise E.engine_dead()
        if self.client.num_waiting_after(num_requests) > self.max_waiting_requests:
            raise E.server_overloaded()

    def token_str(self, tid: int, as_id: bool = False) -> str:
        """A token's text for logprobs (cached: the same ids recur in every top-k list)."""
        if as_id:
            return f"token_id:{tid}"
        s = self._tok_str.get(tid)
        if s is None:
            s = self.tokenizer.decode([tid])
            self._tok_str[tid] = s
        return s


def build_params(req: Any, logprobs: Optional[int], rename: Optional[Mapping[str, str]] = None,
                 **overrides: Any) -> SamplingParams:
    """SamplingParams from the body's sampling fields (fields left out keep the defaults, so the
    engine can tell an explicit max_tokens from the default); its ValueError becomes a 400."""
    kw: dict[str, Any] = {}
    for name in ("n", "temperature", "top_p", "top_k", "min_p", "seed", "presence_penalty", "frequency_penalty",
                 "repetition_penalty", "min_tokens", "stop", "stop_token_ids", "ignore_eos",
                 "include_stop_str_in_output", "skip_special_tokens", "spaces_between_special_tokens",
                 "logit_bias", "structured_outputs"):
        value = getattr(req, name, None)
        if value is not None:
            kw[name] = value
    structured_param = getattr(req, "_structured_param", "structured_outputs")
    if structured_param != "structured_outputs":     # vLLM's guided_ field it came from (protocol.py)
        rename = {**(rename or {}), "structured_outputs": structured_param}
    kw.update(overrides)
    if logprobs is not None:
        kw["logprobs"] = logprobs
    try:
        return SamplingParams(**kw)
    except ValueError as exc:
        raise E.from_exception(exc, rename) from None


def clamp(lp: float) -> float:
    return lp if lp == lp and lp > LOGPROB_FLOOR else LOGPROB_FLOOR


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict[str, Any]:
    """OpenAI's usage object; `cached_tokens`: prompt tokens the prefix cache served."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


class Choice:
    """One choice of a response as it accumulates (the text kept as pieces: joined once)."""
    __slots__ = ("text", "num_tokens", "finish_reason", "stop_reason", "lp", "offset")

    def __init__(self) -> None:
        self.text: list[str] = []
        self.num_tokens = 0
        self.finish_reason: Optional[str] = None
        self.stop_reason: Any = None
        self.lp: Any = None       # accumulated logprobs (format depends on the route)
        self.offset = 0           # text offset for completions logprobs

    def absorb_first(self, delta: Any) -> tuple[str, bool]:
        """Fold one engine delta's first choice (index 0) into this one: (its new text, whether
        it finished). The single-answer routes (Messages, Responses) use it as their collector."""
        text, done = "", False
        for c in delta.outputs:
            if c.index != 0:
                continue
            if c.text:
                self.text.append(c.text)
                text += c.text
            self.num_tokens += len(c.token_ids)
            if c.finish_reason is not None:
                self.finish_reason, self.stop_reason, done = c.finish_reason, c.stop_reason, True
        return text, done


def chat_deltas(output: Any, text: str, done: bool) -> list[dict[str, Any]]:
    """The chat-shaped deltas of one piece of answer text: through the route's output parser
    (tool calls, reasoning; its `finish()` once done) or, without one, the text as content."""
    deltas = [output.feed(text) if output is not None else ({"content": text} if text else {})]
    if done and output is not None:
        deltas.append(output.finish())
    return deltas


# ================================================================================== request group
class _Sub:
    """One engine request of a group (one prompt). It is the sink the engine client feeds: items
    arrive on the group's queue tagged with it, so no id → prompt table is needed."""
    __slots__ = ("group", "request_id", "index", "first", "last", "itls", "reason", "finished", "trace")

    def __init__(self, group: "RequestGroup", request_id: str, index: int) -> None:
        self.group, self.request_id, self.index = group, request_id, index
        self.first: Optional[float] = None       # when the first delta arrived (TTFT)
        self.last = 0.0
        self.itls: list[float] = []
        self.reason: Optional[str] = None        # choice 0's finish reason, the metric's label
        self.finished = False
        self.trace: Any = None                   # a tracing.RequestTrace when tracing is on

    def put_nowait(self, item: Any) -> None:
        self.group.q.put_nowait((self, item))


class RequestGroup:
    """The engine requests behind one HTTP request (one per prompt), sharing one output queue.
    `rename` maps the engine's parameter names to the route's, for the errors it reports."""

    def __init__(self, state: ServerState, request_id: str, prompts: list[list[int]], params: SamplingParams,
                 priority: int, arrival: float, rename: Optional[Mapping[str, str]] = None) -> None:
        self.state = state
        self.rename = rename
        self.q: asyncio.Queue = asyncio.Queue()
        self.arrival = arrival
        self.subs = [_Sub(self, request_id if len(prompts) == 1 else f"{request_id}-{i}", i)
                     for i in range(len(prompts))]
        self.num_unfinished = len(self.subs)
        self.closed = False
        vocab = state.info.vocab_size
        logit_bias = getattr(params, "logit_bias", None)      # SamplingParams only (not embeddings')
        if logit_bias and vocab and max(logit_bias) >= vocab:   # OpenAI refuses them too
            raise E.bad_request(f"logit_bias has token id {max(params.logit_bias)}, outside the vocabulary "
                                f"(0..{vocab - 1}).", "logit_bias", "invalid_value")
        if state.tracer is not None:     # each sub gets its RequestTrace (.trace)
            state.tracer.begin_group(self.subs, prompts, params, state.model_name, arrival)
        # --generation-config FOLDER: for what the request left unset (sampling only: not embeddings' PoolingParams)
        if state.settings.generation_defaults and isinstance(params, SamplingParams):
            try:
                params = params.with_generation_defaults(state.settings.generation_defaults)
            except ValueError as exc:
                raise E.from_exception(exc, rename) from None
        try:
            state.client.add([(s.request_id, engine_prompt(ids), params, s)
                              for s, ids in zip(self.subs, prompts)], priority)
        except EngineDeadError:
            self.closed = True
            raise E.engine_dead() from None

    async def next(self) -> Optional[tuple[int, RequestDelta]]:
        """The next (prompt index, delta); None once every request finished. A refusal, the engine's
        death or a shutdown raises the APIError for it (and ends the group)."""
        if not self.num_unfinished:
            return None
        sub, item = await self.q.get()
        if isinstance(item, RequestDelta):
            now = time.monotonic()
            if sub.first is None:
                sub.first = now
            else:
                sub.itls.append(now - sub.last)
            sub.last = now
            if sub.trace is not None:
                sub.trace.absorb(item)
            for c in item.outputs:
                if c.index == 0 and c.finish_reason is not None:
                    sub.reason = c.finish_reason
            if item.finished:
                self._finished(sub, item, now)
            return sub.index, item
        # An exception ends the group: the engine's RequestError, EngineDeadError or ServerShuttingDown.
        sub.finished = True     # the client has already dropped it: nothing to abort
        if isinstance(item, EngineDeadError):
            for s in self.subs:
                s.finished = True
        self.close(count_aborts=isinstance(item, E.ServerShuttingDown))
        raise E.from_exception(item, self.rename)

    def _finished(self, sub: _Sub, delta: RequestDelta, now: float) -> None:
        sub.finished = True
        self.num_unfinished -= 1
        reason = sub.reason or next((c.finish_reason for c in delta.outputs if c.finish_reason), "stop")
        m = self.state.metrics
        ttft = (sub.first or now) - self.arrival
        if sub.trace is not None:
            sub.trace.end(delta.metrics, now, aborted=reason == "abort")
        if reason == "abort":     # the engine gave up on it by itself
            m.request_was_aborted(ttft, sub.itls)
        else:
            queue_time = delta.metrics.queue_time if delta.metrics is not None else None
            m.request_finished(reason, ttft, sub.itls, now - self.arrival, queue_time)

    def close(self, count_aborts: bool = True) -> None:
        """Abort every engine request that has not finished (idempotent)."""
        if self.closed:
            return
        self.closed = True
        open_subs = [s for s in self.subs if not s.finished]
        self.num_unfinished = 0
        for s in self.subs:
            s.finished = True
        if open_subs:
            self.state.client.abort([s.request_id for s in open_subs])
            if self.state.tracer is not None:
                self.state.tracer.aborted(open_subs)
            if count_aborts:
                for s in open_subs:
                    ttft = s.first - self.arrival if s.first is not None else None
                    self.state.metrics.request_was_aborted(ttft, s.itls)


# ================================================================================== answering
# A change to one choice, as `absorb` reports it: (index, new text, new logprobs, finish_reason, stop_reason).
Event = tuple[int, str, Any, Optional[str], Any]
# A route's `absorb(prompt_index, delta)`: fold one engine delta into its choices, return what changed.
Absorb = Callable[[int, RequestDelta], Iterable[Event]]


async def collect(request: Request, group: RequestGroup, absorb: Absorb) -> bool:
    """Non-streamed: feed every delta to `absorb` until the engine is done. Returns False when the client
    disconnected first. Either way the group is closed (unfinished engine requests aborted) on return."""
    async def drain() -> None:
        while (item := await group.next()) is not None:
            absorb(*item)
    try:
        await race_disconnect(request, drain())
    except ClientGone:
        return False
    finally:
        group.close()
    return True


async def open_stream(request: Request, group: RequestGroup,
                      events: Callable[[Optional[tuple[int, RequestDelta]]], AsyncIterator[str]],
                      on_error: Callable[[E.APIError], Iterable[str]]) -> Response:
    """An SSE response whose body is `events(first)`, `first` being the group's first output: it is awaited
    before the headers go out, so that errors the engine finds are still a plain HTTP error. An API error
    later becomes the events `on_error(err)`. The group is closed when the stream ends or the client leaves."""
    try:
        first = await race_disconnect(request, group.next())
    except ClientGone:
        group.close()
        return Response(status_code=499)
    except BaseException:
        group.close()
        raise

    async def body() -> AsyncIterator[str]:
        try:
            async for piece in events(first):
                yield piece
        except E.APIError as err:
            for piece in on_error(err):
                yield piece
        finally:
            group.close()

    return SSEResponse(body(), group.close)


async def stream(request: Request, group: RequestGroup, *, head: dict[str, Any], include_usage: bool,
                 opening: Callable[[], list[dict[str, Any]]], absorb: Absorb, shape: Callable[..., dict[str, Any]],
                 usage: Callable[[], dict[str, Any]]) -> Response:
    """Streamed: an SSE response of chunks `{**head, "choices": [choice]}` — first the `opening()` choices,
    then `shape(*event)` for every event `absorb` reports (None: no chunk), then (with include_usage) a usage
    chunk, then [DONE]. An API error mid-stream becomes an error event. The group is closed when the stream ends or
    the client disconnects."""
    def chunk(choice: dict[str, Any]) -> str:
        obj = {**head, "choices": [choice]}
        if include_usage:
            obj["usage"] = None
        return sse(obj)

    async def events(item: Optional[tuple[int, RequestDelta]]) -> AsyncIterator[str]:
        for choice in opening():     # called once the engine accepted the request
            yield chunk(choice)
        while item is not None:
            for event in absorb(*item):
                choice = shape(*event)
                if choice is not None:      # None: nothing a client would see (text held back)
                    yield chunk(choice)
            item = await group.next()
        if include_usage:
            yield sse({**head, "choices": [], "usage": usage()})
        yield SSE_DONE

    return await open_stream(request, group, events, lambda err: (err.sse(), SSE_DONE))
