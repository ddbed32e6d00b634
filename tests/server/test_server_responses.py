"""OpenAI's Responses API (issue 12, item 2) through `tokenmill serve`, driven by the official openai
SDK: responses.create plain, streamed (the SDK's stream helper and `stream=True`), with a function
tool, with `previous_response_id`; `text.format` json_schema through structured outputs;
retrieve / delete; `store: false`; errors as the SDK's exception classes.

One server on the default model (the `server` fixture; TOKENMILL_TEST_FAKE_ENGINE=1: the fake engine).
Function calls read by a --tool-call-parser and reasoning items: test_server_api_scripted.py.
"""
from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest

from conftest import FAKE_ENGINE

KEY = "responses-key"
MODEL = "smol"
SERVER_ARGS = ["--device", "cpu", "--served-model-name", MODEL, "--max-model-len", "1024", "--max-num-seqs", "8",
               "--num-threads", "1", "--kv-cache-memory", str(64 * 1024 * 1024), "--api-key", KEY,
               "--max-stored-responses", "3", "--disable-access-log"]
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                            "unit": {"enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"], "additionalProperties": False}
TOOLS = [{"type": "function", "name": "get_weather", "description": "The weather in a city.", "parameters": WEATHER}]
STREAM_EVENTS = ["response.created", "response.in_progress", "response.output_item.added",
                 "response.content_part.added", "response.output_text.delta"]


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=120)


def _tokens(server, messages) -> int:
    r = httpx.post(server.url + "/tokenize", json={"messages": messages}, headers={"Authorization": f"Bearer {KEY}"})
    return r.json()["count"]


def test_create_plain(server, client):
    r = client.responses.create(model=MODEL, input="Name three colors.", instructions="Answer briefly.",
                                max_output_tokens=8, temperature=0)
    assert r.object == "response" and r.id.startswith("resp_") and r.model == MODEL
    assert r.status in ("completed", "incomplete") and r.output_text
    assert r.output[0].type == "message" and r.output[0].role == "assistant"
    assert 0 < r.usage.output_tokens <= 8 and r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    if r.status == "incomplete":
        assert r.incomplete_details.reason == "max_output_tokens" and r.usage.output_tokens == 8
    assert r.usage.input_tokens == _tokens(server, [{"role": "system", "content": "Answer briefly."},
                                                    {"role": "user", "content": "Name three colors."}])
    # message items as input are the same prompt
    same = client.responses.create(model=MODEL, max_output_tokens=8, temperature=0, input=[
        {"role": "developer", "content": "Answer briefly."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Name three colors."}]}])
    assert same.output_text == r.output_text and same.usage.input_tokens == r.usage.input_tokens


def test_streamed_equals_create(client):
    kwargs = dict(model=MODEL, input="Name three colors.", max_output_tokens=10, temperature=0)
    # Both after a first request has cached the prompt: in bf16 a fresh prefill and the
    # prefix-cached path round differently (~0.1 nats on this prompt), and its first token is
    # a near-tie ('1' / 'The'): this test compares streaming with a whole response, not two paths.
    client.responses.create(**kwargs)
    full = client.responses.create(**kwargs)
    with client.responses.stream(**kwargs) as stream:
        events = list(stream)
    types = [e.type for e in events]
    assert types[:5] == STREAM_EVENTS
    assert types[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.completed" if full.status == "completed" else "response.incomplete"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == full.output_text
    last = events[-1].response
    assert last.output_text == full.output_text and last.usage.output_tokens == full.usage.output_tokens

    raw = list(client.responses.create(stream=True, **kwargs))
    assert [e.type for e in raw] == types


@pytest.mark.skipif(FAKE_ENGINE, reason="the fake engine does not enforce grammars")
def test_function_tool_and_its_output_in_the_next_turn(client):
    r = client.responses.create(model=MODEL, input="What is the weather in Paris?", tools=TOOLS,
                                tool_choice={"type": "function", "name": "get_weather"}, max_output_tokens=100,
                                temperature=0)
    calls = [o for o in r.output if o.type == "function_call"]
    assert r.status == "completed" and [c.name for c in calls] == ["get_weather"]
    assert calls[0].call_id.startswith("call_") and calls[0].id.startswith("fc_")
    jsonschema.validate(json.loads(calls[0].arguments), WEATHER)

    with client.responses.stream(model=MODEL, input="Weather in Rome?", tools=TOOLS, tool_choice="required",
                                 max_output_tokens=100, temperature=0) as stream:
        types = [e.type for e in stream]
        final = stream.get_final_response()
    assert "response.function_call_arguments.delta" in types and "response.function_call_arguments.done" in types
    streamed = [o for o in final.output if o.type == "function_call"]
    assert streamed and all(jsonschema.validate(json.loads(c.arguments), WEATHER) is None for c in streamed)

    # the call's output, in the conversation kept by previous_response_id
    nxt = client.responses.create(model=MODEL, previous_response_id=r.id, tools=TOOLS, max_output_tokens=12,
                                  temperature=0, input=[{"type": "function_call_output", "call_id": calls[0].call_id,
                                                         "output": json.dumps({"temperature": 21})}])
    assert nxt.previous_response_id == r.id and nxt.output_text
    assert nxt.usage.input_tokens > r.usage.input_tokens


@pytest.mark.skipif(FAKE_ENGINE, reason="the fake engine does not enforce grammars")
def test_text_format_json_schema(client):
    schema = {"type": "object", "properties": {"colors": {"type": "array", "items": {"type": "string",
                                                                                     "maxLength": 10},
                                                          "minItems": 1, "maxItems": 3}},
              "required": ["colors"], "additionalProperties": False}
    r = client.responses.create(model=MODEL, input="Name three colors as JSON.", max_output_tokens=80,
                                temperature=0, text={"format": {"type": "json_schema", "name": "colors",
                                                                "schema": schema, "strict": True}})
    assert r.status == "completed"
    jsonschema.validate(json.loads(r.output_text), schema)
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model=MODEL, input="x", text={"format": {"type": "json_schema", "name": "x",
                                                                         "schema": {"type": "no-such-type"}}})
    assert e.value.body["param"] == "text.format"


def test_previous_response_id_retrieve_delete_and_store_false(client):
    first = client.responses.create(model=MODEL, input="My name is Ada.", max_output_tokens=4, temperature=0)
    second = client.responses.create(model=MODEL, input="What is my name?", previous_response_id=first.id,
                                     max_output_tokens=4, temperature=0)
    alone = client.responses.create(model=MODEL, input="What is my name?", max_output_tokens=4, temperature=0)
    assert second.usage.input_tokens > alone.usage.input_tokens      # the first turn is in the prompt
    got = client.responses.retrieve(first.id)
    assert got.id == first.id and got.output_text == first.output_text
    client.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(first.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.delete(first.id)
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model=MODEL, input="again", previous_response_id=first.id, max_output_tokens=2)
    assert e.value.body["param"] == "previous_response_id"

    unstored = client.responses.create(model=MODEL, input="Hi", store=False, max_output_tokens=2)
    assert unstored.store is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)
    # the store is bounded (--max-stored-responses 3): the least recently used goes first
    ids = [client.responses.create(model=MODEL, input=f"n{i}", max_output_tokens=1).id for i in range(4)]
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(ids[0])
    assert client.responses.retrieve(ids[-1]).id == ids[-1]


def test_errors_raise_the_sdks_classes(server, client):
    with pytest.raises(openai.NotFoundError) as e:
        client.responses.create(model="no-such-model", input="x")
    assert e.value.body["code"] == "model_not_found"
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model=MODEL, input="x", max_output_tokens=5000)
    assert e.value.body["param"] == "max_output_tokens" and e.value.body["code"] == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model=MODEL, input="x", tools=[{"type": "web_search"}])
    assert e.value.body["param"] == "tools[0]"
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model=MODEL, input=[{"type": "input_image", "image_url": "x"}])
    assert e.value.body["param"] == "input[0].type"
    with pytest.raises(openai.BadRequestError) as e:     # streamed: still a plain HTTP error
        list(client.responses.create(model=MODEL, input="x", max_output_tokens=5000, stream=True))
    assert e.value.body["code"] == "context_length_exceeded"
    r = httpx.post(server.url + "/v1/responses", json={"model": MODEL}, headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "input"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0).responses.create(
            model=MODEL, input="x")
