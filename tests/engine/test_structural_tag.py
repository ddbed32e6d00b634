"""Structured outputs of kind `structural_tag` (vLLM's): free text in which a trigger starts a
begin / JSON schema / end structure -- tool calls in the model's own syntax.

Offline through `LLM` on the default model, once per grammar backend (xgrammar, guidance): a
few-shot prompt whose examples call get_weather with arguments the schema forbids, so the
unconstrained output calls it wrongly and the constrained one must not; the bitmask of a matcher
inside a structure (only what the schema allows; free text before the trigger); the legacy form
and xgrammar's newer `format` form; bad specs refused (param structured_outputs). Then the
server: chat `response_format: {"type": "structural_tag", ...}` and the `structured_outputs` body
field, and their 400s (param response_format when it came from response_format). Issue 32: a
structure's schema with a `$ref` outside it is refused; its `pattern`s are ECMA-262's on both backends.
"""
from __future__ import annotations

import json
import os
import re

import jsonschema
import openai
import pytest
import torch

from tokenmill import SamplingParams, StructuredOutputsParams
from tokenmill.core.errors import RequestError

WEATHER = {"type": "object",
           "properties": {"city": {"type": "string", "maxLength": 12},
                          "unit": {"enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"], "additionalProperties": False}
TIME = {"type": "object", "properties": {"tz": {"type": "string", "maxLength": 8}},
        "required": ["tz"], "additionalProperties": False}
BEGIN, END, TRIGGER = "<function=get_weather>", "</function>", "<function="
LEGACY = {"type": "structural_tag",
          "structures": [{"begin": BEGIN, "schema": WEATHER, "end": END},
                         {"begin": "<function=get_time>", "schema": TIME, "end": END}],
          "triggers": [TRIGGER]}
FORMAT = {"type": "structural_tag", "format": {
    "type": "triggered_tags", "triggers": [TRIGGER],
    "tags": [{"type": "tag", "begin": BEGIN, "content": {"type": "json_schema", "json_schema": WEATHER},
              "end": END}]}}
# The examples' arguments ("location") are not what the schema allows: copied, they are wrong.
FEW_SHOT = ('Tools: get_weather.\n'
            'User: What is the weather in London?\nAssistant: <function=get_weather>{"location": "London"}</function>\n'
            'User: What is the weather in Rome?\nAssistant: <function=get_weather>{"location": "Rome"}</function>\n'
            'User: What is the weather in Paris?\nAssistant:')
SCHEMAS = {BEGIN: WEATHER, "<function=get_time>": TIME}

BACKENDS = ["xgrammar", "guidance"]


@pytest.fixture(scope="module", params=BACKENDS)
def llm(request):
    from tokenmill import LLM
    llm = LLM(max_model_len=512, kv_cache_memory=32 << 20, structured_outputs_backend=request.param)
    assert llm.engine.structured.backend_name == request.param
    yield llm
    del llm


def tool_calls(text: str, truncated: bool = False) -> list[tuple[str, bool]]:
    """(begin, the call is well formed) for every trigger in `text`: one of the begins, JSON that
    its schema validates, the end. A call cut short by max_tokens (`truncated`, the last one)
    is left out."""
    calls, pos = [], 0
    decoder = json.JSONDecoder()
    while (at := text.find(TRIGGER, pos)) >= 0:
        begin = next((b for b in SCHEMAS if text.startswith(b, at)), None)
        pos = at + len(TRIGGER)
        if begin is None:
            calls.append((text[at:at + 24], False))
            continue
        body = at + len(begin)
        rest = text[body:]
        if truncated and END not in rest:
            break
        try:
            value, stop = decoder.raw_decode(rest, len(rest) - len(rest.lstrip()))
            jsonschema.validate(value, SCHEMAS[begin])
            ok = re.match(r"\s*" + re.escape(END), rest[stop:]) is not None
        except (ValueError, jsonschema.ValidationError):
            ok = False
        calls.append((begin, ok))
    return calls


def allowed(matcher, vocab: int) -> list[int]:
    bitmask = torch.zeros(1, (vocab + 31) // 32, dtype=torch.int32)
    matcher.fill_bitmask(bitmask, 0)
    words = bitmask[0].tolist()
    return [t for t in range(vocab) if (words[t // 32] >> (t % 32)) & 1]


def test_params():
    so = StructuredOutputsParams(structural_tag=LEGACY)
    assert so.kind == "structural_tag"
    # A dict and any JSON text of it are one constraint (one cache key), key order kept.
    assert StructuredOutputsParams(structural_tag=json.dumps(LEGACY, indent=2)).spec == so.spec
    assert json.loads(so.spec) == LEGACY and list(json.loads(so.spec)) == list(LEGACY)
    assert SamplingParams(structured_outputs={"structural_tag": FORMAT}).structured_outputs.kind == "structural_tag"
    for bad in ("{not json", "[1]", ["x"], 5, {"type": "json_schema", "format": {}}, {"type": "structural_tag"},
                {"structures": [], "triggers": [], "format": {}}, {"structures": {}, "triggers": ["<a"]},
                {"triggers": ["<a"]}):
        with pytest.raises(ValueError, match="structured_outputs.*structural_tag") as e:
            StructuredOutputsParams(structural_tag=bad)
        assert e.value.param == "structured_outputs"
    with pytest.raises(ValueError, match="exactly one") as e:
        StructuredOutputsParams(regex="a", structural_tag=LEGACY)
    assert e.value.param == "structured_outputs"


def test_tool_calls_follow_the_schema(llm):
    legacy, new = ({"structural_tag": tag} for tag in (LEGACY, FORMAT))
    params = [SamplingParams(max_tokens=32, temperature=0, stop=["\nUser:"], structured_outputs=so)
              for so in (None, legacy, new)]                                  # free, legacy form, format form
    params.append(SamplingParams(max_tokens=32, temperature=0.8, seed=1, stop=["\nUser:"], structured_outputs=legacy))
    outs = [o.outputs[0] for o in llm.generate([FEW_SHOT] * len(params), params, use_tqdm=False)]
    # Unconstrained, the model copies the examples' arguments: the check below can fail.
    assert BEGIN in outs[0].text and tool_calls(outs[0].text) == [(BEGIN, False)], outs[0].text
    # Constrained (greedy), it calls the tool too, with arguments the schema allows.
    for out in outs[1:3]:
        assert tool_calls(out.text) == [(BEGIN, True)] and out.finish_reason == "stop", out.text
    for out in outs[3:]:
        calls = tool_calls(out.text, truncated=out.finish_reason == "length")
        assert all(ok for _, ok in calls), out.text


def test_mask_inside_a_structure(llm):
    """The matcher's bitmask: anything (and EOS) in free text; after a trigger only the
    structures' begins; after a begin only what the schema allows; never EOS inside."""
    structured = llm.engine.structured
    tok, vocab, eos = structured.tokenizer, structured.backend.vocab_size, structured.stop_token_ids[0]
    compiled = structured.backend.compiled("structural_tag", StructuredOutputsParams(structural_tag=LEGACY).spec)

    def after(text):
        m = compiled.new_matcher()
        assert all(m.accept_token(t) for t in tok.encode(text, add_special_tokens=False)), text
        ids = allowed(m, vocab)
        return ids, [tok.decode([t]) for t in ids]

    ids, _ = after("Sure, let me check.")
    assert eos in ids and len(ids) > vocab // 2
    ids, words = after("Sure. <function=")
    assert eos not in ids and words and all(("get_weather>".startswith(w) or "get_time>".startswith(w)) for w in words)
    ids, words = after('Sure. <function=get_weather>{"city": "Paris", "unit": "')
    assert eos not in ids and words, words
    assert all(any(w.startswith(v + '"') or (v + '"').startswith(w) for v in ("celsius", "fahrenheit"))
               for w in words), words
    ids, words = after('Sure. <function=get_weather>{"city": "Paris", "unit": "celsius"}')
    assert eos not in ids and words and all(w.strip() == "" or END.startswith(w.lstrip()) for w in words), words
    ids, _ = after('Sure. <function=get_weather>{"city": "Paris", "unit": "celsius"}</function> Done')
    assert eos in ids
    # A begin that is no structure's, or arguments the schema forbids, are refused.
    for wrong in ("Sure. <function=get_news>", 'Sure. <function=get_weather>{"location": "Paris"}'):
        m = compiled.new_matcher()
        assert not all(m.accept_token(t) for t in tok.encode(wrong, add_special_tokens=False)), wrong


def test_format_form_beyond_triggered_tags(llm):
    """xgrammar compiles all of its format language; the guidance backend takes only the
    triggered_tags shape the legacy form has (test above) and refuses the rest, saying so."""
    any_text = SamplingParams(max_tokens=4, temperature=0,
                              structured_outputs={"structural_tag": {"format": {"type": "any_text"}}})
    if llm.engine.structured.backend_name == "xgrammar":
        assert llm.generate(["Hello"], any_text, use_tqdm=False)[0].outputs[0].text
    else:
        with pytest.raises(RequestError, match="format type 'any_text' is not supported.*xgrammar") as e:
            llm.generate(["Hello"], any_text, use_tqdm=False)
        assert e.value.param == "structured_outputs"


@pytest.mark.parametrize("tag, words", [
    ({"structures": [], "triggers": [TRIGGER]}, "structures must be a non-empty list"),
    ({"structures": [{"begin": BEGIN, "schema": "{not json", "end": END}], "triggers": [TRIGGER]},
     r"structures\[0\]\.schema is not valid JSON"),
    ({"structures": [{"begin": BEGIN, "schema": {"type": "no-such-type"}, "end": END}], "triggers": [TRIGGER]},
     "invalid structural tag"),
    ({"structures": [{"begin": "<tool>", "schema": WEATHER, "end": END}], "triggers": [TRIGGER]},
     "does not start with any of the triggers"),
    ({"structures": [{"begin": BEGIN, "schema": WEATHER, "end": END}], "triggers": []}, "triggers must be"),
    ({"format": {"type": "triggered_tags", "triggers": [TRIGGER], "tags": []}}, "tags"),
])
def test_bad_structural_tag_is_refused(llm, tag, words):
    with pytest.raises(RequestError, match=words) as e:
        llm.generate(["x"], SamplingParams(max_tokens=4, structured_outputs={"structural_tag": tag}), use_tqdm=False)
    assert e.value.param == "structured_outputs" and e.value.code == "invalid_value"
    assert llm.generate(["x"], SamplingParams(max_tokens=2, temperature=0), use_tqdm=False)[0].outputs[0].text


REMOTE = "https://example.com/schemas/weather.json"


@pytest.mark.parametrize("tag", [
    {"structures": [{"begin": BEGIN, "schema": {"$ref": REMOTE}, "end": END}], "triggers": [TRIGGER]},
    {"structures": [{"begin": BEGIN, "schema": json.dumps({"properties": {"city": {"$ref": REMOTE}}}), "end": END}],
     "triggers": [TRIGGER]},
    {"format": {"type": "triggered_tags", "triggers": [TRIGGER], "tags": [
        {"type": "tag", "begin": BEGIN, "content": {"type": "json_schema", "json_schema": {"$ref": REMOTE}},
         "end": END}]}},
])
def test_remote_ref_in_a_structure_is_refused(llm, tag):
    """A structure's schema is a JSON schema like any other: a $ref outside it is a 400, never fetched (issue 32)."""
    with pytest.raises(RequestError, match=r"\$ref.*never fetched") as e:
        llm.generate(["x"], SamplingParams(max_tokens=4, structured_outputs={"structural_tag": tag}), use_tqdm=False)
    assert e.value.param == "structured_outputs" and e.value.code == "invalid_value" and REMOTE in str(e.value)


def test_pattern_in_a_structure_is_ecma(llm):
    """A `pattern` inside a structure's schema reads \\d and \\s as ECMA-262 does, on both backends."""
    schema = {"type": "object", "properties": {"phone": {"type": "string", "pattern": r"^\d{3}\s\d{4}$"}},
              "required": ["phone"], "additionalProperties": False}
    tag = {"structures": [{"begin": BEGIN, "schema": schema, "end": END}], "triggers": [TRIGGER]}
    structured = llm.engine.structured
    compiled = structured.backend.compiled("structural_tag", StructuredOutputsParams(structural_tag=tag).spec)

    def takes(phone):
        m = compiled.new_matcher()
        seps = (", ", ": ") if structured.backend_name == "xgrammar" else (",", ":")   # each one's compact JSON
        text = f"Sure. {BEGIN}{json.dumps({'phone': phone}, ensure_ascii=False, separators=seps)}{END}"
        return all(m.accept_token(t) for t in structured.tokenizer.encode(text, add_special_tokens=False))

    assert takes("123 4567") and takes("123\xa04567") and takes("123\ufeff4567")
    for wrong in ("١٢٣ ٤٥٦٧", "\U0001FBF8\U0001FBF8\U0001FBF8 4567", "123\x854567"):
        assert not takes(wrong), wrong


# ==================================================================== the server
MODEL = "smol"
SERVER_ARGS = ["--device", "cpu", "--served-model-name", MODEL, "--max-model-len", "512",
               "--max-num-seqs", "4", "--num-threads", "1", "--kv-cache-memory", str(32 * 1024 * 1024),
               "--disable-access-log"]


@pytest.fixture(scope="module")
def client(server):
    if os.environ.get("TOKENMILL_TEST_FAKE_ENGINE") == "1":
        pytest.skip("the fake engine does not constrain its output")
    return openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=120)


def test_server_structural_tag(client):
    out = client.completions.create(model=MODEL, prompt=FEW_SHOT, max_tokens=32, temperature=0, stop=["\nUser:"],
                                    extra_body={"structured_outputs": {"structural_tag": json.dumps(LEGACY)}})
    assert tool_calls(out.choices[0].text) == [(BEGIN, True)], out.choices[0].text
    messages = [{"role": "user", "content": FEW_SHOT}]
    out = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=32, temperature=0,
                                         response_format=LEGACY)
    text = out.choices[0].message.content or ""
    assert all(ok for _, ok in tool_calls(text, truncated=out.choices[0].finish_reason == "length")), text
    bad = {"type": "structural_tag", "structures": [], "triggers": [TRIGGER]}
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, response_format=bad)
    assert e.value.status_code == 400 and e.value.body["param"] == "response_format", e.value.body
    assert "structures" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4,
                                       extra_body={"structured_outputs": {"structural_tag": bad}})
    assert e.value.body["param"] == "structured_outputs", e.value.body
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4,
                                       response_format={"type": "structural_tag"})
    assert e.value.body["param"] == "response_format", e.value.body
