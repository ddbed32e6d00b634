"""--otlp-traces-endpoint: a span per request (queue, prefill, decode, detokenize under a root span)
with the GenAI semantic conventions, a W3C traceparent honoured; collected with the SDK's
InMemorySpanExporter from a server running in this process, and once over real OTLP/HTTP."""
from __future__ import annotations

import gzip
import json
import http.server
import socket
import subprocess
import sys
import threading
import time

import httpx
import openai
import pytest

pytest.importorskip("opentelemetry.sdk", reason="the otel extra is not installed: pip install 'tokenmill[otel]'")

from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter  # noqa: E402

from tokenmill.entrypoints.openai.tracing import RequestTracer, otlp_exporter  # noqa: E402
from tokenmill.entrypoints.openai.testing import ServerProcess  # noqa: E402

MODEL = "traced"
FAKE = "tokenmill.entrypoints.openai.testing:FakeEngine"
TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_ID = "00f067aa0ba902b7"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def traced():
    """`tokenmill serve` (FakeEngine) run in this process by uvicorn, its tracer writing to memory."""
    import uvicorn

    from tokenmill.entrypoints.cli import build_parser
    from tokenmill.entrypoints.openai.app import create_app
    from tokenmill.entrypoints.openai.engine_client import EngineClient
    from tokenmill.entrypoints.openai.serve_cmd import check_vllm_args, serving_engine_kwargs, serving_settings

    parser = build_parser()
    args = parser.parse_args(["serve", "--served-model-name", MODEL, "--max-model-len", "512",
                              "--engine-factory", FAKE])
    check_vllm_args(parser, args)
    exporter = InMemorySpanExporter()
    tracer = RequestTracer(None, exporter=exporter, simple=True)
    client = EngineClient(serving_engine_kwargs(args), factory=args.engine_factory)
    app = create_app(client, serving_settings(args), tracer=tracer)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="on"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while True:
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline and thread.is_alive(), "in-process server did not start"
        time.sleep(0.2)
    try:
        yield url, exporter
    finally:
        server.should_exit = True
        thread.join(30)


def spans_of(exporter: InMemorySpanExporter, response_id: str, timeout: float = 10.0) -> dict:
    """{span name: span} of the trace whose root span is the response's."""
    deadline = time.monotonic() + timeout
    while True:
        spans = exporter.get_finished_spans()
        roots = [s for s in spans if s.attributes.get("gen_ai.response.id") == response_id]
        if roots:
            root = roots[0]
            family = {s.name: s for s in spans if s.parent is not None and s.parent.span_id == root.context.span_id}
            family["root"] = root
            return family
        assert time.monotonic() < deadline, f"no span for {response_id}: {[s.name for s in spans]}"
        time.sleep(0.05)


def test_completion_spans_follow_the_incoming_traceparent(traced):
    url, exporter = traced
    client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0,
                           default_headers={"traceparent": f"00-{TRACE_ID}-{PARENT_ID}-01"})
    r = client.completions.create(model=MODEL, prompt="Tracing is", max_tokens=5, temperature=0.5, top_p=0.9,
                                  extra_body={"ignore_eos": True})
    spans = spans_of(exporter, r.id)
    root = spans["root"]
    assert root.name == f"text_completion {MODEL}"
    assert f"{root.context.trace_id:032x}" == TRACE_ID
    assert f"{root.parent.span_id:016x}" == PARENT_ID
    assert set(spans) == {"root", "queue", "prefill", "decode", "detokenize"}
    a = root.attributes
    assert a["gen_ai.operation.name"] == "text_completion"
    assert a["gen_ai.request.model"] == MODEL
    assert a["gen_ai.request.max_tokens"] == 5
    assert a["gen_ai.request.temperature"] == pytest.approx(0.5)
    assert a["gen_ai.request.top_p"] == pytest.approx(0.9)
    assert a["gen_ai.usage.input_tokens"] == r.usage.prompt_tokens
    assert a["gen_ai.usage.output_tokens"] == r.usage.completion_tokens == 5
    assert tuple(a["gen_ai.response.finish_reasons"]) == ("length",)
    for name in ("gen_ai.latency.time_to_first_token", "gen_ai.latency.time_in_queue", "gen_ai.latency.e2e",
                 "gen_ai.latency.time_in_model_prefill", "gen_ai.latency.time_in_model_decode"):
        assert a[name] >= 0, name
    assert a["gen_ai.latency.time_to_first_token"] <= a["gen_ai.latency.e2e"]
    # the phases follow each other inside the root span
    order = [spans[n] for n in ("queue", "prefill", "decode", "detokenize")]
    assert root.start_time <= order[0].start_time
    for before, after in zip(order, order[1:]):
        assert before.end_time <= after.start_time + 1_000     # ns: rounding of the clock conversion
        assert all(s.context.trace_id == root.context.trace_id for s in (before, after))
    assert order[-1].end_time <= root.end_time
    assert order[2].end_time - order[2].start_time > 0     # 4 decode steps of 10 ms


def test_streamed_chat_without_traceparent_starts_a_trace(traced):
    url, exporter = traced
    client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
    stream = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                            max_tokens=3, stream=True)
    ids = {chunk.id for chunk in stream}
    assert len(ids) == 1
    root = spans_of(exporter, ids.pop())["root"]
    assert root.parent is None and root.name == f"chat {MODEL}"
    assert root.attributes["gen_ai.operation.name"] == "chat"
    assert root.attributes["gen_ai.usage.output_tokens"] == 3


def test_a_dropped_stream_gets_an_error_span(traced):
    url, exporter = traced
    with httpx.Client(base_url=url, timeout=30) as c:
        with c.stream("POST", "/v1/completions", json={"model": MODEL, "prompt": "bye", "max_tokens": 300,
                                                       "ignore_eos": True, "stream": True}) as r:
            response_id = None
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    response_id = json.loads(line[6:])["id"]
                    break
    root = spans_of(exporter, response_id)["root"]
    assert root.status.status_code.name == "ERROR"
    assert tuple(root.attributes["gen_ai.response.finish_reasons"]) == ("abort",)
    assert 0 < root.attributes["gen_ai.usage.output_tokens"] < 300


def test_missing_packages_are_a_clear_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "opentelemetry.sdk.trace", None)     # as if not installed
    with pytest.raises(RuntimeError, match=r"tokenmill\[otel\]"):
        RequestTracer("http://127.0.0.1:4317")


def test_protocol_follows_the_otel_environment(monkeypatch):
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_PROTOCOL", raising=False)
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", raising=False)
    assert "grpc" in type(otlp_exporter("http://127.0.0.1:4317")).__module__
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "http/protobuf")
    assert "http" in type(otlp_exporter("http://127.0.0.1:4318/v1/traces")).__module__
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "carrier-pigeon")
    with pytest.raises(ValueError, match="carrier-pigeon"):
        otlp_exporter("http://127.0.0.1:4318")


def test_serve_flag_exports_over_otlp_http():
    """The real thing: `tokenmill serve --otlp-traces-endpoint` posting protobuf to a collector."""
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
    received: list[bytes] = []

    class Collector(http.server.BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802
            body = self.rfile.read(int(self.headers["Content-Length"]))
            received.append(gzip.decompress(body) if self.headers.get("Content-Encoding") == "gzip" else body)
            self.send_response(200)
            self.send_header("Content-Type", "application/x-protobuf")
            self.end_headers()

        def log_message(self, *args):
            pass

    collector = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Collector)
    threading.Thread(target=collector.serve_forever, daemon=True).start()
    endpoint = f"http://127.0.0.1:{collector.server_address[1]}/v1/traces"
    env = {"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf"}
    try:
        with ServerProcess(["--served-model-name", MODEL, "--max-model-len", "512", "--disable-access-log",
                            "--otlp-traces-endpoint", endpoint], env=env, fake_engine=True) as server:
            r = httpx.post(server.url + "/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 2},
                           timeout=30)
            assert r.status_code == 200
            response_id = r.json()["id"]
            assert server.stop(subprocess.signal.SIGTERM) == 0      # shutdown flushes the batch
    finally:
        collector.shutdown()
    names = {}
    for body in received:
        req = ExportTraceServiceRequest.FromString(body)
        for rs in req.resource_spans:
            for ss in rs.scope_spans:
                for span in ss.spans:
                    attrs = {kv.key: kv.value for kv in span.attributes}
                    names[span.name] = attrs
    root = names[f"text_completion {MODEL}"]
    assert root["gen_ai.response.id"].string_value == response_id
    assert root["gen_ai.usage.output_tokens"].int_value == 2
    assert {"queue", "prefill", "decode", "detokenize"} <= set(names)
