"""Grammar compilation happens off the engine step: a request waits for its grammar while the
others keep stepping; a grammar refused after the request was accepted ends that request alone with
the backend's error; with a reasoning parser the constraint applies to the answer after the reasoning."""
from __future__ import annotations

import re
import threading

import pytest

from tokenmill.core.errors import RequestError
from tokenmill.core.sampling_params import SamplingParams, StructuredOutputsParams


class GatedBackend:
    """Wraps the engine's real backend; `compile` blocks until the test opens the gate."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.supported_kinds = inner.supported_kinds
        self.gate = threading.Event()
        self.started = threading.Event()
        self.refuse = False

    def cached(self, kind, spec):
        return None

    def compiled(self, kind, spec):
        self.started.set()
        assert self.gate.wait(30), "the test never opened the gate"
        if self.refuse:
            raise RequestError("invalid regex in structured_outputs: gated refusal", "structured_outputs",
                               "invalid_value")
        return self.inner.compile(kind, spec)


@pytest.fixture(scope="module")
def llm():
    from tokenmill import LLM
    llm = LLM(max_model_len=256, kv_cache_memory=32 << 20)
    yield llm
    del llm


@pytest.fixture
def gated(llm):
    so = llm.engine.structured
    real = so.backend
    so._backend = GatedBackend(real)
    yield so._backend
    so._backend.gate.set()
    so._backend = real


def _drain(engine, deltas_by_id):
    for d in engine.step():
        deltas_by_id.setdefault(d.request_id, []).append(d)


def test_free_requests_step_while_a_grammar_compiles(llm, gated):
    engine = llm.engine
    free = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    constrained = SamplingParams(temperature=0.0, max_tokens=16,
                                 structured_outputs=StructuredOutputsParams(regex=r"\d{3}-\d{4}"))
    engine.add_request("free", "The capital of France is", free)
    engine.add_request("phone", "Call me at", constrained)
    assert gated.started.wait(10)
    seen: dict = {}
    while "free" in engine.requests:
        _drain(engine, seen)
    # The free request finished while the constrained one was still waiting for its grammar.
    assert sum(len(d.outputs[0].token_ids) for d in seen["free"]) == 6
    assert "phone" not in seen and "phone" in engine.requests
    assert engine.stats().num_waiting == 1
    gated.gate.set()
    while engine.has_unfinished_requests():
        _drain(engine, seen)
    text = "".join(o.text for d in seen["phone"] for o in d.outputs)
    assert re.fullmatch(r"\d{3}-\d{4}", text), text
    assert seen["phone"][-1].finished


def test_grammar_refused_after_acceptance_ends_only_that_request(llm, gated):
    engine = llm.engine
    gated.refuse = True
    engine.add_request("ok", "Hello", SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    engine.add_request("bad", "Hello", SamplingParams(
        max_tokens=8, structured_outputs=StructuredOutputsParams(regex="a+")))
    gated.gate.set()
    seen: dict = {}
    while engine.has_unfinished_requests():
        _drain(engine, seen)
    [refusal] = seen["bad"]
    assert refusal.finished and not refusal.outputs
    assert isinstance(refusal.error, RequestError) and refusal.error.param == "structured_outputs"
    assert sum(len(d.outputs[0].token_ids) for d in seen["ok"]) == 4


def test_offline_generate_raises_a_late_refusal(llm, gated):
    gated.refuse = True
    gated.gate.set()
    with pytest.raises(ValueError, match="gated refusal"):
        llm.generate(["Hi"], SamplingParams(max_tokens=4, structured_outputs=StructuredOutputsParams(regex="b+")),
                     use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()


def test_abort_while_compiling(llm, gated):
    engine = llm.engine
    engine.add_request("x", "Hi", SamplingParams(max_tokens=4, structured_outputs=StructuredOutputsParams(regex="c+")))
    engine.abort_request("x")
    assert not engine.has_unfinished_requests()
    gated.gate.set()
    assert engine.step() == []


class AfterChars:
    """A reasoning parser stand-in: the reasoning is the first 12 characters of the output."""

    def reasoning_ended(self, prompt_text, output_text):
        return len(output_text) >= 12


def test_constraint_applies_after_the_reasoning(llm):
    engine = llm.engine
    engine.reasoning_parser = AfterChars()
    try:
        params = SamplingParams(temperature=0.0, max_tokens=40,
                                structured_outputs=StructuredOutputsParams(choice=["yes", "no"]))
        [out] = llm.generate(["Is the sky blue? Think first, then answer."], params, use_tqdm=False)
    finally:
        engine.reasoning_parser = None
    text = out.outputs[0].text
    assert len(text) > 12 and (text.endswith("yes") or text.endswith("no")), text
    # Without the reasoning parser the same request is exactly one of the choices.
    [plain] = llm.generate(["Is the sky blue? Think first, then answer."], params, use_tqdm=False)
    assert plain.outputs[0].text in ("yes", "no")


def test_think_parsers_say_when_reasoning_ended():
    from tokenmill.plugins import discovery
    qwen3 = discovery.reasoning_parsers()["qwen3"](None)
    r1 = discovery.reasoning_parsers()["deepseek_r1"](None)
    # No <think> anywhere: Qwen3 answers at once, R1 reasons until </think>.
    assert qwen3.reasoning_ended("<|user|>hi<|assistant|>", "")
    assert not r1.reasoning_ended("<|user|>hi<|assistant|>", "")
    assert r1.reasoning_ended("<|user|>hi<|assistant|>", "hmm</think>")
    # The template opened <think>: both wait for </think>.
    for parser in (qwen3, r1):
        assert not parser.reasoning_ended("assistant\n<think>\n", "let me see")
        assert parser.reasoning_ended("assistant\n<think>\n", "let me see</think>")
    # A closed think block earlier in the conversation does not hold the constraint back.
    assert qwen3.reasoning_ended("<think>old</think>answer<|user|>again<|assistant|>", "")
    assert not qwen3.reasoning_ended("prompt", "<think>still")


def test_llm_refuses_an_unknown_reasoning_parser():
    from tokenmill import LLM
    with pytest.raises(ValueError, match="reasoning_parser"):
        LLM(max_model_len=128, kv_cache_memory=8 << 20, reasoning_parser="nope")


def test_served_with_a_reasoning_parser_constrained_answers_still_parse():
    """`--reasoning-parser qwen3` on a model that answers without <think>: response_format and a forced
    tool_choice constrain the answer from its first token, and the reasoning parser finds no reasoning."""
    import json
    import os

    import jsonschema
    import openai

    from tokenmill.entrypoints.openai.testing import ServerProcess
    if os.environ.get("TOKENMILL_TEST_FAKE_ENGINE") == "1":
        pytest.skip("the fake engine does not constrain its output")
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                               "population": {"type": "integer", "minimum": 0}},
              "required": ["city", "population"], "additionalProperties": False}
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": schema}}]
    args = ["--device", "cpu", "--max-model-len", "512", "--kv-cache-memory", str(32 << 20), "--num-threads", "1",
            "--disable-access-log", "--reasoning-parser", "qwen3"]
    messages = [{"role": "user", "content": "Name a big city and its population."}]
    with ServerProcess(args) as srv:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0, timeout=120)
        model = client.models.list().data[0].id
        r = client.chat.completions.create(
            model=model, messages=messages, max_tokens=60, temperature=0,
            response_format={"type": "json_schema", "json_schema": {"name": "city", "schema": schema}})
        message = r.choices[0].message
        jsonschema.validate(json.loads(message.content), schema)
        assert not (message.model_extra or {}).get("reasoning_content")
        calls, finish = {}, None
        for chunk in client.chat.completions.create(model=model, messages=messages, max_tokens=80, temperature=0,
                                                    tools=tools, tool_choice="required", stream=True):
            for ch in chunk.choices:
                finish = ch.finish_reason or finish
                for tc in ch.delta.tool_calls or []:
                    entry = calls.setdefault(tc.index, {"name": "", "arguments": ""})
                    entry["name"] += tc.function.name or ""
                    entry["arguments"] += tc.function.arguments or ""
        # "required" allows several calls: a model that starts another one may run out of tokens
        # inside it (what greedy bf16 SmolLM2 does here); every call before that one is whole.
        assert calls and (finish == "tool_calls" or (finish == "length" and len(calls) > 1)), (finish, calls)
        whole = list(calls.values()) if finish == "tool_calls" else list(calls.values())[:-1]
        for entry in whole:
            assert entry["name"] == "get_weather"
            jsonschema.validate(json.loads(entry["arguments"]), schema)
