"""The built-in tool-call and reasoning parsers (entrypoints/openai/parsers/) on recorded-style model
outputs, finished and streamed in small pieces, and the chat route's formatting of what they find
(entrypoints/openai/chat_output.py, serving_chat.py) as the client sees it."""
from __future__ import annotations

import json
import random

import pytest
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from tokenmill.entrypoints.openai.chat_output import ChatChoiceOutput, parser_class
from tokenmill.entrypoints.openai.parsers.reasoning_parsers import (DeepSeekR1ReasoningParser,
                                                                     Qwen3ReasoningParser)
from tokenmill.entrypoints.openai.parsers.tool_parsers import (HermesToolParser, Llama3JsonToolParser,
                                                                MistralToolParser, PythonicToolParser)
from tokenmill.entrypoints.openai.serving import Choice
from tokenmill.entrypoints.openai.serving_chat import chat_prompt, finished_choice, streamed_choice
from tokenmill.plugins import discovery
from tokenmill.plugins.parsers import ExtractedToolCalls, ToolCall, ToolParser

# (parser, model output, expected content, expected [(name, arguments as an object)])
TOOL_CASES = [
    (HermesToolParser,
     'I will check the weather.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": '
     '"celsius"}}\n</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {"tz": "Europe/Paris"}}\n'
     '</tool_call>',
     "I will check the weather.\n",
     [("get_weather", {"city": "Paris", "unit": "celsius"}), ("get_time", {"tz": "Europe/Paris"})]),
    (HermesToolParser,
     '<tool_call>\n{"name": "search", "arguments": {"query": "caf\\u00e9 \\"best\\" {x}", "filters": {"open": '
     'true, "price": [1, 2.5]}, "limit": 5}}\n</tool_call>',
     None, [("search", {"query": 'café "best" {x}', "filters": {"open": True, "price": [1, 2.5]}, "limit": 5})]),
    (HermesToolParser, "The capital of France is Paris.", "The capital of France is Paris.", []),
    (HermesToolParser, 'Use <tool_call>\n{"name": "f", "arguments": {oops}}\n</tool_call>',
     'Use <tool_call>\n{"name": "f", "arguments": {oops}}\n</tool_call>', []),    # not JSON: all content
    (HermesToolParser, '<tool_call>\n{"name": "now"}\n</tool_call>\nDone.', "\nDone.", [("now", {})]),
    (Llama3JsonToolParser,
     '<|python_tag|>{"name": "get_weather", "parameters": {"location": "San Francisco, CA", "days": 3}}',
     None, [("get_weather", {"location": "San Francisco, CA", "days": 3})]),
    (Llama3JsonToolParser, '{"name": "a", "parameters": {"x": 1}}; {"name": "b", "parameters": {}}',
     None, [("a", {"x": 1}), ("b", {})]),
    (Llama3JsonToolParser, '{"parameters": {"q": "llamas"}, "name": "search"}', None, [("search", {"q": "llamas"})]),
    (Llama3JsonToolParser, '{"name": "f", "arguments": "{\\"x\\": [1, 2]}"}', None, [("f", {"x": [1, 2]})]),
    (Llama3JsonToolParser, "Hello! How can I help you today?", "Hello! How can I help you today?", []),
    (MistralToolParser,
     '[TOOL_CALLS][{"name": "get_current_weather", "arguments": {"location": "Paris, France", "format": '
     '"celsius"}}, {"name": "get_time", "arguments": {}}]',
     None, [("get_current_weather", {"location": "Paris, France", "format": "celsius"}), ("get_time", {})]),
    (MistralToolParser, '[{"name": "f", "arguments": {"a": [1, {"b": "}]"}]}}]', None,
     [("f", {"a": [1, {"b": "}]"}]})]),
    (MistralToolParser, 'Sure.[TOOL_CALLS][{"name": "f", "arguments": {"x": 1}}]', "Sure.", [("f", {"x": 1})]),
    (MistralToolParser, "[1] is a citation, not a call.", "[1] is a citation, not a call.", []),
    (PythonicToolParser, '[get_weather(city="San Francisco", metric="celsius"), get_time()]',
     None, [("get_weather", {"city": "San Francisco", "metric": "celsius"}), ("get_time", {})]),
    (PythonicToolParser,
     "[search(query='it\\'s (a) test', limit=3, tags=[\"a\", \"b\"], opts={'x': (1, 2)}, exact=True, extra=None)]",
     None, [("search", {"query": "it's (a) test", "limit": 3, "tags": ["a", "b"], "opts": {"x": [1, 2]},
                        "exact": True, "extra": None})]),
    (PythonicToolParser, "[1] is a citation.", "[1] is a citation.", []),
    (PythonicToolParser, "[f(1)]", "[f(1)]", []),      # a positional argument: not a call
    (PythonicToolParser, "Sure, calling it.", "Sure, calling it.", []),
]


def pieces(text: str, how) -> list[str]:
    """`text` in small pieces: fixed sizes, or random sizes 1..6 (as a tokenizer might cut it)."""
    if isinstance(how, int):
        return [text[i:i + how] for i in range(0, len(text), how)]
    rng, out, i = random.Random(how), [], 0
    while i < len(text):
        k = rng.randint(1, 6)
        out.append(text[i:i + k])
        i += k
    return out


SPLITS = [1, 2, 5, 17, "seed0", "seed1", "seed2"]


def stream_tool_parser(parser: ToolParser, chunks: list[str]) -> tuple[str, list[list]]:
    content, calls, text = "", [], ""
    for c in chunks:
        prev, text = text, text + c
        d = parser.extract_tool_calls_streaming(prev, text, c)
        if d is None:
            continue
        content += d.content or ""
        for tc in d.tool_calls:
            if tc.index == len(calls):
                assert tc.name is not None, "a call's first fragment names it"
                calls.append([tc.name, tc.arguments])
            else:
                assert tc.name is None and tc.index < len(calls)
                calls[tc.index][1] += tc.arguments
    return content, calls


@pytest.mark.parametrize("cls,text,content,expected", TOOL_CASES,
                         ids=[f"{c[0].__name__}-{i}" for i, c in enumerate(TOOL_CASES)])
def test_tool_parser_finished(cls, text, content, expected):
    got = cls(None).extract_tool_calls(text)
    assert got.content == content
    assert [(c.name, json.loads(c.arguments)) for c in got.tool_calls] == expected


@pytest.mark.parametrize("split", SPLITS)
@pytest.mark.parametrize("cls,text,content,expected", TOOL_CASES,
                         ids=[f"{c[0].__name__}-{i}" for i, c in enumerate(TOOL_CASES)])
def test_tool_parser_streamed_adds_up_to_the_finished(cls, text, content, expected, split):
    finished = cls(None).extract_tool_calls(text)
    streamed_content, calls = stream_tool_parser(cls(None), pieces(text, split))
    if finished.tool_calls:     # everything streamed as it came: the deltas are the finished extraction
        assert streamed_content == (finished.content or "")
        assert calls == [[c.name, c.arguments] for c in finished.tool_calls]
        assert [json.loads(a) for _, a in calls] == [e[1] for e in expected]
    else:     # text that turns out not to be calls: what was streamed is never taken back, but it was a prefix
        assert (finished.content or "").startswith(streamed_content)
        assert not calls or "oops" in text        # only the invalid JSON got as far as streaming a call


def test_streamed_arguments_arrive_in_fragments():
    text = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>'
    parser, text_so_far, fragments = HermesToolParser(None), "", []
    for c in pieces(text, 1):
        prev, text_so_far = text_so_far, text_so_far + c
        d = parser.extract_tool_calls_streaming(prev, text_so_far, c)
        if d is not None:
            fragments += d.tool_calls
    assert fragments[0].name == "get_weather" and fragments[0].index == 0
    assert len(fragments) > 10 and all(f.name is None for f in fragments[1:])
    assert "".join(f.arguments for f in fragments) == '{"city": "Paris", "unit": "celsius"}'


REASONING_CASES = [
    (Qwen3ReasoningParser, "<think>\nThe user asks 2+2. That is 4.\n</think>\n\nThe answer is **4**.",
     "The user asks 2+2. That is 4.\n", "The answer is **4**."),
    (Qwen3ReasoningParser, "Just an answer, no thinking.", None, "Just an answer, no thinking."),
    (Qwen3ReasoningParser, "<think>\nstill thinking when the tokens ran out", "still thinking when the tokens ran out",
     None),
    (Qwen3ReasoningParser, "<think>\n\n</think>\n\nHi!", None, "Hi!"),
    (DeepSeekR1ReasoningParser, "Okay, so 2+2. Simple.\n</think>\n\n**4**", "Okay, so 2+2. Simple.\n", "**4**"),
    (DeepSeekR1ReasoningParser, "<think>hm, <b>bold</b>?</think>ok", "hm, <b>bold</b>?", "ok"),
    (DeepSeekR1ReasoningParser, "all of it is reasoning", "all of it is reasoning", None),
]


@pytest.mark.parametrize("split", SPLITS)
@pytest.mark.parametrize("cls,text,reasoning,content", REASONING_CASES,
                         ids=[f"{c[0].__name__}-{i}" for i, c in enumerate(REASONING_CASES)])
def test_reasoning_parser_finished_and_streamed(cls, text, reasoning, content, split):
    assert cls(None).extract_reasoning(text) == (reasoning, content)
    parser, so_far, r, c = cls(None), "", "", ""
    for p in pieces(text, split):
        prev, so_far = so_far, so_far + p
        d = parser.extract_reasoning_streaming(prev, so_far, p)
        if d is not None:
            r += d.reasoning_content or ""
            c += d.content or ""
    assert (r, c) == (reasoning or "", content or "")


def test_the_builtins_are_registered_and_unknown_names_are_refused_with_the_known_ones():
    assert discovery.tool_parsers()["hermes"] is HermesToolParser
    assert discovery.reasoning_parsers()["deepseek_r1"] is DeepSeekR1ReasoningParser
    assert parser_class("tool_parser", "pythonic") is PythonicToolParser and parser_class("tool_parser", None) is None
    with pytest.raises(ValueError, match="hermes, llama3_json, mistral, phi4_mini_json, pythonic"):
        parser_class("tool_parser", "nope")
    import argparse

    from tokenmill.entrypoints.openai.serve_cmd import check_parser_args
    with pytest.raises(SystemExit, match="--reasoning-parser 'nope'.*deepseek_r1, glm45, granite, qwen3"):
        check_parser_args(argparse.Namespace(enable_auto_tool_choice=False, tool_call_parser=None,
                                             reasoning_parser="nope"))
    with pytest.raises(SystemExit, match="--enable-auto-tool-choice needs --tool-call-parser"):
        check_parser_args(argparse.Namespace(enable_auto_tool_choice=True, tool_call_parser=None,
                                             reasoning_parser=None))
    check_parser_args(argparse.Namespace(enable_auto_tool_choice=True, tool_call_parser="hermes",
                                         reasoning_parser="qwen3"))


# ------------------------------------------------------------------- what the client sees
QWEN_CALL = ('<think>\nThe user wants the weather in Paris and Rome.\n</think>\n\n'
             '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
             '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>')


def _response(text: str, output, finish="stop") -> dict:
    ch = Choice()
    ch.text, ch.finish_reason = [text], finish
    body = {"id": "chatcmpl-x", "object": "chat.completion", "created": 0, "model": "m",
            "choices": [finished_choice(0, ch, output, False)],
            "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}}
    ChatCompletion.model_validate(body)      # the official SDK's model of the response accepts it
    return json.loads(json.dumps(body))


def _stream(text: str, output, split, finish="stop") -> list[dict]:
    chunks, parts = [], pieces(text, split)
    for i, p in enumerate(parts):
        choice = streamed_choice(0, p, None, finish if i == len(parts) - 1 else None, None, output)
        if choice is not None:
            chunk = {"id": "chatcmpl-x", "object": "chat.completion.chunk", "created": 0, "model": "m",
                     "choices": [choice]}
            ChatCompletionChunk.model_validate(chunk)
            chunks.append(json.loads(json.dumps(chunk)))
    return chunks


def _accumulate(chunks: list[dict]) -> dict:
    """What a client assembles from the deltas (as the SDK's stream helpers do)."""
    msg: dict = {"content": "", "reasoning_content": "", "tool_calls": []}
    finish = None
    for chunk in chunks:
        (choice,) = chunk["choices"]
        d = choice["delta"]
        msg["content"] += d.get("content") or ""
        msg["reasoning_content"] += d.get("reasoning_content") or ""
        for tc in d.get("tool_calls", []):
            if tc["index"] == len(msg["tool_calls"]):
                assert tc["id"].startswith("call_") and tc["type"] == "function"
                msg["tool_calls"].append({"id": tc["id"], "name": tc["function"]["name"],
                                          "arguments": tc["function"]["arguments"]})
            else:
                assert "id" not in tc and "name" not in tc["function"]
                msg["tool_calls"][tc["index"]]["arguments"] += tc["function"]["arguments"]
        finish = choice["finish_reason"] or finish
    return {**msg, "finish_reason": finish}


def test_chat_response_with_reasoning_and_tool_calls():
    body = _response(QWEN_CALL, ChatChoiceOutput(HermesToolParser(None), Qwen3ReasoningParser(None)))
    (choice,) = body["choices"]
    assert choice["finish_reason"] == "tool_calls"
    msg = choice["message"]
    assert msg["role"] == "assistant" and msg["content"] is None
    assert msg["reasoning_content"] == "The user wants the weather in Paris and Rome.\n"
    assert [(c["type"], c["function"]["name"], json.loads(c["function"]["arguments"])) for c in msg["tool_calls"]] == [
        ("function", "get_weather", {"city": "Paris"}), ("function", "get_weather", {"city": "Rome"})]
    assert all(c["id"].startswith("call_") for c in msg["tool_calls"])
    assert len({c["id"] for c in msg["tool_calls"]}) == 2


def test_chat_response_parallel_tool_calls_false_keeps_the_first_and_length_stays_length():
    body = _response(QWEN_CALL, ChatChoiceOutput(HermesToolParser(None), Qwen3ReasoningParser(None),
                                                 parallel_tool_calls=False))
    calls = body["choices"][0]["message"]["tool_calls"]
    assert [json.loads(c["function"]["arguments"]) for c in calls] == [{"city": "Paris"}]
    body = _response(QWEN_CALL, ChatChoiceOutput(HermesToolParser(None), None), finish="length")
    assert body["choices"][0]["finish_reason"] == "length"


def test_chat_response_without_tool_calls_is_plain_content():
    body = _response("Paris is sunny today.", ChatChoiceOutput(HermesToolParser(None), None))
    assert body["choices"][0]["message"] == {"role": "assistant", "content": "Paris is sunny today."}
    assert body["choices"][0]["finish_reason"] == "stop"
    body = _response("no parser", None)
    assert body["choices"][0]["message"] == {"role": "assistant", "content": "no parser"}


@pytest.mark.parametrize("split", SPLITS)
def test_chat_stream_with_reasoning_and_tool_calls(split):
    chunks = _stream(QWEN_CALL, ChatChoiceOutput(HermesToolParser(None), Qwen3ReasoningParser(None)), split)
    got = _accumulate(chunks)
    assert got["finish_reason"] == "tool_calls" and chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
    assert got["content"] == ""
    assert got["reasoning_content"] == "The user wants the weather in Paris and Rome.\n"
    assert [(c["name"], json.loads(c["arguments"])) for c in got["tool_calls"]] == [
        ("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Rome"})]
    assert not any("<tool_call>" in json.dumps(c) or "<think>" in json.dumps(c) for c in chunks)
    if split == 1:       # the arguments really stream: several chunks carry pieces of them
        assert sum(1 for c in chunks for tc in c["choices"][0]["delta"].get("tool_calls", [])
                   if "name" not in tc["function"]) > 5


@pytest.mark.parametrize("split", [1, 3, "seed0"])
def test_chat_stream_parallel_tool_calls_false(split):
    chunks = _stream(QWEN_CALL, ChatChoiceOutput(HermesToolParser(None), None, parallel_tool_calls=False), split)
    got = _accumulate(chunks)
    assert [json.loads(c["arguments"]) for c in got["tool_calls"]] == [{"city": "Paris"}]
    assert got["content"] == "<think>\nThe user wants the weather in Paris and Rome.\n</think>\n\n"


@pytest.mark.parametrize("split", [1, 4])
def test_chat_stream_of_plain_text_with_a_tool_parser(split):
    text = "Sure! Paris is at 48.86N <tool_ maybe."
    got = _accumulate(_stream(text, ChatChoiceOutput(HermesToolParser(None), None), split))
    assert got == {"content": text, "reasoning_content": "", "tool_calls": [], "finish_reason": "stop"}


class _FinishedOnly(ToolParser):
    """A plugin's parser with the finished extraction only (like tokenmill-testplatform's)."""

    def extract_tool_calls(self, model_output):
        name, _, args = model_output.partition(" ")
        return ExtractedToolCalls(None, [ToolCall(name, args)])


def test_a_parser_without_streaming_sends_everything_with_the_last_chunk():
    chunks = _stream('lookup {"q": 1}', ChatChoiceOutput(_FinishedOnly(None), None), 2)
    assert len(chunks) == 1 and chunks[0]["choices"][0]["finish_reason"] == "tool_calls"
    got = _accumulate(chunks)
    assert [(c["name"], c["arguments"]) for c in got["tool_calls"]] == [("lookup", '{"q": 1}')]


# ------------------------------------------------------------------- tool results in the prompt
class _RecordingTokenizer:
    def apply_chat_template(self, msgs, **kwargs):
        self.msgs, self.kwargs = msgs, kwargs
        return "rendered"

    def encode(self, text, add_special_tokens=False):
        return [1, 2, 3]


def test_tool_call_and_tool_result_messages_reach_the_chat_template():
    from tokenmill.entrypoints.openai.protocol import ChatCompletionRequest
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    req = ChatCompletionRequest.model_validate({"messages": [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 21}'},
    ], "tools": tools})
    import asyncio
    from types import SimpleNamespace

    from tokenmill.entrypoints.openai.limits import RequestLimits
    from tokenmill.entrypoints.openai.workers import Workers
    tok = _RecordingTokenizer()
    state = SimpleNamespace(tokenizer=tok, settings=SimpleNamespace(limits=RequestLimits()), max_prompt_bytes=0,
                            info=SimpleNamespace(max_model_len=1024), workers=Workers(RequestLimits(), tok, 1))
    assert asyncio.run(chat_prompt(state, req.messages, req.tools)) == [1, 2, 3]
    user, assistant, tool = tok.msgs
    assert assistant["content"] == "" and assistant["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}
    assert assistant["tool_calls"][0]["id"] == "call_1"
    assert tool == {"role": "tool", "content": '{"temp": 21}', "tool_call_id": "call_1"}
    assert tok.kwargs["tools"] == tools
