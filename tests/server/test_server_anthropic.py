"""Anthropic's Messages API (issue 12, item 3) through `tokenmill serve`, driven by the official
`anthropic` SDK: messages.create plain, streamed (`messages.stream` and `stream=True`), with tools
(tool_choice any / tool: enforced by the tools' schemas; a tool_result round trip),
messages.count_tokens, stop_sequences, and errors as the SDK's own exception classes, in
Anthropic's shape. `x-api-key` and `Authorization: Bearer` both authenticate.

One server on the default model (the `server` fixture; TOKENMILL_TEST_FAKE_ENGINE=1: the fake engine).
Tool calls read by a --tool-call-parser and thinking blocks: test_server_api_scripted.py.
"""
from __future__ import annotations

import anthropic
import httpx
import jsonschema
import pytest

from conftest import FAKE_ENGINE

KEY = "anthropic-key"
MODEL = "smol"
SERVER_ARGS = ["--device", "cpu", "--served-model-name", MODEL, "--max-model-len", "1024", "--max-num-seqs", "8",
               "--num-threads", "1", "--kv-cache-memory", str(64 * 1024 * 1024), "--api-key", KEY,
               "--disable-access-log"]
MESSAGES = [{"role": "user", "content": "Name three colors."}]
GREEDY = {"temperature": 0}          # this SDK version has no temperature argument: the body's field
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                            "unit": {"enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"], "additionalProperties": False}
TOOLS = [{"name": "get_weather", "description": "The weather in a city.", "input_schema": WEATHER},
         {"name": "get_time", "description": "The time in a zone.",
          "input_schema": {"type": "object", "properties": {"zone": {"type": "string", "maxLength": 8}},
                           "required": ["zone"], "additionalProperties": False}}]


@pytest.fixture(scope="module")
def client(server):
    return anthropic.Anthropic(base_url=server.url, api_key=KEY, max_retries=0, timeout=120)


def _text(message) -> str:
    return "".join(b.text for b in message.content if b.type == "text")


def test_create_plain(client):
    m = client.messages.create(model=MODEL, max_tokens=6, messages=MESSAGES, system="Answer briefly.",
                               extra_body=GREEDY)
    assert m.type == "message" and m.role == "assistant" and m.model == MODEL and m.id.startswith("msg_")
    assert m.content and m.content[0].type == "text" and _text(m)
    assert m.stop_reason in ("max_tokens", "end_turn") and m.stop_sequence is None
    assert 0 < m.usage.output_tokens <= 6
    if m.stop_reason == "max_tokens":
        assert m.usage.output_tokens == 6
    # count_tokens renders the very same prompt
    count = client.messages.count_tokens(model=MODEL, messages=MESSAGES, system="Answer briefly.")
    assert count.input_tokens == m.usage.input_tokens
    # the system prompt as text blocks is the same prompt
    blocks = client.messages.count_tokens(model=MODEL, messages=MESSAGES,
                                          system=[{"type": "text", "text": "Answer "}, {"type": "text",
                                                                                        "text": "briefly."}])
    assert blocks.input_tokens == count.input_tokens
    assert client.messages.count_tokens(model=MODEL, messages=MESSAGES).input_tokens != count.input_tokens


def test_streamed_equals_create(client):
    kwargs = dict(model=MODEL, max_tokens=10, messages=MESSAGES, extra_body=GREEDY)
    # Both after a first request has cached the prompt: in bf16 a fresh prefill and the
    # prefix-cached path round differently (~0.1 nats on this prompt), and its first token is
    # a near-tie ('1' / 'The'): this test compares streaming with a whole response, not two paths.
    client.messages.create(**kwargs)
    full = client.messages.create(**kwargs)
    with client.messages.stream(**kwargs) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == _text(full) == _text(final)
    assert final.stop_reason == full.stop_reason and final.usage.output_tokens == full.usage.output_tokens
    assert final.usage.input_tokens == full.usage.input_tokens

    events = [e.type for e in client.messages.create(stream=True, **kwargs)]
    assert events[0] == "message_start" and events[1] == "content_block_start"
    assert events[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(events[2:-3]) == {"content_block_delta"}


def test_stream_wire_format_has_event_lines_and_ping(server):
    body = {"model": MODEL, "max_tokens": 3, "messages": MESSAGES, "stream": True}
    with httpx.stream("POST", server.url + "/v1/messages", json=body, headers={"x-api-key": KEY},
                      timeout=120) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        raw = r.read().decode()
    names = [line[len("event: "):] for line in raw.splitlines() if line.startswith("event: ")]
    assert names[:3] == ["message_start", "ping", "content_block_start"] and names[-1] == "message_stop"
    assert '"type":"text_delta"' in raw and '"stop_reason":' in raw


def test_stop_sequences(client):
    free = _text(client.messages.create(model=MODEL, max_tokens=24, messages=MESSAGES, extra_body=GREEDY))
    cut = next((free[i:i + 2] for i in range(2, len(free) - 2) if free[i:i + 2].strip()), None)
    if cut is None:
        pytest.skip("the greedy answer is too short to cut")
    m = client.messages.create(model=MODEL, max_tokens=24, messages=MESSAGES, stop_sequences=[cut],
                               extra_body=GREEDY)
    assert m.stop_reason == "stop_sequence" and m.stop_sequence == cut
    assert _text(m) == free[:free.index(cut)]


@pytest.mark.skipif(FAKE_ENGINE, reason="the fake engine does not enforce grammars")
def test_forced_tool_choice(client):
    m = client.messages.create(model=MODEL, max_tokens=100, messages=[
        {"role": "user", "content": "What is the weather in Paris?"}], tools=TOOLS,
        tool_choice={"type": "tool", "name": "get_weather"}, extra_body=GREEDY)
    assert m.stop_reason == "tool_use"
    uses = [b for b in m.content if b.type == "tool_use"]
    assert [u.name for u in uses] == ["get_weather"] and uses[0].id.startswith("toolu_")
    jsonschema.validate(uses[0].input, WEATHER)

    any_tool = client.messages.create(model=MODEL, max_tokens=100, messages=MESSAGES, tools=TOOLS,
                                      tool_choice={"type": "any", "disable_parallel_tool_use": True},
                                      extra_body=GREEDY)
    assert any_tool.stop_reason == "tool_use"
    assert len([b for b in any_tool.content if b.type == "tool_use"]) == 1

    with client.messages.stream(model=MODEL, max_tokens=100, messages=MESSAGES, tools=TOOLS,
                                tool_choice={"type": "tool", "name": "get_weather"}, extra_body=GREEDY) as stream:
        kinds = [e.type for e in stream]
        final = stream.get_final_message()
    assert "input_json" in kinds and final.stop_reason == "tool_use"
    jsonschema.validate(final.content[-1].input, WEATHER)

    # the call and its result go back as tool_use / tool_result blocks
    reply = client.messages.create(model=MODEL, max_tokens=12, tools=TOOLS, extra_body=GREEDY, messages=[
        {"role": "user", "content": "What is the weather in Paris?"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": uses[0].id, "name": "get_weather",
                                           "input": uses[0].input}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": uses[0].id,
                                      "content": [{"type": "text", "text": "21 degrees, sunny"}]}]}])
    assert reply.stop_reason in ("end_turn", "max_tokens") and _text(reply)


def test_errors_raise_the_sdks_classes(server, client):
    with pytest.raises(anthropic.NotFoundError) as e:
        client.messages.create(model="no-such-model", max_tokens=4, messages=MESSAGES)
    assert e.value.body == {"type": "error", "error": {"type": "not_found_error", "message": e.value.body[
        "error"]["message"]}}
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.create(model=MODEL, max_tokens=4, messages=[
            {"role": "user", "content": [{"type": "image", "source": {"type": "url", "url": "x"}}]}])
    assert e.value.body["type"] == "error" and e.value.body["error"]["type"] == "invalid_request_error"
    with pytest.raises(anthropic.BadRequestError):
        client.messages.create(model=MODEL, max_tokens=4, messages=MESSAGES, tools=TOOLS,
                               tool_choice={"type": "tool", "name": "nope"})
    with pytest.raises(anthropic.BadRequestError) as e:     # streamed: still a plain HTTP error
        with client.messages.stream(model=MODEL, max_tokens=5000, messages=MESSAGES) as s:
            list(s)
    assert "context length" in e.value.body["error"]["message"]
    with pytest.raises(anthropic.AuthenticationError) as e:
        anthropic.Anthropic(base_url=server.url, api_key="wrong", max_retries=0).messages.create(
            model=MODEL, max_tokens=4, messages=MESSAGES)
    assert e.value.body["error"]["type"] == "authentication_error"
    # max_tokens is required, as Anthropic requires it
    r = httpx.post(server.url + "/v1/messages", json={"model": MODEL, "messages": MESSAGES},
                   headers={"x-api-key": KEY})
    assert r.status_code == 400 and r.json() == {"type": "error", "error": {
        "type": "invalid_request_error", "message": "Missing required parameter: 'max_tokens'."}}
    # unknown routes under /v1/messages and missing keys are Anthropic-shaped too
    assert httpx.post(server.url + "/v1/messages/nope", json={}, headers={"x-api-key": KEY}).json()["type"] == "error"
    assert httpx.post(server.url + "/v1/messages", json={}).json()["error"]["type"] == "authentication_error"


def test_bearer_auth_works_too(server):
    bearer = anthropic.Anthropic(base_url=server.url, auth_token=KEY, max_retries=0)
    assert bearer.messages.count_tokens(model=MODEL, messages=MESSAGES).input_tokens > 0
    # and x-api-key works on the OpenAI routes
    r = httpx.get(server.url + "/v1/models", headers={"x-api-key": KEY})
    assert r.status_code == 200 and r.json()["data"][0]["id"] == MODEL
