"""Structured outputs (issue 11): grammar-constrained decoding with the built-in backends.

Offline through `LLM` on the default model, once per grammar backend (xgrammar, guidance) (constrained and free rows in one batch, greedy and
random), and through `tokenmill serve` with the official openai SDK (response_format,
`parse(response_format=PydanticModel)`, vLLM's structured_outputs body field, 400s).
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
    assert EngineConfig.from_kwargs(structured_outputs_backend="guidance").model.structured_outputs_backend == "guidance"
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
