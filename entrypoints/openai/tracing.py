"""OpenTelemetry spans per request, when `serve --otlp-traces-endpoint URL` is set (vLLM's flag).

Each engine request becomes one root span (`{operation} {model}`, kind SERVER, the GenAI semantic
conventions' name) with four children — queue, prefill, decode, detokenize — drawn afterwards from
the request's timestamps (core/outputs.RequestMetrics, stamped by the engine) rather than by
instrumenting the engine loop, which stays free of tracing. The engine process and the server
share CLOCK_MONOTONIC, so its timestamps and the server's line up; they are converted to the
wall-clock nanoseconds OTLP wants once, when the span is written.

  root        the server received the HTTP request  → the server received the last output
  queue       the engine received the request       → first scheduled
  prefill     first scheduled                       → first token
  decode      first token                           → last token
  detokenize  last token                            → the server received the last output (the
              engine's final detokenization and the hand-over to the server)

A W3C `traceparent` (and `tracestate`) on the incoming HTTP request makes the root span its child:
`TraceContextMiddleware` reads the headers into a context variable that `RequestTracer.begin`
picks up where the route builds its engine requests (serving.RequestGroup).

The exporter is OTLP over gRPC or http/protobuf, chosen as vLLM and the OTel SDK choose it:
OTEL_EXPORTER_OTLP_TRACES_PROTOCOL (or OTEL_EXPORTER_OTLP_PROTOCOL), default grpc.
The packages are an optional extra: `pip install 'tokenmill[otel]'`.
"""
from __future__ import annotations

import contextvars
import os
import time
from typing import Any, Optional

MISSING_PACKAGES = ("--otlp-traces-endpoint needs the OpenTelemetry SDK and OTLP exporter: "
                    "pip install 'tokenmill[otel]' (opentelemetry-sdk, opentelemetry-exporter-otlp)")

# The incoming request's trace context (None: no traceparent header), set per HTTP request.
_incoming: contextvars.ContextVar[Any] = contextvars.ContextVar("tokenmill_trace_parent", default=None)

# The GenAI operation behind each route, told by its response id's prefix (serving_*.py name them).
_OPERATIONS = (("chatcmpl-", "chat"), ("cmpl-", "text_completion"), ("msg_", "chat"), ("resp", "chat"),
               ("embd-", "embeddings"))


def otlp_exporter(endpoint: str) -> Any:
    """The OTLP span exporter for `endpoint`, in the protocol the OTel environment variables name."""
    protocol = (os.environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
                or os.environ.get("OTEL_EXPORTER_OTLP_PROTOCOL") or "grpc").strip().lower()
    try:
        if protocol == "grpc":
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
        elif protocol == "http/protobuf":
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import (  # type: ignore[assignment]
                OTLPSpanExporter)
        else:
            raise ValueError(f"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL={protocol!r}: expected grpc or http/protobuf")
    except ImportError:
        raise RuntimeError(MISSING_PACKAGES) from None
    return OTLPSpanExporter(endpoint=endpoint)


class RequestTracer:
    """Writes the spans of finished requests through `exporter` (default: OTLP to `endpoint`).
    `simple=True` exports each span as it ends (tests); otherwise spans are batched off the loop."""

    def __init__(self, endpoint: Optional[str], exporter: Any = None, simple: bool = False) -> None:
        try:
            from opentelemetry.propagate import extract
            from opentelemetry.sdk.resources import Resource
            from opentelemetry.sdk.trace import TracerProvider
            from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor
            from opentelemetry.trace import SpanKind, Status, StatusCode, set_span_in_context
        except ImportError:
            raise RuntimeError(MISSING_PACKAGES) from None
        if exporter is None:
            if not endpoint:
                raise ValueError("an OTLP endpoint (or an exporter) is needed")
            exporter = otlp_exporter(endpoint)
        self.provider = TracerProvider(resource=Resource.create({"service.name": "tokenmill"}))
        self.provider.add_span_processor(SimpleSpanProcessor(exporter) if simple else BatchSpanProcessor(exporter))
        self.tracer = self.provider.get_tracer("tokenmill")
        self._extract, self._in_context = extract, set_span_in_context
        self._server_kind, self._error = SpanKind.SERVER, Status(StatusCode.ERROR, "aborted")

    def extract(self, headers: dict[str, str]) -> Any:
        """The trace context of W3C traceparent/tracestate headers (None without a valid traceparent)."""
        if "traceparent" not in headers:
            return None
        return self._extract({k: headers[k] for k in ("traceparent", "tracestate") if k in headers})

    def begin(self, request_id: str, num_prompt_tokens: int, params: Any, model: str,
              arrival: float) -> "RequestTrace":
        """Called where the route builds an engine request: remembers what the span will say."""
        return RequestTrace(self, _incoming.get(), request_id, num_prompt_tokens, params, model, arrival)

    def begin_group(self, subs: Any, prompts: Any, params: Any, model: str, arrival: float) -> None:
        """`begin` for each engine request of an HTTP request (serving.RequestGroup's subs): sets `.trace`."""
        for sub, ids in zip(subs, prompts):
            sub.trace = self.begin(sub.request_id, len(ids), params, model, arrival)

    def aborted(self, subs: Any) -> None:
        """The requests a client or the server gave up on: their root spans, marked as errors."""
        now = time.monotonic()
        for sub in subs:
            if sub.trace is not None:
                sub.trace.end(None, now, aborted=True)

    def shutdown(self) -> None:
        self.provider.shutdown()      # flushes the batch processor


def _ns(monotonic_s: float, offset_ns: int) -> int:
    return int(monotonic_s * 1e9) + offset_ns


class RequestTrace:
    """One engine request's span data, completed as its outputs arrive."""
    __slots__ = ("tracer", "parent", "request_id", "num_prompt_tokens", "params", "model", "arrival",
                 "num_output_tokens", "finish_reasons", "ended")

    def __init__(self, tracer: RequestTracer, parent: Any, request_id: str, num_prompt_tokens: int, params: Any,
                 model: str, arrival: float) -> None:
        self.tracer, self.parent, self.request_id = tracer, parent, request_id
        self.num_prompt_tokens, self.params, self.model, self.arrival = num_prompt_tokens, params, model, arrival
        self.num_output_tokens = 0
        self.finish_reasons: list[str] = []
        self.ended = False

    def absorb(self, delta: Any) -> None:
        for c in delta.outputs:
            self.num_output_tokens += len(c.token_ids)
            if c.finish_reason is not None:
                self.finish_reasons.append(c.finish_reason)

    def end(self, metrics: Any, now: float, aborted: bool = False) -> None:
        """Write the root span and its children (`metrics`: the engine's RequestMetrics, None when the
        request was aborted before it finished: then the root span alone, with an error status)."""
        if self.ended:
            return
        self.ended = True
        t = self.tracer
        offset = time.time_ns() - time.monotonic_ns()
        operation = next((op for prefix, op in _OPERATIONS if self.request_id.startswith(prefix)), "text_completion")
        attrs: dict[str, Any] = {
            "gen_ai.operation.name": operation, "gen_ai.system": "tokenmill", "gen_ai.request.model": self.model,
            "gen_ai.response.model": self.model, "gen_ai.request.id": self.request_id,
            "gen_ai.response.id": self.request_id,
            "gen_ai.usage.input_tokens": self.num_prompt_tokens, "gen_ai.usage.output_tokens": self.num_output_tokens,
            "gen_ai.response.finish_reasons": self.finish_reasons or (["abort"] if aborted else []),
            "gen_ai.latency.e2e": max(0.0, now - self.arrival),
        }
        # sampling parameters where there are some (an embedding request's PoolingParams has none)
        for attr, name, kind in (("temperature", "gen_ai.request.temperature", float),
                                 ("top_p", "gen_ai.request.top_p", float), ("n", "gen_ai.request.n", int),
                                 ("max_tokens", "gen_ai.request.max_tokens", int),
                                 ("seed", "gen_ai.request.seed", int)):
            value = getattr(self.params, attr, None)
            if value is not None:
                attrs[name] = kind(value)
        phases: list[tuple[str, float, float]] = []
        if metrics is not None:
            engine_arrival = max(metrics.arrival_time, self.arrival)
            scheduled, first, last = metrics.first_scheduled_time, metrics.first_token_time, metrics.last_token_time
            if scheduled is not None:
                attrs["gen_ai.latency.time_in_queue"] = max(0.0, scheduled - metrics.arrival_time)
                phases.append(("queue", engine_arrival, scheduled))
            if first is not None:
                attrs["gen_ai.latency.time_to_first_token"] = max(0.0, first - self.arrival)
                if scheduled is not None:
                    attrs["gen_ai.latency.time_in_model_prefill"] = max(0.0, first - scheduled)
                    phases.append(("prefill", scheduled, first))
                if last is not None:
                    attrs["gen_ai.latency.time_in_model_decode"] = max(0.0, last - first)
                    phases.append(("decode", first, last))
                    phases.append(("detokenize", last, now))
        root = t.tracer.start_span(f"{operation} {self.model}", context=self.parent, kind=t._server_kind,
                                   attributes=attrs, start_time=_ns(self.arrival, offset))
        if aborted:
            root.set_status(t._error)
        inside = t._in_context(root)
        for name, start, stop in phases:     # clamped into the root span, never negative
            start = min(max(start, self.arrival), now)
            stop = min(max(stop, start), now)
            child = t.tracer.start_span(name, context=inside, start_time=_ns(start, offset))
            child.end(end_time=_ns(stop, offset))
        root.end(end_time=_ns(now, offset))


class TraceContextMiddleware:
    """Pure ASGI: the incoming request's traceparent, for the spans its route writes."""

    def __init__(self, app: Any, tracer: RequestTracer) -> None:
        self.app, self.tracer = app, tracer

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = {}
        for k, v in scope.get("headers") or ():
            if k in (b"traceparent", b"tracestate"):
                headers[k.decode("latin-1")] = v.decode("latin-1")
        token = _incoming.set(self.tracer.extract(headers) if headers else None)
        try:
            await self.app(scope, receive, send)
        finally:
            _incoming.reset(token)
