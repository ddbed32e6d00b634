"""Forced tool choice (issue 11): `tool_choice` "required" and a named function on
/v1/chat/completions, enforced by a JSON schema built from the tools and read back as tool calls
without a `--tool-call-parser`. Through `tokenmill serve` on the default model with the official
openai SDK (finished and streamed, a round trip through a "tool" message, the 400s), plus the
output reader on its own."""
from __future__ import annotations

import json
import os

import jsonschema
import openai
import pytest

from tokenmill.entrypoints.openai.tool_choice import ForcedToolParser, forced_schema

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                            "unit": {"enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"], "additionalProperties": False}
TIME = {"type": "object", "properties": {"zone": {"type": "string", "maxLength": 12}},
        "required": ["zone"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "description": "The time in a time zone.",
                                           "parameters": TIME}}]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]


# ==================================================================== the output reader
def test_schema_and_reader_unit():
    s = forced_schema(TOOLS, "required", False)
    assert s["maxItems"] == 1 and s["minItems"] == 1
    assert [i["properties"]["name"]["const"] for i in s["items"]["anyOf"]] == ["get_weather", "get_time"]
    assert "maxItems" not in forced_schema(TOOLS, "required", None)
    assert forced_schema(TOOLS, {"type": "function", "function": {"name": "get_time"}}, None) is TIME

    text = '[{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}, ' \
           '{"name": "get_time", "parameters": {"zone": "CET"}}]'
    p = ForcedToolParser(None)
    got = p.extract_tool_calls(text)
    assert got.content is None and [(c.name, json.loads(c.arguments)) for c in got.tool_calls] == [
        ("get_weather", {"city": "Paris", "unit": "celsius"}), ("get_time", {"zone": "CET"})]
    assert p.extract_tool_calls(text[:-5]).tool_calls == []      # cut off: plain content
    # streamed character by character: each call's name once complete, then its arguments as they grow,
    # adding up to exactly the finished calls' arguments
    p, seen, prev = ForcedToolParser(None), [], ""
    for i in range(len(text)):
        cur = text[:i + 1]
        d = p.extract_tool_calls_streaming(prev, cur, cur[len(prev):])
        prev = cur
        seen += d.tool_calls if d else []
    assert [(t.index, t.name) for t in seen if t.name] == [(0, "get_weather"), (1, "get_time")]
    assert sum(1 for t in seen if t.index == 0) > 5          # the arguments came in many fragments
    for i, call in enumerate(got.tool_calls):
        assert "".join(t.arguments for t in seen if t.index == i) == call.arguments
    # named: the arguments stream as they come
    p, args, prev = ForcedToolParser(None, "get_time"), "", ""
    for piece in ['{"zo', 'ne": ', '"CET"}']:
        d = p.extract_tool_calls_streaming(prev, prev + piece, piece)
        prev += piece
        assert d.tool_calls[0].name == ("get_time" if not args else None)
        args += d.tool_calls[0].arguments
    assert json.loads(args) == {"zone": "CET"}
    assert p.extract_tool_calls(prev).tool_calls[0].arguments == prev


# ==================================================================== the server
MODEL = "smol"
SERVER_ARGS = ["--device", "cpu", "--served-model-name", MODEL, "--max-model-len", "1024",
               "--max-num-seqs", "4", "--num-threads", "1", "--kv-cache-memory", str(64 * 1024 * 1024),
               "--disable-access-log"]


@pytest.fixture(scope="module")
def client(server):
    if os.environ.get("TOKENMILL_TEST_FAKE_ENGINE") == "1":
        pytest.skip("the fake engine does not constrain its output")
    return openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=120)


def _check_calls(calls, names=None):
    assert calls
    for c in calls:
        assert c.id.startswith("call_") and c.type == "function"
        assert c.function.name in (names or SCHEMAS)
        jsonschema.validate(json.loads(c.function.arguments), SCHEMAS[c.function.name])


def _streamed(client, **kw):
    """The streamed tool calls assembled from their deltas (and the finish reason, any content)."""
    calls: dict[int, dict] = {}
    finish, content = None, ""
    for chunk in client.chat.completions.create(model=MODEL, messages=MESSAGES, stream=True, **kw):
        for ch in chunk.choices:
            content += ch.delta.content or ""
            for tc in ch.delta.tool_calls or []:
                entry = calls.setdefault(tc.index, {"id": None, "name": "", "arguments": ""})
                if tc.id:
                    entry["id"] = tc.id
                if tc.function and tc.function.name:
                    entry["name"] += tc.function.name
                if tc.function and tc.function.arguments:
                    entry["arguments"] += tc.function.arguments
            finish = ch.finish_reason or finish
    return [calls[i] for i in sorted(calls)], finish, content


def test_required(client):
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice="required",
                                       max_tokens=100, temperature=0)
    ch = r.choices[0]
    assert ch.finish_reason == "tool_calls" and ch.message.content is None
    _check_calls(ch.message.tool_calls)
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice="required",
                                       parallel_tool_calls=False, max_tokens=100, temperature=0)
    assert len(r.choices[0].message.tool_calls) == 1
    _check_calls(r.choices[0].message.tool_calls)


def test_required_streamed(client):
    calls, finish, content = _streamed(client, tools=TOOLS, tool_choice="required", max_tokens=100, temperature=0)
    assert finish == "tool_calls" and content == "" and calls
    for c in calls:
        assert c["id"].startswith("call_")
        jsonschema.validate(json.loads(c["arguments"]), SCHEMAS[c["name"]])


def test_named(client):
    choice = {"type": "function", "function": {"name": "get_time"}}
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice=choice,
                                       max_tokens=100, temperature=0)
    ch = r.choices[0]
    assert ch.finish_reason == "tool_calls" and ch.message.content is None
    assert [c.function.name for c in ch.message.tool_calls] == ["get_time"]
    _check_calls(ch.message.tool_calls)
    calls, finish, content = _streamed(client, tools=TOOLS, tool_choice=choice, max_tokens=100, temperature=0)
    assert finish == "tool_calls" and content == ""
    assert [c["name"] for c in calls] == ["get_time"] and calls[0]["id"].startswith("call_")
    jsonschema.validate(json.loads(calls[0]["arguments"]), TIME)


def test_round_trip(client):
    choice = {"type": "function", "function": {"name": "get_weather"}}
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice=choice,
                                       max_tokens=100, temperature=0)
    call = r.choices[0].message.tool_calls[0]
    messages = MESSAGES + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": call.id, "type": "function",
             "function": {"name": call.function.name, "arguments": call.function.arguments}}]},
        {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature": 21, "sky": "clear"})}]
    final = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, max_tokens=24,
                                           temperature=0)
    ch = final.choices[0]
    assert ch.message.tool_calls is None and isinstance(ch.message.content, str) and ch.message.content
    assert ch.finish_reason in ("stop", "length")


def _400(client, **kw):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=8, **kw)
    assert e.value.status_code == 400
    return e.value.body


def test_errors(client):
    body = _400(client, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}})
    assert body["param"] == "tool_choice" and "nope" in body["message"]
    assert _400(client, tool_choice="required")["param"] == "tools"
    assert _400(client, tool_choice={"type": "function", "function": {"name": "get_time"}})["param"] == "tools"
    bad = [{"type": "function", "function": {"name": "f", "parameters": {"type": "no-such-type"}}}]
    assert _400(client, tools=bad, tool_choice="required")["param"] == "tools"
    assert _400(client, tools=TOOLS, tool_choice="required",
                response_format={"type": "json_object"})["param"] == "tool_choice"
    assert _400(client, tools=TOOLS, tool_choice="sometimes")["param"] == "tool_choice"
    # explicit "auto" needs --enable-auto-tool-choice (as in vLLM) ...
    body = _400(client, tools=TOOLS, tool_choice="auto")
    assert body["param"] == "tool_choice" and "--enable-auto-tool-choice" in body["message"]
    # ... while tools with no tool_choice is plain chat
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=TOOLS, max_tokens=8, temperature=0)
    assert r.choices[0].message.tool_calls is None and r.choices[0].message.content is not None
