"""The tool-call and reasoning parsers of the Granite, Phi-4-mini, GLM-4.5, Cohere Command and Gemma
formats (entrypoints/openai/parsers/family_tool_parsers.py, reasoning_parsers.py, and the pythonic
parser's ```tool_code fence), on outputs written the way each family's chat template asks for them:
finished, streamed in small pieces (the deltas add up to the finished extraction), plain text
passed through, and malformed output kept as text."""
from __future__ import annotations

import json
import random

import pytest

from tokenmill.entrypoints.openai.chat_output import ChatChoiceOutput, parser_class
from tokenmill.entrypoints.openai.parsers.family_tool_parsers import (CohereCommand3ToolParser, Glm45ToolParser,
                                                                       GraniteToolParser, Phi4MiniJsonToolParser,
                                                                       glm_value)
from tokenmill.entrypoints.openai.parsers.reasoning_parsers import (CohereCommand3ReasoningParser,
                                                                     Glm45ReasoningParser, GraniteReasoningParser)
from tokenmill.entrypoints.openai.parsers.tool_parsers import PythonicToolParser
from tokenmill.plugins import discovery

PARIS = ("get_weather", {"city": "Paris"})
ROME = ("get_weather", {"city": "Rome"})
ACT, END_ACT = "<|START_ACTION|>", "<|END_ACTION|>"


def _cohere_call(i: int, city: str) -> str:
    return f'{{"tool_call_id": "{i}", "tool_name": "get_weather", "parameters": {{"city": "{city}"}}}}'


# (parser, model output, expected content, expected [(name, arguments as an object)])
CALLS = [
    # Granite 3.x: <|tool_call|> (a special token, often skipped) or the string <tool_call> (3.1+)
    (GraniteToolParser, '<|tool_call|>[{"name": "get_weather", "arguments": {"city": "Paris"}}]', None, [PARIS]),
    (GraniteToolParser, '<|tool_call|>[{"name": "get_weather", "arguments": {"city": "Paris"}}, '
                        '{"name": "get_weather", "arguments": {"city": "Rome"}}]', None, [PARIS, ROME]),
    (GraniteToolParser, '<tool_call>[{"name": "get_time", "arguments": {}}]', None, [("get_time", {})]),
    (GraniteToolParser, ' [{"name": "get_weather", "arguments": {"city": "Paris"}}]', None, [PARIS]),
    (GraniteToolParser, 'Checking.<|tool_call|>[{"name": "get_weather", "arguments": {"city": "Paris"}}]',
     "Checking.", [PARIS]),
    # Phi-4-mini: functools[...], "arguments" or "parameters"
    (Phi4MiniJsonToolParser, 'functools[{"name": "get_weather", "arguments": {"city": "Paris"}}]', None, [PARIS]),
    (Phi4MiniJsonToolParser, 'functools[{"name": "get_weather", "parameters": {"city": "Paris"}}, '
                             '{"name": "get_weather", "parameters": {"city": "Rome"}}]', None, [PARIS, ROME]),
    # GLM-4.5 / 4.6 (and 4.7's name straight before <arg_key>)
    (Glm45ToolParser, '<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n</tool_call>',
     None, [PARIS]),
    (Glm45ToolParser, 'I will check both.\n<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris'
                      '</arg_value>\n</tool_call>\n<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Rome'
                      '</arg_value>\n</tool_call>', "I will check both.\n", [PARIS, ROME]),
    (Glm45ToolParser, '<tool_call>get_weather<arg_key>city</arg_key><arg_value>Paris</arg_value></tool_call>',
     None, [PARIS]),
    (Glm45ToolParser, '<tool_call>get_time\n</tool_call>', None, [("get_time", {})]),
    (Glm45ToolParser, '<tool_call>search\n<arg_key>query</arg_key>\n<arg_value>say "hi" <b>\nnow</arg_value>\n'
                      '<arg_key>limit</arg_key>\n<arg_value>3</arg_value>\n<arg_key>exact</arg_key>\n<arg_value>true'
                      '</arg_value>\n<arg_key>filters</arg_key>\n<arg_value>{"open": [1, 2.5]}</arg_value>\n'
                      '</tool_call>',
     None, [("search", {"query": 'say "hi" <b>\nnow', "limit": 3, "exact": True, "filters": {"open": [1, 2.5]}})]),
    # Cohere Command 3 (R7B, A): with the action markers, or with them skipped as special tokens
    (CohereCommand3ToolParser, f'{ACT}[\n    {_cohere_call(0, "Paris")}\n]{END_ACT}', None, [PARIS]),
    (CohereCommand3ToolParser, f'I will look up both.{ACT}[\n    {_cohere_call(0, "Paris")},\n    '
                               f'{_cohere_call(1, "Rome")}\n]{END_ACT}', "I will look up both.", [PARIS, ROME]),
    (CohereCommand3ToolParser, f'I will look up the weather.[\n    {_cohere_call(0, "Paris")}\n]',
     "I will look up the weather.", [PARIS]),
    (CohereCommand3ToolParser, '[{"tool_name": "get_time", "parameters": {}}]', None, [("get_time", {})]),
    # Gemma 3: the pythonic list, bare or fenced in ```tool_code, or bare calls in the fence
    (PythonicToolParser, '[get_weather(city="Paris"), get_weather(city="Rome")]', None, [PARIS, ROME]),
    (PythonicToolParser, '```tool_code\n[get_weather(city="Paris")]\n```', None, [PARIS]),
    (PythonicToolParser, '```tool_code\nget_weather(city="Paris")\nget_weather(city="Rome")\n```', None,
     [PARIS, ROME]),
    (PythonicToolParser, "Let me check.\n```tool_code\nget_weather(city='Paris')\n```", "Let me check.\n", [PARIS]),
    (PythonicToolParser, '```tool_code\nget_weather(city="Paris")', None, [PARIS]),    # ended inside the fence
]

PLAIN = [
    "The weather in Paris is sunny, 21 C.",
    "See [1] and [2]: {\"a\": 1} is JSON.",
    "Use `functools.partial` or <tool_call> tags ``` here.",
    "Here is a list: [1, 2, 3]",
]

# (parser, malformed output): kept whole as content
MALFORMED = [
    (GraniteToolParser, '<|tool_call|>[{"name": "get_weather", "arguments": {city: Paris}}]'),
    (GraniteToolParser, '<|tool_call|>[{"name": "get_weather", "arguments": {"city": "Paris"}}] and more'),
    (Phi4MiniJsonToolParser, 'functools[{"name": "get_weather", "arguments": {"city": }}]'),
    (Phi4MiniJsonToolParser, '[{"name": "get_weather", "arguments": {"city": "Paris"}}]'),     # no functools
    (Phi4MiniJsonToolParser, 'I like functools.partial for that.'),
    (Glm45ToolParser, '<tool_call>get_weather\n<arg_key>city</arg_key>\nParis\n</tool_call>'),
    (Glm45ToolParser, '<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>'),  # unclosed
    (Glm45ToolParser, '<tool_call> is the tag GLM uses.'),
    (CohereCommand3ToolParser, f'{ACT}[{{"tool_call_id": "0", "tool_name": "f", "parameters": {{"x": }}}}]{END_ACT}'),
    (CohereCommand3ToolParser, f'{ACT}[{_cohere_call(0, "Paris")}]{END_ACT} and then some text'),
    (PythonicToolParser, '```tool_code\nprint(get_weather("Paris"))\n```'),       # a positional argument
    (PythonicToolParser, '```python\nget_weather(city="Paris")\n```'),            # not a tool_code fence
    (PythonicToolParser, '```tool_code\nget_weather(city="Paris")\n```\nDone.'),  # text after the fence
]

TOOL_PARSERS = [GraniteToolParser, Phi4MiniJsonToolParser, Glm45ToolParser, CohereCommand3ToolParser,
                PythonicToolParser]
SPLITS = [1, 2, 5, 17, "seed0", "seed1"]


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


def stream_tools(parser, chunks: list[str]) -> tuple[str, list[list]]:
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


def _ids(cases):
    return [f"{c[0].__name__}-{i}" for i, c in enumerate(cases)]


@pytest.mark.parametrize("cls,text,content,expected", CALLS, ids=_ids(CALLS))
def test_tool_calls_finished(cls, text, content, expected):
    got = cls(None).extract_tool_calls(text)
    assert got.content == content
    assert [(c.name, json.loads(c.arguments)) for c in got.tool_calls] == expected


@pytest.mark.parametrize("split", SPLITS)
@pytest.mark.parametrize("cls,text,content,expected", CALLS, ids=_ids(CALLS))
def test_tool_calls_streamed_add_up_to_the_finished(cls, text, content, expected, split):
    finished = cls(None).extract_tool_calls(text)
    streamed_content, calls = stream_tools(cls(None), pieces(text, split))
    assert streamed_content == (finished.content or "")
    assert calls == [[c.name, c.arguments] for c in finished.tool_calls]
    assert [(name, json.loads(args)) for name, args in calls] == expected


@pytest.mark.parametrize("cls", [GraniteToolParser, Glm45ToolParser, CohereCommand3ToolParser, PythonicToolParser])
def test_a_call_streams_in_fragments_before_the_next_one_starts(cls):
    text = next(t for c, t, _, e in CALLS if c is cls and len(e) == 2)
    parser, so_far, fragments = cls(None), "", []
    for c in pieces(text, 1):
        prev, so_far = so_far, so_far + c
        d = parser.extract_tool_calls_streaming(prev, so_far, c)
        if d is not None and any(tc.index == 1 for tc in d.tool_calls):
            break
        fragments += [tc.arguments for tc in (d.tool_calls if d is not None else []) if tc.index == 0]
    assert len(fragments) >= 2 and json.loads("".join(fragments)) == {"city": "Paris"}


@pytest.mark.parametrize("split", [1, 3, "seed0"])
@pytest.mark.parametrize("text", PLAIN)
@pytest.mark.parametrize("cls", TOOL_PARSERS)
def test_plain_text_passes_through(cls, text, split):
    assert cls(None).extract_tool_calls(text).content == text
    assert cls(None).extract_tool_calls(text).tool_calls == []
    streamed, calls = stream_tools(cls(None), pieces(text, split))
    assert calls == [] and text.startswith(streamed)


@pytest.mark.parametrize("split", [1, 4, "seed1"])
@pytest.mark.parametrize("cls,text", MALFORMED, ids=_ids(MALFORMED))
def test_malformed_output_is_kept_as_text(cls, text, split):
    got = cls(None).extract_tool_calls(text)
    assert got.content == text and got.tool_calls == []
    streamed, _ = stream_tools(cls(None), pieces(text, split))
    assert text.startswith(streamed)     # what was streamed is a prefix; the server sends the rest at the end


def test_glm_values_read_as_the_template_writes_them():
    assert glm_value(" 42 ") == 42 and glm_value("true") is True and glm_value("null") is None
    assert glm_value('{"a": [1, "x"]}') == {"a": [1, "x"]}
    assert json.dumps(glm_value("{'a': (1, 2)}")) == '{"a": [1, 2]}' and glm_value("True") is True
    assert glm_value("Paris, France") == "Paris, France" and glm_value("NaN") == "NaN"
    assert glm_value("[unclosed") == "[unclosed"


# ------------------------------------------------------------------------------- reasoning
REASONING = [
    (GraniteReasoningParser, "Here is my thought process:\nThe user asks 2+2.\n\nHere is my response:\nIt is 4.",
     "The user asks 2+2.", "It is 4."),
    (GraniteReasoningParser, "Here's my thought process: short. Here's my response: ok", "short.", "ok"),
    (GraniteReasoningParser, "<think>Compute 2+2.</think>\n<response>It is 4.</response>", "Compute 2+2.", "It is 4."),
    (GraniteReasoningParser, "<think>Compute.</think>It is 4.", "Compute.", "It is 4."),
    (GraniteReasoningParser, "Here is the answer: 4.", None, "Here is the answer: 4."),
    (GraniteReasoningParser, "Here is my thought process: cut off by max_tokens", "cut off by max_tokens", None),
    (Glm45ReasoningParser, "<think>Let me see: 2+2.</think>\nIt is 4.", "Let me see: 2+2.", "It is 4."),
    (Glm45ReasoningParser, "<think></think>\nHi!", None, "Hi!"),
    (Glm45ReasoningParser, "No thinking here.", None, "No thinking here."),
    (CohereCommand3ReasoningParser, "<|START_THINKING|>I will look it up.<|END_THINKING|><|START_RESPONSE|>"
                                    "Paris is sunny.<|END_RESPONSE|>", "I will look it up.", "Paris is sunny."),
    (CohereCommand3ReasoningParser, "<|START_RESPONSE|>Hi!<|END_RESPONSE|>", None, "Hi!"),
    (CohereCommand3ReasoningParser, "Hi there (markers skipped).", None, "Hi there (markers skipped)."),
    (CohereCommand3ReasoningParser, f"<|START_THINKING|>plan<|END_THINKING|>{ACT}[{_cohere_call(0, 'Paris')}]"
                                    f"{END_ACT}", "plan", f"{ACT}[{_cohere_call(0, 'Paris')}]{END_ACT}"),
    (CohereCommand3ReasoningParser, "<|START_THINKING|>still planning", "still planning", None),
]


@pytest.mark.parametrize("split", SPLITS)
@pytest.mark.parametrize("cls,text,reasoning,content", REASONING, ids=_ids(REASONING))
def test_reasoning_finished_and_streamed(cls, text, reasoning, content, split):
    assert cls(None).extract_reasoning(text) == (reasoning, content)
    parser, so_far, r, c = cls(None), "", "", ""
    for p in pieces(text, split):
        prev, so_far = so_far, so_far + p
        d = parser.extract_reasoning_streaming(prev, so_far, p)
        if d is not None:
            r += d.reasoning_content or ""
            c += d.content or ""
    assert (r, c) == (reasoning or "", content or "")


def test_reasoning_ended_for_structured_outputs():
    granite = GraniteReasoningParser(None)
    assert granite.reasoning_ended("<|start_of_role|>assistant<|end_of_role|>", "")
    assert not granite.reasoning_ended("", "Here is my thought process: hm")
    assert granite.reasoning_ended("", "Here is my thought process: hm. Here is my response:")
    assert not granite.reasoning_ended("", "<think>hm") and granite.reasoning_ended("", "<think>hm</think>")
    cohere = CohereCommand3ReasoningParser(None)
    assert cohere.reasoning_ended("<|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|>", "")
    assert not cohere.reasoning_ended("<|CHATBOT_TOKEN|><|START_THINKING|>", "plan")
    assert cohere.reasoning_ended("<|CHATBOT_TOKEN|><|START_THINKING|>", "plan<|END_THINKING|>")
    glm = Glm45ReasoningParser(None)
    assert glm.reasoning_ended("<|assistant|>\n<think></think>", "")      # enable_thinking=False
    assert not glm.reasoning_ended("<|assistant|><think>", "hm")


def test_registered_under_vllms_names():
    tools, reasoning = discovery.tool_parsers(), discovery.reasoning_parsers()
    assert tools["granite"] is GraniteToolParser and tools["phi4_mini_json"] is Phi4MiniJsonToolParser
    assert tools["glm45"] is Glm45ToolParser and tools["cohere_command3"] is CohereCommand3ToolParser
    assert reasoning["granite"] is GraniteReasoningParser and reasoning["glm45"] is Glm45ReasoningParser
    assert reasoning["cohere_command3"] is CohereCommand3ReasoningParser
    assert parser_class("tool_parser", "glm45") is Glm45ToolParser
    assert parser_class("reasoning_parser", "granite") is GraniteReasoningParser


# ------------------------------------------------------------------- what the client sees
CHATS = [
    (Glm45ToolParser, Glm45ReasoningParser,
     "<think>Two cities.</think>\n<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n"
     "</tool_call>\n<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Rome</arg_value>\n</tool_call>",
     "Two cities."),
    (CohereCommand3ToolParser, CohereCommand3ReasoningParser,
     f"<|START_THINKING|>I will look up Paris and Rome.<|END_THINKING|>{ACT}[\n    {_cohere_call(0, 'Paris')},\n"
     f"    {_cohere_call(1, 'Rome')}\n]{END_ACT}", "I will look up Paris and Rome."),
    (GraniteToolParser, GraniteReasoningParser,
     'Here is my thought process: Two cities. Here is my response: <|tool_call|>[{"name": "get_weather", '
     '"arguments": {"city": "Paris"}}, {"name": "get_weather", "arguments": {"city": "Rome"}}]', "Two cities."),
]


@pytest.mark.parametrize("split", [1, 3, "seed0"])
@pytest.mark.parametrize("tool_cls,reasoning_cls,text,reasoning", CHATS, ids=[c[0].__name__ for c in CHATS])
def test_chat_message_and_stream_with_reasoning_and_tool_calls(tool_cls, reasoning_cls, text, reasoning, split):
    msg = ChatChoiceOutput(tool_cls(None), reasoning_cls(None)).message(text)
    assert msg["content"] is None and msg["reasoning_content"] == reasoning
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in msg["tool_calls"]] == [PARIS, ROME]
    out = ChatChoiceOutput(tool_cls(None), reasoning_cls(None))
    deltas = [out.feed(p) for p in pieces(text, split)] + [out.finish()]
    content = "".join(d.get("content", "") for d in deltas)
    streamed_reasoning = "".join(d.get("reasoning_content", "") for d in deltas)
    calls: list[list] = []
    for d in deltas:
        for tc in d.get("tool_calls", []):
            if tc["index"] == len(calls):
                calls.append([tc["function"]["name"], tc["function"]["arguments"]])
            else:
                calls[tc["index"]][1] += tc["function"]["arguments"]
    assert content == "" and streamed_reasoning == reasoning
    assert [(n, json.loads(a)) for n, a in calls] == [PARIS, ROME]
    assert out.finish_reason("stop") == "tool_calls"
