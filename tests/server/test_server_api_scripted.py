"""Tool calls read by a --tool-call-parser and reasoning split by a --reasoning-parser, on the
Anthropic Messages and OpenAI Responses routes (issue 12, items 2 and 3), driven by the official
`anthropic` and `openai` SDKs. The fake engine "generates" a Qwen3-style answer that thinks, says
a few words, then calls two tools (TOKENMILL_FAKE_SCRIPT, entrypoints/openai/testing.py); the
server reads it with `--reasoning-parser qwen3 --tool-call-parser hermes --enable-auto-tool-choice`:
thinking / text / tool_use blocks, and reasoning / message / function_call items, finished and
streamed."""
from __future__ import annotations

import json

import anthropic
import openai
import pytest

from tokenmill.entrypoints.openai.testing import ServerProcess

SCRIPT = ('<think>\nThe user wants the weather in Paris and Rome.\n</think>\n\nLet me check. '
          '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n'
          '</tool_call>\n'
          '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>')
REASONING = "The user wants the weather in Paris and Rome.\n"
CALLS = [("get_weather", {"city": "Paris", "unit": "celsius"}), ("get_weather", {"city": "Rome"})]
SCHEMA = {"type": "object", "required": ["city"], "properties": {"city": {"type": "string"},
                                                                  "unit": {"type": "string"}}}
ARGS = ["--device", "cpu", "--served-model-name", "m", "--max-model-len", "1024", "--disable-access-log",
        "--enable-auto-tool-choice", "--tool-call-parser", "hermes", "--reasoning-parser", "qwen3"]
ANTHROPIC_TOOLS = [{"name": "get_weather", "description": "The weather in a city.", "input_schema": SCHEMA}]
RESPONSES_TOOLS = [{"type": "function", "name": "get_weather", "description": "The weather in a city.",
                    "parameters": SCHEMA}]
QUESTION = "Weather in Paris and Rome?"


@pytest.fixture(scope="module")
def server():
    with ServerProcess(ARGS, env={"TOKENMILL_FAKE_SCRIPT": SCRIPT, "TOKENMILL_FAKE_STEP_S": "0.001"},
                       fake_engine=True) as srv:
        yield srv


# ---------------------------------------------------------------- Anthropic Messages
def _check_blocks(message) -> None:
    assert message.stop_reason == "tool_use"
    assert [b.type for b in message.content] == ["thinking", "text", "tool_use", "tool_use"]
    assert message.content[0].thinking == REASONING and message.content[1].text.strip() == "Let me check."
    uses = message.content[2:]
    assert [(u.name, u.input) for u in uses] == CALLS
    assert all(u.id.startswith("toolu_") for u in uses) and uses[0].id != uses[1].id


def test_messages_tool_use_and_thinking(server):
    client = anthropic.Anthropic(base_url=server.url, api_key="x", max_retries=0)
    kwargs = dict(model="m", max_tokens=500, messages=[{"role": "user", "content": QUESTION}], tools=ANTHROPIC_TOOLS)
    _check_blocks(client.messages.create(**kwargs))
    with client.messages.stream(**kwargs) as stream:
        events = list(stream)
        final = stream.get_final_message()
    _check_blocks(final)
    deltas = {e.delta.type for e in events if e.type == "content_block_delta"}
    assert deltas == {"thinking_delta", "text_delta", "input_json_delta"}
    starts = [e.content_block.type for e in events if e.type == "content_block_start"]
    assert starts == ["thinking", "text", "tool_use", "tool_use"]
    assert len([e for e in events if e.type == "content_block_stop"]) == 4

    # tool_choice none: the tool call stays text
    none = client.messages.create(**kwargs, tool_choice={"type": "none"})
    assert none.stop_reason == "end_turn" and "<tool_call>" in none.content[-1].text
    # one call only
    one = client.messages.create(**kwargs, tool_choice={"type": "auto", "disable_parallel_tool_use": True})
    assert [b.input for b in one.content if b.type == "tool_use"] == [CALLS[0][1]]


def test_messages_tool_result_round_trip(server):
    client = anthropic.Anthropic(base_url=server.url, api_key="x", max_retries=0)
    history = [{"role": "user", "content": QUESTION},
               {"role": "assistant", "content": [
                   {"type": "thinking", "thinking": "hm", "signature": ""},
                   {"type": "text", "text": "Let me check."},
                   {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}}]},
               {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "21C"},
                                            {"type": "text", "text": "And Rome?"}]}]
    count = client.messages.count_tokens(model="m", messages=history, tools=ANTHROPIC_TOOLS)
    reply = client.messages.create(model="m", max_tokens=500, messages=history, tools=ANTHROPIC_TOOLS)
    assert reply.usage.input_tokens == count.input_tokens and reply.stop_reason == "tool_use"


# ---------------------------------------------------------------- OpenAI Responses
def _check_items(response) -> None:
    assert response.status == "completed"
    assert [o.type for o in response.output] == ["reasoning", "message", "function_call", "function_call"]
    assert response.output[0].content[0].text == REASONING
    assert response.output[1].content[0].text.strip() == "Let me check."
    calls = response.output[2:]
    assert [(c.name, json.loads(c.arguments)) for c in calls] == CALLS
    assert all(c.call_id.startswith("call_") for c in calls) and calls[0].call_id != calls[1].call_id


def test_responses_function_calls_and_reasoning(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
    kwargs = dict(model="m", input=QUESTION, tools=RESPONSES_TOOLS)
    first = client.responses.create(**kwargs)
    _check_items(first)
    with client.responses.stream(**kwargs) as stream:
        events = list(stream)
        final = stream.get_final_response()
    _check_items(final)
    types = [e.type for e in events]
    for kind in ("response.reasoning_text.delta", "response.reasoning_text.done", "response.output_text.delta",
                 "response.function_call_arguments.delta", "response.function_call_arguments.done"):
        assert kind in types, kind
    assert types.count("response.output_item.added") == types.count("response.output_item.done") == 4
    assert [e.sequence_number for e in events] == list(range(len(events)))

    # the calls' outputs continue the stored conversation
    outputs = [{"type": "function_call_output", "call_id": c.call_id, "output": "21C"} for c in first.output[2:]]
    nxt = client.responses.create(model="m", previous_response_id=first.id, input=outputs, tools=RESPONSES_TOOLS)
    assert nxt.usage.input_tokens > first.usage.input_tokens
    # the same conversation spelled out in `input` (reasoning items dropped, as previous turns' are)
    spelled = client.responses.create(model="m", tools=RESPONSES_TOOLS, input=[
        {"role": "user", "content": QUESTION}, *[o.model_dump(exclude_none=True) for o in first.output], *outputs])
    assert spelled.usage.input_tokens == nxt.usage.input_tokens
