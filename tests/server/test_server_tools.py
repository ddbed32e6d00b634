"""Tool calls and reasoning through `tokenmill serve`, driven by the official openai SDK. The fake
engine "generates" a chosen text (TOKENMILL_FAKE_SCRIPT, entrypoints/openai/testing.py), here a
Qwen3-style answer that thinks and then calls two tools; the server reads it with
`--reasoning-parser qwen3 --tool-call-parser hermes --enable-auto-tool-choice`."""
from __future__ import annotations

import json
import subprocess
import sys

import openai
import pytest

from tokenmill.entrypoints.openai.testing import ServerProcess

SCRIPT = ('<think>\nThe user wants the weather in Paris and Rome.\n</think>\n\n'
          '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n'
          '</tool_call>\n'
          '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>')
REASONING = "The user wants the weather in Paris and Rome.\n"
CALLS = [("get_weather", {"city": "Paris", "unit": "celsius"}), ("get_weather", {"city": "Rome"})]
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "required": ["city"],
                   "properties": {"city": {"type": "string"}, "unit": {"type": "string"}}}}}]
MESSAGES = [{"role": "user", "content": "Weather in Paris and Rome?"}]
ARGS = ["--device", "cpu", "--served-model-name", "m", "--max-model-len", "1024", "--disable-access-log",
        "--enable-auto-tool-choice",
        "--tool-call-parser", "hermes", "--reasoning-parser", "qwen3"]


@pytest.fixture(scope="module")
def client():
    with ServerProcess(ARGS, env={"TOKENMILL_FAKE_SCRIPT": SCRIPT, "TOKENMILL_FAKE_STEP_S": "0.001"},
                       fake_engine=True) as srv:
        yield openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0, timeout=120)


def test_tool_calls_and_reasoning_in_the_finished_message(client):
    r = client.chat.completions.create(model="m", messages=MESSAGES, tools=TOOLS, max_tokens=500)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    assert choice.message.model_extra["reasoning_content"] == REASONING
    calls = choice.message.tool_calls
    assert [(c.type, c.function.name, json.loads(c.function.arguments)) for c in calls] == [
        ("function", n, a) for n, a in CALLS]
    assert all(c.id.startswith("call_") for c in calls)

    one = client.chat.completions.create(model="m", messages=MESSAGES, tools=TOOLS, max_tokens=500,
                                         parallel_tool_calls=False)
    assert [json.loads(c.function.arguments) for c in one.choices[0].message.tool_calls] == [CALLS[0][1]]

    # tool_choice "none": no tool calls read, the text is content (the reasoning still split off)
    none = client.chat.completions.create(model="m", messages=MESSAGES, tools=TOOLS, tool_choice="none",
                                          max_tokens=500)
    assert none.choices[0].finish_reason == "stop" and none.choices[0].message.tool_calls is None
    assert none.choices[0].message.content.startswith("<tool_call>")


def test_tool_calls_and_reasoning_streamed(client):
    stream = client.chat.completions.create(model="m", messages=MESSAGES, tools=TOOLS, max_tokens=500, stream=True)
    reasoning, content, calls, finish, arg_chunks = "", "", [], None, 0
    for chunk in stream:
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        d = choice.delta
        reasoning += (d.model_extra or {}).get("reasoning_content") or ""
        content += d.content or ""
        for tc in d.tool_calls or []:
            if tc.index == len(calls):
                assert tc.id.startswith("call_") and tc.function.name
                calls.append([tc.function.name, tc.function.arguments or ""])
            else:
                assert tc.id is None and tc.function.name is None
                calls[tc.index][1] += tc.function.arguments
                arg_chunks += 1
        finish = choice.finish_reason or finish
    assert finish == "tool_calls" and reasoning == REASONING and content == ""
    assert [(n, json.loads(a)) for n, a in calls] == CALLS
    assert arg_chunks > 3            # the arguments arrived in pieces, as the model wrote them


def test_tool_results_go_back_through_the_chat_template(client):
    history = MESSAGES + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temp_c": 21}'},
    ]
    r = client.chat.completions.create(model="m", messages=history, tools=TOOLS, max_tokens=500)
    assert r.choices[0].finish_reason == "tool_calls"


def test_an_unknown_parser_name_is_a_startup_error():
    done = subprocess.run([sys.executable, "-m", "tokenmill.entrypoints.cli", "serve", "--device", "cpu",
                           "--tool-call-parser", "nope", "--engine-factory",
                           "tokenmill.entrypoints.openai.testing:FakeEngine"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    assert "--tool-call-parser 'nope' is not a registered tool parser" in done.stderr
    assert "hermes, llama3_json, mistral, phi4_mini_json, pythonic" in done.stderr
