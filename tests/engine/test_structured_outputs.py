r"""Structured outputs (issue 11): grammar-constrained decoding with the built-in backends.

Offline through `LLM` on the default model, once per grammar backend (xgrammar, guidance)
(constrained and free rows in one batch, greedy and random), and through `tokenmill serve` with
the official openai SDK (response_format, `parse(response_format=PydanticModel)`, vLLM's
structured_outputs body field, 400s).
Issue 32: a `$ref` outside the schema is a 400 however the schema arrives (never fetched, never
unconstrained), and regexes (`regex`, a schema's `pattern`, Lark terminals) are ECMA-262's on
both backends (`\d` is [0-9]: llguidance's own took '🯸' for a digit).
"""
from __future__ import annotations

import json
import os
import re

import jsonschema
import openai
import pytest
from pydantic import BaseModel

from tokenmill import SamplingParams, StructuredOutputsParams

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 10},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 2},
        "address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10}},
                    "required": ["city"], "additionalProperties": False},
    },
    "required": ["name", "age", "role", "tags", "address"],
    "additionalProperties": False,
}
ARITHMETIC_EBNF = r'''
root ::= expr
expr ::= term (("+" | "-") term)*
term ::= factor (("*" | "/") factor)*
factor ::= [0-9]{1,3} | "(" expr ")"
'''
ARITHMETIC_LARK = r'''
start: expr
expr: term (("+" | "-") term)*
term: NUMBER (("*" | "/") NUMBER)*
NUMBER: /[0-9]{1,3}/
'''


BACKENDS = ["xgrammar", "guidance"]


@pytest.fixture(scope="module", params=BACKENDS)
def llm(request):
    from tokenmill import LLM
    llm = LLM(max_model_len=512, kv_cache_memory=64 << 20, structured_outputs_backend=request.param)
    assert llm.engine.structured.backend_name == request.param
    yield llm
    del llm


def _arith_ok(text: str) -> bool:
    """A tiny recursive-descent check of the arithmetic grammar (no eval)."""
    pos = 0

    def factor() -> bool:
        nonlocal pos
        m = re.match(r"[0-9]{1,3}", text[pos:])
        if m:
            pos += m.end()
            return True
        if text[pos:pos + 1] == "(":
            pos += 1
            if not expr() or text[pos:pos + 1] != ")":
                return False
            pos += 1
            return True
        return False

    def chain(item, ops) -> bool:
        nonlocal pos
        if not item():
            return False
        while text[pos:pos + 1] in ops and text[pos:pos + 1]:
            pos += 1
            if not item():
                return False
        return True

    def term() -> bool:
        return chain(factor, "*/")

    def expr() -> bool:
        return chain(term, "+-")

    return expr() and pos == len(text)


def test_params_validation():
    assert StructuredOutputsParams(regex="a+").kind == "regex"
    assert SamplingParams(structured_outputs={"choice": ["a", "b"]}).structured_outputs.choice == ["a", "b"]
    for bad in ({}, {"regex": "a", "choice": ["x"]}, {"choice": []}, {"choice": ["a", ""]}, {"json": 3},
                {"regex": ""}, {"grammar": 5}, {"json_object": "yes"}):
        with pytest.raises(ValueError, match="structured_outputs") as e:
            StructuredOutputsParams(**bad)
        assert e.value.param == "structured_outputs"
    with pytest.raises(ValueError, match="structured_outputs") as e:
        SamplingParams(structured_outputs={"jsn": {}})
    assert e.value.param == "structured_outputs"
    with pytest.raises(ValueError, match="structured_outputs"):
        SamplingParams(structured_outputs="a+")


def test_json_schema_batch_mixed_with_free_rows(llm):
    so = StructuredOutputsParams(json=PERSON)
    prompts, params = [], []
    for i in range(50):
        prompts.append(f"Person number {i} as JSON:")
        params.append(SamplingParams(max_tokens=128, structured_outputs=so,
                                     **({"temperature": 0} if i % 2 else {"temperature": 0.9, "seed": i})))
        if i % 3 == 0 and i < 9:   # unconstrained rows share the batch
            prompts.append(f"Tell me a fact number {i}.")
            params.append(SamplingParams(max_tokens=12, temperature=0.7, seed=i, ignore_eos=True))
    outs = llm.generate(prompts, params, use_tqdm=False)
    constrained = [o for o, p in zip(outs, params) if p.structured_outputs is not None]
    free = [o for o, p in zip(outs, params) if p.structured_outputs is None]
    assert len(constrained) == 50 and len(free) == 3
    for o in constrained:
        c = o.outputs[0]
        assert c.finish_reason == "stop", c.text
        jsonschema.validate(json.loads(c.text), PERSON)
    for o in free:
        assert len(o.outputs[0].token_ids) == 12 and o.outputs[0].finish_reason == "length"


def test_regex_choice_grammar_and_json_object(llm):
    regex = r"[A-Z][a-z]{2,5}-\d{2,4}"
    choices = ["red", "green", "blue"]
    prompts = ["Product code:", "Pick a color:", "Pick a color:", "Compute:", "Compute:", "JSON please:"]
    params = [
        SamplingParams(max_tokens=32, temperature=0.8, seed=3, structured_outputs=StructuredOutputsParams(regex=regex)),
        SamplingParams(max_tokens=16, temperature=0, structured_outputs=StructuredOutputsParams(choice=choices)),
        SamplingParams(n=3, max_tokens=16, temperature=1.0, seed=5,
                       structured_outputs=StructuredOutputsParams(choice=choices)),
        SamplingParams(max_tokens=64, temperature=0.7, seed=1,
                       structured_outputs=StructuredOutputsParams(grammar=ARITHMETIC_EBNF)),
        SamplingParams(max_tokens=64, temperature=0.7, seed=2,
                       structured_outputs=StructuredOutputsParams(grammar=ARITHMETIC_LARK)),
        SamplingParams(max_tokens=96, temperature=0, structured_outputs=StructuredOutputsParams(json_object=True)),
    ]
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert re.fullmatch(regex, outs[0].outputs[0].text), outs[0].outputs[0].text
    assert outs[1].outputs[0].text in choices
    assert len(outs[2].outputs) == 3 and all(c.text in choices for c in outs[2].outputs)
    for o in outs[3:5]:
        c = o.outputs[0]
        if c.finish_reason == "stop":
            assert _arith_ok(c.text), c.text
        else:   # cut by max_tokens: still a prefix the grammar allows
            assert re.fullmatch(r"[0-9+\-*/()]+", c.text), c.text
    obj = outs[5].outputs[0]
    if obj.finish_reason == "stop":
        assert isinstance(json.loads(obj.text), dict)
    else:
        assert obj.text.startswith("{")


def test_min_tokens_does_not_fight_the_grammar(llm):
    so = StructuredOutputsParams(choice=["yes", "no"])
    out = llm.generate(["Answer:"], SamplingParams(max_tokens=16, min_tokens=8, temperature=0, structured_outputs=so),
                       use_tqdm=False)[0].outputs[0]
    assert out.text in ("yes", "no") and out.finish_reason == "stop"


def test_mask_rows_unit():
    """Only the constrained rows are masked, exactly to the matcher's bits (vocab not a multiple of 32)."""
    import torch

    from tokenmill.core.sampling.sampler import Sampler, SamplingRow
    from tokenmill.core.sampling.structured import apply_grammar_masks

    class Only:
        def __init__(self, allowed):
            self.allowed = allowed

        def fill_bitmask(self, bitmask, row):
            bitmask[row] = 0
            for t in self.allowed:
                bitmask[row, t // 32] |= (1 << (t % 32)) if t % 32 != 31 else -(1 << 31)

    vocab = 70
    logits = torch.randn(3, vocab)
    rows = [SamplingRow(SamplingParams(temperature=0), [1], [], None, grammar=Only([5, 31, 69])),
            SamplingRow(SamplingParams(temperature=0), [1], [], None),
            SamplingRow(SamplingParams(temperature=1.0), [1], [], None, grammar=Only([40]))]
    masked = apply_grammar_masks(logits, rows)
    assert torch.isfinite(masked[0]).nonzero().flatten().tolist() == [5, 31, 69]
    assert torch.equal(masked[1], logits[1])
    assert torch.isfinite(masked[2]).nonzero().flatten().tolist() == [40]
    picks = Sampler()(logits, rows).token_ids
    assert picks[0] in (5, 31, 69) and picks[1] == int(logits[1].argmax()) and picks[2] == 40


@pytest.mark.parametrize("so, words", [
    ({"regex": "(unclosed"}, "regex"),
    ({"json": "{not json"}, "JSON"),
    ({"json": {"type": "no-such-type"}}, "JSON schema"),
    ({"grammar": "root ::= ("}, "grammar"),
    ({"grammar": "start: undefined_rule"}, "grammar"),
])
def test_bad_constraint_is_refused(llm, so, words):
    with pytest.raises(ValueError, match=words) as e:
        llm.generate(["x"], SamplingParams(max_tokens=4, structured_outputs=so), use_tqdm=False)
    assert e.value.param == "structured_outputs"
    # The engine is still fine afterwards.
    assert llm.generate(["x"], SamplingParams(max_tokens=2, temperature=0), use_tqdm=False)[0].outputs[0].text


REMOTE = "https://example.com/schemas/thing.json"


@pytest.mark.parametrize("schema, ref", [
    ({"$ref": REMOTE}, REMOTE),
    ({"type": "object", "properties": {"a": {"$ref": REMOTE}}}, REMOTE),
    ({"type": "object", "properties": {"a": {"$ref": "other.json#/x"}}}, "other.json#/x"),
    ({"type": "array", "items": {"anyOf": [{"type": "integer"}, {"$ref": "//example.com/x"}]}}, "//example.com/x"),
    ({"$defs": {"x": {"$ref": "x.json"}}, "$ref": "#/$defs/x"}, "x.json"),
])
def test_remote_ref_is_refused(llm, schema, ref):
    """A $ref outside the schema is refused, never fetched, never left unconstrained (xgrammar
    warned and allowed anything there), on both backends (issue 32)."""
    for so in ({"json": schema}, {"json": json.dumps(schema)}):
        with pytest.raises(ValueError, match=r"\$ref") as e:
            llm.generate(["x"], SamplingParams(max_tokens=4, structured_outputs=so), use_tqdm=False)
        assert e.value.param == "structured_outputs" and e.value.code == "invalid_value"
        assert ref in str(e.value) and "never fetched" in str(e.value)


def test_local_refs_and_lookalikes_still_compile(llm):
    """What is not a reference to fetch: '#...' refs, a property named $ref, data that mentions one."""
    schema = {"$defs": {"n": {"type": "integer", "minimum": 0, "maximum": 9}},
              "type": "object",
              "properties": {"a": {"$ref": "#/$defs/n"}, "$ref": {"type": "string", "const": REMOTE},
                             "b": {"const": {"$ref": REMOTE}}, "c": {"enum": [{"$ref": REMOTE}]}},
              "required": ["a"], "additionalProperties": False}
    so = StructuredOutputsParams(json=schema)
    out = llm.generate(["JSON:"], SamplingParams(max_tokens=64, temperature=0, structured_outputs=so),
                       use_tqdm=False)[0].outputs[0]
    if out.finish_reason == "stop":
        jsonschema.validate(json.loads(out.text), schema)


def _accepts(llm, kind: str, spec: str, text: str) -> bool:
    """Whether the backend's matcher for (kind, spec) takes exactly `text` (then EOS)."""
    structured = llm.engine.structured
    m = structured.backend.compiled(kind, spec).new_matcher()
    ids = structured.tokenizer.encode(text, add_special_tokens=False)
    return all(m.accept_token(t) for t in ids) and m.accept_token(structured.stop_token_ids[0]) and m.is_terminated()


# ECMA-262 (OpenAI's and JSON Schema's regex dialect): \d is [0-9], \w is [A-Za-z0-9_], \s is
# ECMA's WhiteSpace and LineTerminator set (the Zs category, TAB VT FF NBSP ZWNBSP, LF CR LS PS).
ECMA = {"d": set("0123456789"), "w": set("0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ_"),
        "s": set("\t\n\v\f\r \xa0\u1680\u2028\u2029\u202f\u205f\u3000\ufeff") | {chr(c) for c in range(0x2000, 0x200b)}}
PROBES = ["0", "9", "a", "Z", "_", "-", "é", "ß", "\u0661", "\u0967", "\U0001FBF8", "\U0001D7CE", " ", "\t", "\n",
          "\v", "\xa0", "\x85", "\u2003", "\u2028", "\u3000", "\ufeff", "\u200b", "\u180e"]


@pytest.mark.parametrize("cls", "dws")
def test_class_escapes_are_ecma_on_both_backends(llm, cls):
    """\\d \\w \\s and their complements, bare and in brackets, accept what ECMA-262 says on either
    backend (llguidance's own are Unicode: it took '🯸' and '١' for \\d)."""
    up = cls.upper()
    forms = {f"\\{cls}": (False, ""), f"\\{up}": (True, ""), f"[\\{cls}]": (False, ""), f"[^\\{cls}]": (True, ""),
             f"[\\{up}]": (True, ""), f"[^\\{up}]": (False, ""), f"[-\\{cls}]": (False, "-"),
             f"[0\\{up}]": (True, "0")}   # regex: (the complement of the class?, members added)
    for regex, (complement, extra) in forms.items():
        got = {ch for ch in PROBES if _accepts(llm, "regex", regex, ch)}
        want = {ch for ch in PROBES if (ch in ECMA[cls]) != complement or ch in extra}
        assert got == want, (regex, sorted(got ^ want))


PHONE = r"\d{3}-\d{4}"
NOT_PHONES = ["\U0001FBF8\U0001FBF8\U0001FBF8-\U0001FBF8\U0001FBF8\U0001FBF8\U0001FBF8", "١٢٣-٤٥٦٧"]


def _compact(llm, value) -> str:
    """`value` as the backend's compact JSON (xgrammar's has a space after ':' and ',', llguidance's none)."""
    seps = (", ", ": ") if llm.engine.structured.backend_name == "xgrammar" else (",", ":")
    return json.dumps(value, ensure_ascii=False, separators=seps)


def test_regex_and_schema_patterns_are_ecma_on_both_backends(llm):
    def as_json(value) -> str:
        return _compact(llm, value)

    cases = [  # (kind, spec, accepted, refused)
        ("regex", PHONE, ["123-4567"], NOT_PHONES),
        ("regex", r"\w+", ["abc_9"], ["é", "ab\u0661"]),
        ("regex", r"a\sb", ["a b", "a\xa0b", "a\ufeffb", "a\u2028b"], ["a\x85b", "a\u200bb"]),
        ("regex", r"[\d-]+ \\d", ["12-3 \\d"], ["12-3 \\9", "١- \\d"]),
        ("json", json.dumps({"type": "string", "pattern": f"^{PHONE}$"}), [as_json("123-4567")],
         [as_json(s) for s in NOT_PHONES]),
        ("json", json.dumps({"type": "string", "pattern": r"^a\sb$"}), [as_json("a\xa0b"), as_json("a\ufeffb")],
         [as_json("a\x85b"), as_json("a\u200bb")]),
        ("json", json.dumps({"type": "object", "patternProperties": {r"^\s\d$": {"type": "integer"}},
                             "additionalProperties": False}),
         [as_json({"\ufeff1": 1}), as_json({"\xa01": 1})], [as_json({"\x851": 1}), as_json({"\xa0\u0661": 1})]),
        ("grammar", "start: PHONE\nPHONE: /" + PHONE + "/\n", ["123-4567"], NOT_PHONES),
    ]
    for kind, spec, accepted, refused in cases:
        for text in accepted:
            assert _accepts(llm, kind, spec, text), (kind, spec, text)
        for text in refused:
            assert not _accepts(llm, kind, spec, text), (kind, spec, text)


def test_phone_number_end_to_end(llm):
    """The issue's request: guidance answered '🯸🯸🯸-🯸🯸🯸🯸'."""
    so = StructuredOutputsParams(regex=PHONE)
    out = llm.chat([{"role": "user", "content": "Give me a phone number."}],
                   SamplingParams(max_tokens=16, temperature=0, structured_outputs=so), use_tqdm=False)[0].outputs[0]
    assert re.fullmatch(r"[0-9]{3}-[0-9]{4}", out.text, re.ASCII), out.text


def test_ecma_regex_translation_unit():
    """The rewrite the guidance backend applies (core/ecma_regex.py)."""
    from tokenmill.core.ecma_regex import explicit_classes as x
    assert x(r"\d{3}-\d{4}") == "[0-9]{3}-[0-9]{4}"
    assert x(r"\D\w\W") == "[^0-9][0-9A-Za-z_][^0-9A-Za-z_]"
    assert x(r"[\d-]") == r"[0-9\-]" and x(r"[^\d]") == "[^0-9]" and x(r"[a\D]") == "[a[^0-9]]"
    assert x(r"\\d") == r"\\d" and x(r"[\\d]") == r"[\\d]" and x(r"\\\d") == r"\\[0-9]"
    assert x(r"[a-z\d_]") == "[a-z0-9_]" and x(r"[\d-z]") == r"[0-9\-z]" and x(r"[+--]") == r"[+-\-]"
    assert x(r"[[&~]") == r"[\[\&\~]" and x("[]a]") == r"[^\x00-\x{10FFFF}]a]" and x("[^]") == r"[\x00-\x{10FFFF}]"
    assert x(r"\u0041[\x41-\x5A]\p{L}(?:a|b)$") == r"\u0041[\x41-\x5A]\p{L}(?:a|b)$"
    assert x(r"[\s]") == x(r"\s") and x(r"\S").startswith("[^\\t\\n")


def test_compile_cache(llm):
    backend = llm.engine.structured.backend
    a = backend.compiled("regex", "ab+")
    assert backend.compiled("regex", "ab+") is a and backend.compiled("regex", "ab*") is not a


def test_constrained_request_stats(llm):
    before = llm.engine.stats()
    so = StructuredOutputsParams(regex=r"[a-z]{3}\d")
    outs = llm.generate(["a", "b"], SamplingParams(max_tokens=8, temperature=0, structured_outputs=so),
                        use_tqdm=False)
    assert all(re.fullmatch(r"[a-z]{3}\d", o.outputs[0].text) for o in outs)
    llm.generate(["c"], SamplingParams(max_tokens=2, temperature=0), use_tqdm=False)   # not counted
    after = llm.engine.stats()
    assert after.num_constrained_requests == before.num_constrained_requests + 2
    assert after.grammar_compile_seconds > before.grammar_compile_seconds


def test_backend_choice_and_unknown_backend():
    from tokenmill.core.config import EngineConfig
    from tokenmill.core.structured_outputs import StructuredOutputs, resolve_backend_name
    from tokenmill.entrypoints.engine_args import add_engine_args, engine_kwargs
    assert resolve_backend_name("auto") == "xgrammar"
    assert resolve_backend_name("guidance") == "guidance"
    assert EngineConfig.from_kwargs().model.structured_outputs_backend == "auto"
    config = EngineConfig.from_kwargs(structured_outputs_backend="guidance")
    assert config.model.structured_outputs_backend == "guidance"
    for make in (lambda: EngineConfig.from_kwargs(structured_outputs_backend="nope"),
                 lambda: StructuredOutputs(None, 0, (), backend="nope")):
        with pytest.raises(ValueError, match="structured_outputs_backend") as e:
            make()
        assert "guidance" in str(e.value) and "xgrammar" in str(e.value) and "'nope'" in str(e.value)
    import argparse
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert engine_kwargs(parser.parse_args([]))["structured_outputs_backend"] == "auto"
    args = parser.parse_args(["--structured-outputs-backend", "guidance"])
    assert engine_kwargs(args)["structured_outputs_backend"] == "guidance"


# ==================================================================== the server
MODEL = "smol"
SERVER_ARGS = ["--device", "cpu", "--served-model-name", MODEL, "--max-model-len", "512",
               "--max-num-seqs", "8", "--num-threads", "1", "--kv-cache-memory", str(64 * 1024 * 1024),
               "--disable-access-log"]
MESSAGES = [{"role": "user", "content": "Give me a person as JSON."}]
SMALL = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 10},
                                          "age": {"type": "integer", "minimum": 0, "maximum": 120}},
         "required": ["name", "age"], "additionalProperties": False}


class Person(BaseModel):
    name: str
    age: int


@pytest.fixture(scope="module")
def client(server):
    if os.environ.get("TOKENMILL_TEST_FAKE_ENGINE") == "1":
        pytest.skip("the fake engine does not constrain its output")
    return openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=120)


def test_chat_response_format_json_schema(client):
    out = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=64, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": SMALL, "strict": True}})
    assert out.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(out.choices[0].message.content), SMALL)
    out = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=96, temperature=0,
                                         response_format={"type": "json_object"})
    if out.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(out.choices[0].message.content), dict)


def test_fifty_concurrent_json_schema_requests_all_validate(client):
    from concurrent.futures import ThreadPoolExecutor

    def ask(i):
        out = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": f"Describe person number {i} as JSON."}],
            max_tokens=160, temperature=0.8, seed=i,
            response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}})
        return out.choices[0]

    with ThreadPoolExecutor(16) as pool:
        choices = list(pool.map(ask, range(50)))
    for choice in choices:
        assert choice.finish_reason == "stop", choice.message.content
        jsonschema.validate(json.loads(choice.message.content), PERSON)   # nested, array, enum, range


def test_chat_parse_pydantic(client):
    parse = getattr(client.chat.completions, "parse", None) or client.beta.chat.completions.parse
    out = parse(model=MODEL, messages=MESSAGES, max_tokens=64, temperature=0, response_format=Person)
    person = out.choices[0].message.parsed
    assert isinstance(person, Person) and isinstance(person.age, int)


def test_structured_outputs_body_field(client):
    out = client.completions.create(model=MODEL, prompt="The answer is", max_tokens=16, temperature=0,
                                    extra_body={"structured_outputs": {"choice": ["yes", "no"]}})
    assert out.choices[0].text in ("yes", "no")
    out = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=16, temperature=0,
                                         extra_body={"structured_outputs": {"regex": r"\d{3}"}})
    assert re.fullmatch(r"\d{3}", out.choices[0].message.content)


def test_bad_structured_output_is_400(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            model=MODEL, messages=MESSAGES, max_tokens=8,
            response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "no-such-type"}}})
    assert e.value.status_code == 400 and e.value.body["param"] == "response_format"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=8,
                                       response_format={"type": "xml"})
    assert e.value.body["param"] == "response_format"
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="x", max_tokens=8,
                                  extra_body={"structured_outputs": {"regex": "(unclosed"}})
    assert e.value.body["param"] == "structured_outputs" and "regex" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="x", max_tokens=8,
                                  extra_body={"structured_outputs": {"regex": "a", "choice": ["b"]}})
    assert e.value.body["param"] == "structured_outputs"


def test_remote_ref_is_400_naming_the_param(client):
    """However the schema arrives, a $ref outside it is a 400 naming the parameter it came in (issue 32)."""
    remote = {"type": "object", "properties": {"a": {"$ref": REMOTE}}}

    def refused(call, param):
        with pytest.raises(openai.BadRequestError) as e:
            call()
        assert e.value.status_code == 400 and e.value.body["param"] == param, e.value.body
        assert "$ref" in e.value.body["message"] and REMOTE in e.value.body["message"], e.value.body

    refused(lambda: client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=8,
        response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": remote, "strict": True}}),
        "response_format")
    refused(lambda: client.completions.create(model=MODEL, prompt="x", max_tokens=8,
                                              extra_body={"structured_outputs": {"json": {"$ref": REMOTE}}}),
            "structured_outputs")
    refused(lambda: client.responses.create(
        model=MODEL, input="x", max_output_tokens=8,
        text={"format": {"type": "json_schema", "name": "x", "schema": remote, "strict": True}}), "text.format")
    tools = [{"type": "function", "function": {"name": "f", "parameters": remote, "strict": True}}]
    for choice in ("required", {"type": "function", "function": {"name": "f"}}):
        refused(lambda choice=choice: client.chat.completions.create(
            model=MODEL, messages=MESSAGES, max_tokens=8, tools=tools, tool_choice=choice), "tools")


def test_structured_output_metrics(client, server):
    import httpx
    client.completions.create(model=MODEL, prompt="The answer is", max_tokens=8, temperature=0,
                              extra_body={"structured_outputs": {"choice": ["yes", "no"]}})
    text = httpx.get(server.url + "/metrics", timeout=30).text
    values = {}
    for line in text.splitlines():
        m = re.match(r'(tokenmill:(?:structured_output_requests|grammar_compile_seconds)_total)\{[^}]*\} (\S+)', line)
        if m:
            values[m.group(1)] = float(m.group(2))
    assert values["tokenmill:structured_output_requests_total"] >= 1, text
    assert values["tokenmill:grammar_compile_seconds_total"] > 0, text
