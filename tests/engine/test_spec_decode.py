"""Speculative decoding (n-gram): greedy output identical with and without it, the sampled
distribution unchanged at temperature 1 (chi-square), drafts under structured outputs, preemption
and prefix caching, the config's errors, and the counters."""
from __future__ import annotations

import math
import re
from collections import Counter

import pytest

from tokenmill.core.config import EngineConfig, SpeculativeConfig
from tokenmill.core.sampling_params import SamplingParams, StructuredOutputsParams
from tokenmill.core.spec_decode import NgramProposer

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1,
         "disable_by_batch_size": None}
KW = dict(max_model_len=512, kv_cache_memory=32 << 20, dtype="float32", seed=0)

CODE = """def add(a, b):
    return a + b


def sub(a, b):
    return a - b


def mul(a, b):
    return a * b
"""


def _prompts(n: int) -> list[str]:
    """Prompts whose answers repeat their text (what n-gram drafting is for), and some that do not."""
    base = [f"Repeat this code exactly:\n{CODE}\nHere it is again:\n",
            "one two three four five six seven eight nine ten one two three four five six",
            "The quick brown fox jumps over the lazy dog. The quick brown fox jumps over the lazy",
            "Once upon a time"]
    return [base[i % len(base)] + (" " * (i // len(base))) for i in range(n)]


@pytest.fixture(scope="module")
def plain():
    from tokenmill import LLM
    return LLM(**KW)


@pytest.fixture(scope="module")
def spec():
    from tokenmill import LLM
    return LLM(**KW, speculative_config=NGRAM)


def test_ngram_proposer():
    p = NgramProposer(min_n=1, max_n=3)
    assert p.propose([1, 2, 3, 9, 1, 2, 3], 2) == [9, 1]              # the longest suffix that recurs
    assert p.propose([5, 1, 2, 7, 7, 1, 2], 3) == [7, 7, 1]
    assert p.propose([1, 2, 3, 4], 3) == []                             # nothing recurs
    assert p.propose([4, 4, 4, 4], 2) == [4]                            # latest earlier occurrence
    assert p.propose([1, 2, 1, 2], 0) == []
    # Token ids whose bytes could match across 4-byte boundaries are still matched by whole ids.
    assert p.propose([256, 1, 65536, 1, 256], 2) == [1, 65536]
    assert NgramProposer(min_n=2, max_n=2).propose([3, 1, 3, 2, 3], 2) == []


def test_greedy_output_identical_on_32_prompts(plain, spec):
    params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    prompts = _prompts(32)
    ref = plain.generate(prompts, params, use_tqdm=False)
    before = spec.engine.stats()
    got = spec.generate(prompts, params, use_tqdm=False)
    for a, b in zip(ref, got):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert a.outputs[0].text == b.outputs[0].text
    stats = spec.engine.stats()
    drafts = stats.spec_num_draft_tokens - before.spec_num_draft_tokens
    accepted = stats.spec_num_accepted_tokens - before.spec_num_accepted_tokens
    assert drafts > 100 and accepted > drafts // 4        # speculation ran, and paid off on these prompts
    assert len(stats.spec_accepted_per_position) == 4
    assert stats.spec_accepted_per_position[0] >= stats.spec_accepted_per_position[3]


def test_sampled_distribution_unchanged_at_temperature_1():
    """20,000 samples of the token sampled at the first verification step (the second output token,
    given the most frequent first one) against the model's own distribution there: chi-square."""
    from tokenmill import LLM
    # float32: in bf16 the verification chunk and the reference prefill round differently (a few %
    # on these probabilities), which is numerics, not sampling.
    # 512 MiB of KV: 512 sequences of one own block each run at once (KW's 32 MiB held ~40).
    spec = LLM(**{**KW, "kv_cache_memory": 512 << 20}, speculative_config=dict(NGRAM, num_speculative_tokens=1),
               max_num_seqs=512)
    engine = spec.engine
    text = "one two three four five six " * 8
    # 2 full blocks + 1 token: every sequence after the first finds the 2 blocks in the prefix cache.
    prompt = engine.tokenize_prompt(text)[1][:33]
    params = SamplingParams(temperature=1.0, max_tokens=3, ignore_eos=True, n=200, detokenize=False)
    outs = spec.generate([{"prompt_token_ids": prompt}] * 100, params, use_tqdm=False)
    pairs = [tuple(c.token_ids[:2]) for o in outs for c in o.outputs]
    assert len(pairs) == 20000
    assert engine.stats().spec_num_drafts > 15000    # nearly every second token was verified
    first = Counter(p[0] for p in pairs).most_common(1)[0][0]
    seconds = Counter(p[1] for p in pairs if p[0] == first)
    n = sum(seconds.values())
    assert n > 2000, n
    exact = spec.generate([{"prompt_token_ids": prompt + [first]}],
                          SamplingParams(temperature=0.0, max_tokens=1, logprobs=20), use_tqdm=False)
    top = exact[0].outputs[0].logprobs[0]                       # the raw model distribution's top 20
    probs = {t: math.exp(lp) for t, lp in top.items()}
    # Categories: tokens expected at least 5 times, the rest pooled.
    cats = [t for t, p in probs.items() if p * n >= 5]
    expected = [probs[t] * n for t in cats]
    observed = [seconds.get(t, 0) for t in cats]
    rest_p = 1.0 - sum(probs[t] for t in cats)
    if rest_p * n >= 5:
        expected.append(rest_p * n)
        observed.append(n - sum(observed))
    stat = sum((o - e) ** 2 / e for o, e in zip(observed, expected))
    dof = len(expected) - 1
    assert dof >= 2
    # The 0.999 quantile of chi-square(dof) (Wilson-Hilferty): fails by chance once in 1000 runs.
    z = 3.09
    limit = dof * (1 - 2 / (9 * dof) + z * math.sqrt(2 / (9 * dof))) ** 3
    assert stat < limit, (stat, limit, observed, expected)


def test_structured_outputs_with_drafts(plain, spec):
    so = StructuredOutputsParams(regex=r"(one two three four five six ){2,4}done")
    params = SamplingParams(temperature=0.0, max_tokens=60, structured_outputs=so)
    prompt = ["Count: one two three four five six one two three four five six"]
    before = spec.engine.stats().spec_num_accepted_tokens
    [a] = plain.generate(prompt, params, use_tqdm=False)
    [b] = spec.generate(prompt, params, use_tqdm=False)
    assert re.fullmatch(so.regex, b.outputs[0].text)
    assert a.outputs[0].token_ids == b.outputs[0].token_ids
    assert spec.engine.stats().spec_num_accepted_tokens > before


def test_preemption_and_prefix_cache_keep_greedy_output():
    """A KV pool too small for the batch: preempted sequences recompute, drafts and all; the prefix
    cache never serves a block that held rejected drafts."""
    from tokenmill import LLM
    params = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
    prompts = _prompts(12)
    small = dict(KW, kv_cache_memory=None, num_gpu_blocks_override=24, block_size=16)
    ref = LLM(**small).generate(prompts, params, use_tqdm=False)
    llm = LLM(**small, speculative_config=NGRAM)
    got = llm.generate(prompts, params, use_tqdm=False)
    again = llm.generate(prompts, params, use_tqdm=False)        # prefix-cache hits this time
    assert llm.engine.stats().num_preemptions > 0
    for a, b, c in zip(ref, got, again):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids == c.outputs[0].token_ids
    llm.engine.scheduler.block_manager.check_invariants([])


def test_no_drafts_beyond_disable_by_batch_size():
    from tokenmill import LLM
    llm = LLM(**KW, speculative_config=dict(NGRAM, disable_by_batch_size=2))
    llm.generate(_prompts(8), SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True), use_tqdm=False)
    assert llm.engine.stats().spec_num_drafts == 0
    llm.generate(_prompts(1), SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True), use_tqdm=False)
    assert llm.engine.stats().spec_num_drafts > 0


def test_speculative_config_errors():
    assert EngineConfig.from_kwargs(speculative_config='{"method": "ngram"}').speculative.method == "ngram"
    assert EngineConfig.from_kwargs().speculative.method is None
    for bad, match in [("{", "not valid JSON"), ({"method": "eagle9"}, "method must be"),
                       ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
                       ({"method": "ngram", "prompt_lookup_min": 5, "prompt_lookup_max": 2}, "prompt_lookup_min"),
                       ({"method": "ngram", "bogus": 1}, "unknown keys"), ([1], "must be an object")]:
        with pytest.raises(ValueError, match=match) as e:
            EngineConfig.from_kwargs(speculative_config=bad)
        assert "speculative_config" in str(e.value)
    assert SpeculativeConfig.parse({"method": "ngram", "disable_by_batch_size": None}).disable_by_batch_size is None


def test_spec_metrics_exposed():
    from tokenmill.entrypoints.openai.metrics import ServerMetrics
    m = ServerMetrics("m")
    m.update_stats({"spec_num_drafts": 10, "spec_num_draft_tokens": 30, "spec_num_accepted_tokens": 12,
                    "spec_accepted_per_position": [7, 4, 1]})
    m.update_stats({"spec_num_drafts": 12, "spec_num_draft_tokens": 36, "spec_num_accepted_tokens": 14,
                    "spec_accepted_per_position": [9, 4, 1]})
    text = m.render().decode()
    assert 'tokenmill:spec_decode_num_draft_tokens_total{model_name="m"} 36.0' in text
    assert 'tokenmill:spec_decode_num_accepted_tokens_total{model_name="m"} 14.0' in text
    assert 'tokenmill:spec_decode_num_accepted_tokens_per_pos_total{model_name="m",position="0"} 9.0' in text
