"""Issue 13, defects 6-10: the server under hostile input and a dying engine.

6. lone surrogates and deeply nested JSON are 400s, and the keep-alive connection stays usable;
7. admission counts what is really queued in the engine (a burst that fits the running slots is
   not refused), and a default queue bound (4 x max_num_seqs) protects latency;
8. a killed engine process: in-flight requests fail cleanly, /health is 503 within 1 s, the server
   exits non-zero within 5 s (or, with --restart-engine, restarts the engine); /metrics never shows
   the dead engine's gauges;
9. booleans are not numbers, every 400 has a code, one param spelling, seed and logit_bias checks,
   no slash redirect, 405 with Allow, /openapi.json behind the key and complete;
10. unknown body fields are 400s naming them; vLLM's guided_* fields map onto structured_outputs.

All on the fake engine (it runs in the engine process, as the real one does).
"""
from __future__ import annotations

import asyncio
import http.client
import json
import os
import signal
import time
from types import SimpleNamespace
from typing import Optional

import anthropic
import httpx
import openai
import pytest

from tokenmill.entrypoints.openai.testing import ServerProcess

pytestmark = pytest.mark.reliability

KEY = "hardening-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
MODEL = "SmolLM2-135M-Instruct"
ARGS = ["--max-model-len", "1024", "--max-num-seqs", "256", "--max-waiting-requests", "64", "--api-key", KEY,
        "--disable-access-log", "--restart-engine"]
FAST = {"TOKENMILL_FAKE_STEP_S": "0.005"}


@pytest.fixture(scope="module")
def server():
    with ServerProcess(ARGS, env=FAST, fake_engine=True) as srv:
        yield srv


@pytest.fixture(scope="module")
def api(server):
    with httpx.Client(base_url=server.url, headers=AUTH, timeout=30) as c:
        yield c


def _error(r: httpx.Response, status: int = 400) -> dict:
    assert r.status_code == status, (r.status_code, r.text)
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["code"], err
    return err


def _quick_request_time(server) -> float:
    """Seconds another client's max_tokens=4 completion takes (through the official SDK)."""
    sdk = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=30)
    t0 = time.monotonic()
    out = sdk.completions.create(model=MODEL, prompt="Hello there", max_tokens=4)
    assert out.usage.completion_tokens == 4
    return time.monotonic() - t0


# ==================================================================== 6. hostile JSON
def _raw(server, body: bytes, conn: http.client.HTTPConnection, path: str = "/v1/completions"):
    conn.request("POST", path, body=body, headers={**AUTH, "Content-Type": "application/json"})
    r = conn.getresponse()
    return r.status, r.getheader("connection"), json.loads(r.read())


@pytest.mark.parametrize("body", [
    b'{"model": "' + MODEL.encode() + b'", "prompt": "a\\ud800b", "max_tokens": 2}',
    b'{"prompt": "x", "max_tokens": 1, "stop": ["\\udfff"]}',
    b'{"prompt": "x", "max_tokens": 1, "user": ' + b"[" * 5000 + b"]" * 5000 + b"}",
    b'{"prompt": "x", "max_tokens": 1, "user": ' + b'{"a":' * 5000 + b"1" + b"}" * 5000 + b"}",
], ids=["lone-high-surrogate", "lone-low-surrogate", "nested-lists", "nested-objects"])
def test_hostile_json_is_400_and_keeps_the_connection(server, body):
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    try:
        status, connection, payload = _raw(server, body, conn)
        assert status == 400, payload
        err = payload["error"]
        assert err["type"] == "invalid_request_error" and err["code"] == "invalid_json", err
        assert "surrogate" in err["message"] or "nest" in err["message"], err
        if connection != "close":     # kept alive: the same connection must still serve
            conn.request("GET", "/health")
            r = conn.getresponse()
            r.read()
            assert r.status == 200
    finally:
        conn.close()


def test_hostile_bodies_do_not_stall_another_client(server):
    """The worst bodies of defects 6, 9 and 10, sent back to back by one client (8 MiB-deep nesting
    up to the body limit, surrogates, booleans, unknown fields, an out-of-vocabulary logit_bias):
    another client's max_tokens=4 request still completes within 2 s, every time."""
    import threading
    depth = 4 * 1024 * 1024 - 64       # just under the 8 MiB body limit: "[" * depth + "]" * depth
    bodies = [
        b'{"prompt": "x", "max_tokens": 1, "user": ' + b"[" * depth + b"]" * depth + b"}",
        b'{"model": "' + MODEL.encode() + b'", "prompt": "a\\ud800b' + b"x" * 1_000_000 + b'", "max_tokens": 2}',
        b'{"prompt": [true, false], "max_tokens": true}',
        b'{"prompt": "x", "guided_whitespace_pattern": " ", "max_tokens": 1}',
        b'{"prompt": "x", "logit_bias": {"999999999": 5}, "max_tokens": 1}',
    ]
    stop = threading.Event()
    statuses: list[int] = []

    def attacker() -> None:
        with httpx.Client(base_url=server.url, headers={**AUTH, "Content-Type": "application/json"},
                          timeout=30) as c:
            while not stop.is_set():
                for body in bodies:
                    statuses.append(c.post("/v1/completions", content=body).status_code)

    thread = threading.Thread(target=attacker, daemon=True)
    thread.start()
    try:
        time.sleep(0.5)
        worst = max(_quick_request_time(server) for _ in range(5))
    finally:
        stop.set()
        thread.join(30)
    assert statuses and all(400 <= code < 500 for code in statuses), sorted(set(statuses))
    assert worst < 2.0, f"another client's max_tokens=4 request took {worst:.2f} s"


def test_surrogate_in_chat_and_messages_is_400(api):
    body = (b'{"model": "SmolLM2-135M-Instruct", "messages": [{"role": "user", "content": "hi \\ud83d"}], '
            b'"max_tokens": 2}')
    r = api.post("/v1/chat/completions", content=body, headers={"Content-Type": "application/json"})
    assert _error(r)["code"] == "invalid_json"
    r = api.post("/v1/messages", content=body, headers={"Content-Type": "application/json"})
    assert r.status_code == 400 and r.json()["type"] == "error", r.text
    # a proper pair (an emoji) is fine
    ok = api.post("/v1/chat/completions", content=body.replace(b"\\ud83d", b"\\ud83d\\ude00"),
                   headers={"Content-Type": "application/json"})
    assert ok.status_code == 200, ok.text


# ==================================================================== 7. admission
def test_burst_that_fits_the_running_slots_is_not_refused(server):
    """300 requests at once, 256 running slots, --max-waiting-requests 64: at most 44 ever wait, so
    none may be refused (the old estimate counted every unacknowledged add as waiting). Meanwhile
    another client's max_tokens=4 request completes within 2 s."""
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 8, "ignore_eos": True}

    async def burst() -> list[int]:
        limits = httpx.Limits(max_connections=400, max_keepalive_connections=400)
        async with httpx.AsyncClient(base_url=server.url, headers=AUTH, timeout=120, limits=limits) as c:
            rs = await asyncio.gather(*(c.post("/v1/completions", json=body) for _ in range(300)))
        return [r.status_code for r in rs]

    async def main() -> tuple[list[int], float]:
        task = asyncio.create_task(burst())
        await asyncio.sleep(0.3)
        quick = await asyncio.to_thread(_quick_request_time, server)
        return await task, quick

    statuses, quick = asyncio.run(main())
    assert statuses.count(200) == 300, {s: statuses.count(s) for s in set(statuses)}
    assert quick < 2.0, quick


class _StubTokenizer:
    chat_template = None

    def __len__(self) -> int:
        return 100

    def convert_ids_to_tokens(self, ids):
        return ["tok"] * len(ids)


def _stub_state(max_num_seqs: int, limit, **stats):
    from tokenmill.core.engine_process import EngineInfo
    from tokenmill.entrypoints.openai.engine_client import EngineClient
    from tokenmill.entrypoints.openai.serving import ServerSettings, ServerState
    client = EngineClient({})
    client.info = EngineInfo("m", 1024, max_num_seqs, 16, "fake", "none", 100, 100, None)
    client.tokenizer = _StubTokenizer()
    client.stats = {"num_running": 0, "num_waiting": 0, **stats}
    client._dead_reason = None
    client._proc = SimpleNamespace(is_alive=lambda: True)
    return ServerState(client, ServerSettings([], max_waiting_requests=limit)), client


def test_admission_counts_the_engine_queue_and_has_a_default_bound():
    from tokenmill.entrypoints.openai import errors as E
    state, client = _stub_state(8, None)
    assert state.max_waiting_requests == 32           # the default: 4 x max_num_seqs
    client._num_sent_adds = 40                         # 40 not yet acknowledged: 8 will run, 32 wait
    state.admit(0)
    with pytest.raises(E.APIError) as e:
        state.admit(1)
    assert e.value.status == 503 and e.value.code == "server_overloaded" and e.value.headers["Retry-After"]
    client._num_added_seen = 40                        # acknowledged: 8 running, 2 waiting
    client.stats = {"num_running": 8, "num_waiting": 2}
    state.admit(30)
    with pytest.raises(E.APIError):
        state.admit(31)
    state, client = _stub_state(8, 0)                   # an explicit 0: nothing may wait
    client.stats = {"num_running": 7, "num_waiting": 0}
    state.admit(1)
    with pytest.raises(E.APIError):
        state.admit(2)


# ==================================================================== 8. the engine process dies
def _wait_running(server, n: int, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.metrics().get("num_requests_running", 0) >= n:
            return
        time.sleep(0.05)
    raise AssertionError("requests never ran:\n" + server.log())


def _in_flight(server, streams: int, plain: int, headers: Optional[dict] = None) -> tuple[list, list, list]:
    """Start long requests (streamed and not) in threads; their outcomes land in the lists."""
    import threading
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 900, "ignore_eos": True}
    streamed: list = []
    answered: list = []

    def stream() -> None:
        with httpx.stream("POST", server.url + "/v1/completions", json={**body, "stream": True}, timeout=60,
                          headers=headers) as r:
            streamed.append((r.status_code, r.read().decode()))

    def plain_request() -> None:
        r = httpx.post(server.url + "/v1/completions", json=body, timeout=60, headers=headers)
        answered.append((r.status_code, r.json()))

    threads = [threading.Thread(target=stream, daemon=True) for _ in range(streams)]
    threads += [threading.Thread(target=plain_request, daemon=True) for _ in range(plain)]
    for t in threads:
        t.start()
    _wait_running(server, streams + plain)
    return streamed, answered, threads


def _engine_pids(server) -> set[int]:
    """The server's engine process(es): spawned children (not multiprocessing's resource tracker)."""
    pids = set()
    for pid in server.child_pids():
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if b"spawn_main" in f.read():
                    pids.add(pid)
        except OSError:
            pass
    return pids


def _kill_engine(server) -> float:
    engines = _engine_pids(server)
    assert engines, "the engine runs in a child process"
    for pid in engines:
        os.kill(pid, signal.SIGKILL)
    return time.monotonic()


def _health_503_within(server, killed_at: float, limit: float, exiting: bool = False) -> None:
    """/health is 503 within `limit` s of the kill; a server `exiting` may instead have stopped listening."""
    while True:
        try:
            status = httpx.get(server.url + "/health", timeout=2).status_code
        except httpx.ConnectError as exc:
            status = repr(exc)
            if exiting:
                break
        except httpx.HTTPError as exc:
            status = repr(exc)
        if status == 503:
            break
        assert time.monotonic() - killed_at < limit, f"/health still {status}"
        time.sleep(0.02)
    assert time.monotonic() - killed_at < limit


def _assert_no_stale_gauges(server) -> None:
    try:
        m = server.metrics()
    except httpx.HTTPError:
        return      # already gone: it reports nothing at all
    assert m["num_requests_running"] == 0 and m["num_requests_waiting"] == 0 and m["kv_cache_usage_perc"] == 0, m


def _assert_failed_cleanly(streamed: list, answered: list, threads: list) -> None:
    for t in threads:
        t.join(10)
    assert len(streamed) == 2 and len(answered) == 2, (streamed, answered)
    for status, text in streamed:
        assert status == 200
        events = [line[6:] for line in text.splitlines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]" and json.loads(events[-2])["error"]["code"] == "engine_dead", events[-3:]
    for status, body in answered:
        assert status == 503 and body["error"]["code"] == "engine_dead" and body["error"]["type"] == "server_error"


def test_killed_engine_fails_requests_then_the_server_exits_nonzero():
    with ServerProcess(["--max-model-len", "1024", "--disable-access-log"], env={"TOKENMILL_FAKE_STEP_S": "0.02"},
                       fake_engine=True) as server:
        streamed, answered, threads = _in_flight(server, 2, 2)
        killed_at = _kill_engine(server)
        _health_503_within(server, killed_at, 1.0, exiting=True)
        _assert_no_stale_gauges(server)
        code = server.proc.wait(timeout=10)
        exited_after = time.monotonic() - killed_at
        _assert_failed_cleanly(streamed, answered, threads)
        assert code != 0 and exited_after < 5.0, (code, exited_after, server.log())


# ==================================================================== 9. smaller ones
@pytest.mark.parametrize("route,body,param", [
    ("/v1/completions", {"prompt": [True, False], "max_tokens": 2}, "prompt[0]"),
    ("/v1/completions", {"prompt": [[1000, True]], "max_tokens": 2}, "prompt[0][1]"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": True}, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "temperature": False}, "temperature"),
    ("/v1/completions", {"prompt": "hi", "stop_token_ids": [True]}, "stop_token_ids[0]"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "n": True}, "n"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "top_p": True}, "top_p"),
    ("/detokenize", {"tokens": [True]}, "tokens[0]"),
])
def test_booleans_are_not_numbers(api, route, body, param):
    err = _error(api.post(route, json={"model": MODEL, **body}))
    assert err["code"] == "invalid_type" and err["param"] == param, err


def test_numbers_still_accepted_as_numbers(api):
    r = api.post("/v1/completions", json={"model": MODEL, "prompt": [1000, 1001], "max_tokens": 2,
                                           "temperature": 1, "top_p": 1, "presence_penalty": 0})
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("route,body", [
    ("/v1/completions", {"max_tokens": 2}),
    ("/v1/completions", {"prompt": "hi", "max_tokens": -1}),
    ("/v1/completions", {"prompt": "hi", "n": 1000}),
    ("/v1/completions", {"prompt": "hi", "stop": 5}),
    ("/v1/completions", {"prompt": [], "max_tokens": 2}),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 5000}),
    ("/v1/chat/completions", {"messages": []}),
    ("/v1/chat/completions", {"messages": [{"content": "hi"}]}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "response_format": {"type": "x"}}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "tool_choice": "required"}),
    ("/v1/responses", {"input": 5}),
    ("/tokenize", {}),
    ("/v1/batches", {"endpoint": "/v1/completions"}),
])
def test_every_400_has_a_code(api, route, body):
    _error(api.post(route, json={"model": MODEL, **body}))
    r = api.post(route, content=b"not json", headers={"Content-Type": "application/json"})
    assert _error(r)["code"] == "invalid_json"


def test_param_paths_are_spelled_as_openai_does(api):
    err = _error(api.post("/v1/chat/completions", json={"model": MODEL, "messages": [{"content": "hi"}]}))
    assert err["param"] == "messages[0].role" and err["code"] == "missing_required_parameter", err
    err = _error(api.post("/v1/chat/completions", json={
        "model": MODEL, "messages": [{"role": "user", "content": "hi"}, {"role": 5, "content": "x"}]}))
    assert err["param"] == "messages[1].role", err
    err = _error(api.post("/v1/completions", json={"model": MODEL, "prompt": [[1000], ["a"]]}))
    assert err["param"] == "prompt[1][0]", err


def test_seed_overflow_names_seed(api):
    for seed in (2 ** 64, -(2 ** 63) - 1):
        err = _error(api.post("/v1/completions", json={"model": MODEL, "prompt": "hi", "seed": seed}))
        assert err["param"] == "seed", err


def test_logit_bias_outside_the_vocabulary_is_refused(api):
    for key in ("49152", "10000000", "-1", "abc"):
        err = _error(api.post("/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 1,
                                                          "logit_bias": {key: 1}}))
        assert err["param"] == "logit_bias", err
    r = api.post("/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 1, "logit_bias": {"5": 1}})
    assert r.status_code == 200, r.text


def test_no_slash_redirect_built_from_the_host_header(server):
    r = httpx.get(server.url + "/health/", headers={"Host": "evil.example"}, follow_redirects=False)
    assert "location" not in r.headers and r.status_code in (200, 404), (r.status_code, r.headers)
    r = httpx.get(server.url + "/v1/models/", headers={**AUTH, "Host": "evil.example"}, follow_redirects=False)
    assert "location" not in r.headers and r.status_code < 300 or r.status_code == 404, r.headers


def test_405_carries_allow(api):
    r = api.get("/v1/completions")
    assert r.status_code == 405 and r.headers["allow"] == "POST", r.headers
    assert r.json()["error"]["code"] == "method_not_allowed"
    r = api.put("/v1/responses/resp_x")
    assert r.status_code == 405 and set(r.headers["allow"].replace(" ", "").split(",")) == {"GET", "DELETE"}


def test_openapi_is_keyed_and_lists_the_request_models(server, api):
    assert httpx.get(server.url + "/openapi.json").status_code == 401
    doc = api.get("/openapi.json").json()
    paths = doc["paths"]
    for route in ("/v1/completions", "/v1/chat/completions", "/v1/messages", "/v1/messages/count_tokens",
                  "/v1/responses", "/v1/embeddings", "/tokenize", "/detokenize"):
        schema = paths[route]["post"]["requestBody"]["content"]["application/json"]["schema"]
        ref = schema["$ref"].rsplit("/", 1)[1]
        assert ref in doc["components"]["schemas"], ref
    batch = paths["/v1/batches"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert set(batch["required"]) == {"input_file_id", "endpoint", "completion_window"}
    assert "multipart/form-data" in paths["/v1/files"]["post"]["requestBody"]["content"]
    for route in ("/health", "/health/ready", "/v1/models", "/v1/files/{file_id}", "/v1/batches/{batch_id}",
                  "/v1/responses/{response_id}", "/metrics"):
        assert route in paths, route
    chat = doc["components"]["schemas"]["ChatCompletionRequest"]
    assert chat["properties"]["max_tokens"] and "messages" in chat["required"]
    # every $ref resolves inside the document (a fuzzer follows them)
    refs = set()

    def walk(node):
        if isinstance(node, dict):
            if isinstance(node.get("$ref"), str):
                refs.add(node["$ref"])
            for v in node.values():
                walk(v)
        elif isinstance(node, list):
            for v in node:
                walk(v)
    walk(doc)
    for ref in refs:
        assert ref.startswith("#/components/schemas/") and ref.rsplit("/", 1)[1] in doc["components"]["schemas"], ref


# ==================================================================== 10. unknown fields
@pytest.mark.parametrize("route,body", [
    ("/v1/completions", {"prompt": "hi", "max_tokens": 1}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}),
    ("/v1/responses", {"input": "hi", "max_output_tokens": 1}),
])
def test_unknown_field_is_400_naming_it(api, route, body):
    err = _error(api.post(route, json={"model": MODEL, **body, "frobnicate": 1}))
    assert err["param"] == "frobnicate" and err["code"] == "unknown_parameter", err
    assert err["message"] == "Unrecognized request argument supplied: frobnicate", err
    r = api.post(route, json={"model": MODEL, **body, "user": "u1", "metadata": {"k": "v"}, "store": False,
                               "service_tier": "auto"})
    assert r.status_code == 200, r.text


def test_unknown_field_on_embeddings_and_tokenize():
    """(The embeddings route needs a pooling model: its request model is checked directly.)"""
    from tokenmill.entrypoints.openai import errors as E
    from tokenmill.entrypoints.openai.protocol import EmbeddingRequest, TokenizeRequest, parse
    for cls, body in ((EmbeddingRequest, {"input": "hi"}), (TokenizeRequest, {"prompt": "hi"})):
        with pytest.raises(E.APIError) as e:
            parse(cls, {**body, "guided_choice": ["a"]})
        assert e.value.param == "guided_choice" and e.value.code == "unknown_parameter"
    assert parse(EmbeddingRequest, {"input": "hi", "user": "u", "metadata": {"a": 1}}).input == "hi"


def test_unknown_field_on_messages_has_anthropics_shape(server):
    client = anthropic.Anthropic(base_url=server.url, api_key=KEY, max_retries=0)
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.create(model=MODEL, max_tokens=2, messages=[{"role": "user", "content": "hi"}],
                               extra_body={"guided_choice": ["a"]})
    assert e.value.body["type"] == "error" and "guided_choice" in e.value.body["error"]["message"]
    out = client.messages.create(model=MODEL, max_tokens=2, messages=[{"role": "user", "content": "hi"}],
                                 metadata={"user_id": "u"})
    assert out.usage.output_tokens == 2


def test_sdk_defaults_pass(server):
    sdk = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)
    out = sdk.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2,
                                      stream_options=None, user="me", store=False, metadata={"a": "b"},
                                      service_tier="auto", extra_body={"top_k": 5, "min_p": 0.1})
    assert out.usage.completion_tokens == 2
    assert sdk.responses.create(model=MODEL, input="hi", max_output_tokens=2, store=False).status


def test_guided_fields_map_onto_structured_outputs(api):
    from tokenmill.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest, parse
    from tokenmill.entrypoints.openai.serving import build_params
    msgs = [{"role": "user", "content": "hi"}]
    for body, field, want in [({"guided_choice": ["yes", "no"]}, "choice", ["yes", "no"]),
                              ({"guided_regex": "[a-z]+"}, "regex", "[a-z]+"),
                              ({"guided_json": {"type": "object"}}, "json", {"type": "object"}),
                              ({"guided_grammar": 'root ::= "a"'}, "grammar", 'root ::= "a"')]:
        for cls, base in ((ChatCompletionRequest, {"messages": msgs}), (CompletionRequest, {"prompt": "x"})):
            params = build_params(parse(cls, {**base, **body}), None)
            assert getattr(params.structured_outputs, field) == want, (cls, body)
    err = _error(api.post("/v1/chat/completions", json={"model": MODEL, "messages": msgs, "guided_choice": 5}))
    assert err["param"] == "guided_choice", err
    err = _error(api.post("/v1/chat/completions", json={"model": MODEL, "messages": msgs, "guided_choice": ["a"],
                                                         "structured_outputs": {"regex": "a"}}))
    assert err["param"] == "guided_choice", err


def test_restart_engine_brings_the_server_back(server, api):
    """The module's server runs with --restart-engine (this test runs late: the engine is killed)."""
    old = _engine_pids(server)
    streamed, answered, threads = _in_flight(server, 2, 2, AUTH)
    killed_at = _kill_engine(server)
    _health_503_within(server, killed_at, 1.0)
    ready = httpx.get(server.url + "/health/ready", timeout=2)
    assert ready.status_code == 503 and ready.json()["error"]["code"] == "engine_dead", ready.text
    _assert_no_stale_gauges(server)
    _assert_failed_cleanly(streamed, answered, threads)
    while not (_engine_pids(server) - old):      # a new engine process, started within 5 s
        assert time.monotonic() - killed_at < 5.0, server.log()
        time.sleep(0.05)
    deadline = time.monotonic() + 120
    while httpx.get(server.url + "/health/ready", timeout=10).status_code != 200:
        assert time.monotonic() < deadline and server.proc.poll() is None, server.log()
        time.sleep(0.1)
    out = api.post("/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 3})
    assert out.status_code == 200 and out.json()["usage"]["completion_tokens"] == 3, out.text
    _assert_no_stale_gauges(server)
    assert server.proc.poll() is None


def test_server_survived_everything(server, api):
    assert server.proc.poll() is None
    assert api.get("/health").status_code == 200
    assert _quick_request_time(server) < 2.0
