"""End to end on the real default model: token-exact agreement with transformers, preemption,
prefix caching, stop conditions, and the offline API's contract."""
from __future__ import annotations

import os

import pytest
import torch

from tokenmill import LLM, SamplingParams

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a land far away, there lived a",
    "1, 2, 3, 4,",
    "The three primary colors are",
    "Translate to French: I like cheese.",
    "Q: What is the boiling point of water at sea level?\nA:",
    "Write a haiku about the sea:\n",
]
MAX_TOKENS = 32


@pytest.fixture(scope="module")
def llm():
    return LLM(dtype="float32", max_model_len=2048, kv_cache_memory=256 << 20)


@pytest.fixture(scope="module")
def hf_greedy(llm):
    """transformers float32 greedy continuations of PROMPTS, from the same GGUF."""
    from transformers import AutoModelForCausalLM

    path = llm.engine.bundle.source.path
    model = AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                                 dtype=torch.float32).eval()
    tok = llm.get_tokenizer()
    results = []
    with torch.inference_mode():
        for p in PROMPTS:
            ids = tok.encode(p)
            out = model.generate(torch.tensor([ids]), max_new_tokens=MAX_TOKENS, do_sample=False,
                                 pad_token_id=tok.eos_token_id)
            results.append(out[0, len(ids):].tolist())
    return results


def _strip_after_eos(tokens, eos):
    for i, t in enumerate(tokens):
        if t in eos:
            return tokens[:i + 1]
    return tokens


def test_greedy_matches_transformers_in_one_batch(llm, hf_greedy):
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=MAX_TOKENS), use_tqdm=False)
    eos = set(llm.engine.eos_token_ids)
    for out, ref in zip(outs, hf_greedy):
        assert out.outputs[0].token_ids == _strip_after_eos(ref, eos), out.prompt


def test_preemption_keeps_greedy_outputs(hf_greedy):
    # 12 blocks of 16 tokens cannot hold 8 sequences of ~45 tokens: preemption must happen.
    small = LLM(dtype="float32", max_model_len=2048, num_gpu_blocks_override=12)
    outs = small.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True),
                          use_tqdm=False)
    assert small.engine.scheduler.num_preemptions > 0
    eos = set(small.engine.eos_token_ids)
    for out, ref in zip(outs, hf_greedy):
        got = out.outputs[0].token_ids
        assert _strip_after_eos(got, eos) == _strip_after_eos(ref, eos)
    assert small.engine.scheduler.block_manager.num_used_blocks == 0


def test_prefix_caching_computes_fewer_tokens_and_same_output(llm):
    tok = llm.get_tokenizer()
    prefix = tok.encode(" ".join(f"item{i}" for i in range(400)))[:512]
    assert len(prefix) == 512
    params = SamplingParams(temperature=0, max_tokens=16)
    first = llm.generate({"prompt_token_ids": prefix + tok.encode(" and then")}, params, use_tqdm=False)[0]
    before = llm.engine.stats().prompt_tokens
    second = llm.generate({"prompt_token_ids": prefix + tok.encode(" and then")}, params, use_tqdm=False)[0]
    computed = llm.engine.stats().prompt_tokens - before
    assert second.num_cached_tokens >= 512
    assert computed < len(second.prompt_token_ids) - 500
    assert second.outputs[0].token_ids == first.outputs[0].token_ids
    no_cache = LLM(dtype="float32", max_model_len=2048, kv_cache_memory=64 << 20, enable_prefix_caching=False)
    third = no_cache.generate({"prompt_token_ids": prefix + tok.encode(" and then")}, params, use_tqdm=False)[0]
    assert third.num_cached_tokens == 0
    assert third.outputs[0].token_ids == first.outputs[0].token_ids


def test_chunked_prefill_matches_unchunked(llm):
    long_prompt = " ".join(["The quick brown fox jumps over the lazy dog."] * 40)
    params = SamplingParams(temperature=0, max_tokens=12)
    chunked = LLM(dtype="float32", max_model_len=2048, kv_cache_memory=64 << 20, max_num_batched_tokens=64,
                  long_prefill_token_threshold=48, enable_prefix_caching=False)
    a = chunked.generate([long_prompt, "Hello"], params, use_tqdm=False)
    b = llm.generate([long_prompt, "Hello"], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in a] == [o.outputs[0].token_ids for o in b]


def test_stop_conditions(llm):
    base = llm.generate("1, 2, 3, 4,", SamplingParams(temperature=0, max_tokens=20), use_tqdm=False)[0].outputs[0]
    assert base.finish_reason in ("length", "stop")
    # stop string removed from the text unless asked to keep it
    stop = base.text.strip().split(" ")[2] if len(base.text.split()) > 3 else base.text[:3]
    out = llm.generate("1, 2, 3, 4,", SamplingParams(temperature=0, max_tokens=20, stop=[stop]),
                       use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop and stop not in out.text
    kept = llm.generate("1, 2, 3, 4,", SamplingParams(temperature=0, max_tokens=20, stop=[stop],
                                                      include_stop_str_in_output=True), use_tqdm=False)[0].outputs[0]
    assert kept.text.endswith(stop)
    # stop token kept in the output ids
    tid = base.token_ids[3]
    out = llm.generate("1, 2, 3, 4,", SamplingParams(temperature=0, max_tokens=20, stop_token_ids=[tid]),
                       use_tqdm=False)[0].outputs[0]
    assert out.token_ids[-1] == tid and out.stop_reason == tid and tid not in out.token_ids[:-1]
    # max_tokens
    out = llm.generate("1, 2, 3, 4,", SamplingParams(temperature=0, max_tokens=5, ignore_eos=True),
                       use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == 5 and out.finish_reason == "length"


def test_eos_stops_unless_ignored(llm):
    msgs = [[{"role": "user", "content": "Say hi"}]]
    out = llm.chat(msgs, SamplingParams(temperature=0, max_tokens=200), use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop" and out.token_ids[-1] in llm.engine.eos_token_ids
    out = llm.chat(msgs, SamplingParams(temperature=0, max_tokens=60, ignore_eos=True), use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == 60 and out.finish_reason == "length"


def test_max_model_len_caps_generation():
    small = LLM(dtype="float32", max_model_len=40, kv_cache_memory=16 << 20)
    out = small.generate({"prompt_token_ids": list(range(1000, 1030))},
                         SamplingParams(temperature=0, max_tokens=100, ignore_eos=True), use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 10 and out.outputs[0].finish_reason == "length"
    with pytest.raises(ValueError, match="maximum context length"):
        small.generate({"prompt_token_ids": list(range(1000, 1045))}, use_tqdm=False)


def test_seed_gives_same_output_whatever_the_batch(llm):
    params = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=16, seed=1234)
    alone = llm.generate("Tell me a story", params, use_tqdm=False)[0].outputs[0].token_ids
    others = SamplingParams(temperature=1.0, max_tokens=16)
    mixed = llm.generate(["Hello there", "Tell me a story", "Why is the sky blue?"], [others, params, others],
                         use_tqdm=False)
    assert mixed[1].outputs[0].token_ids == alone


def test_outputs_keep_input_order_and_carry_timings(llm):
    prompts = [{"prompt_token_ids": list(range(1000, 1000 + n))} for n in (40, 3, 17, 90)]
    outs = llm.generate(prompts, [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in (4, 9, 2, 6)],
                        use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == [4, 9, 2, 6]
    assert [len(o.prompt_token_ids) for o in outs] == [40, 3, 17, 90]
    for o in outs:
        m = o.metrics
        assert m.queue_time is not None and m.queue_time >= 0
        assert m.time_to_first_token is not None and m.time_to_first_token > 0
        assert m.decode_time is not None and m.decode_time >= 0


def test_n_logprobs_and_prompt_logprobs(llm):
    params = SamplingParams(temperature=0.8, n=3, max_tokens=8, logprobs=2, prompt_logprobs=1, seed=7)
    out = llm.generate("The sky is", params, use_tqdm=False)[0]
    assert len(out.outputs) == 3
    for c in out.outputs:
        assert len(c.logprobs) == len(c.token_ids)
        for tok, entry in zip(c.token_ids, c.logprobs):
            assert tok in entry and 2 <= len(entry) <= 3
            assert all(v <= 0 for v in entry.values())
        assert c.cumulative_logprob == pytest.approx(sum(e[t] for t, e in zip(c.token_ids, c.logprobs)), abs=1e-4)
    assert out.prompt_logprobs[0] is None
    assert len(out.prompt_logprobs) == len(out.prompt_token_ids)
    for tok, entry in zip(out.prompt_token_ids[1:], out.prompt_logprobs[1:]):
        assert tok in entry


def test_bad_parameters_raise_value_error_naming_them(llm):
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1)
    with pytest.raises(ValueError, match="prompt"):
        llm.generate({"prompt_token_ids": [10**9]}, use_tqdm=False)
    with pytest.raises(ValueError, match="sampling_params"):
        llm.generate(["a", "b"], [SamplingParams()], use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()


def test_shared_prefix_batch_same_with_and_without_prefix_caching(llm):
    """Many requests on one 256-token prefix: later ones wait a step for the prefix to be cached,
    then decode with cascade attention; tokens must equal the run without any caching."""
    prefix = list(range(2000, 2256))
    prompts = [{"prompt_token_ids": prefix + [3000 + i, 3100 + i]} for i in range(6)]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    cached = llm.generate(prompts, params, use_tqdm=False)
    assert sum(o.num_cached_tokens for o in cached) >= 5 * 256
    plain = LLM(dtype="float32", max_model_len=2048, kv_cache_memory=64 << 20, enable_prefix_caching=False)
    reference = plain.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in cached] == [o.outputs[0].token_ids for o in reference]


def test_bfloat16_weights_run_and_agree_on_an_easy_prompt():
    bf16 = LLM(dtype="bfloat16", max_model_len=512, kv_cache_memory=32 << 20)
    out = bf16.generate("The capital of France is", SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)
    assert "Paris" in out[0].outputs[0].text
