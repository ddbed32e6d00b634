"""Speculative decoding with a draft model, on tiny random checkpoints sharing one vocabulary:
greedy output identical with and without it (the target as its own draft: every draft accepted;
another model: some rejected), the rejection rule's distribution, the sampled distribution of
verified tokens unchanged at temperature 1 (chi-square), the draft's KV rolled back and its blocks
accounted and freed (finish, abort, preemption), prefix caching and chunked prefill, structured
outputs, and the config's errors."""
from __future__ import annotations

import math
import re
from collections import Counter

import pytest
import torch

from model_helpers import save_tiny_checkpoint, tiny_tokenizer

from tokenmill import LLM, SamplingParams
from tokenmill.core.sampling.rejection import verify
from tokenmill.core.sampling.sampler import Sampler, SamplingRow
from tokenmill.core.sampling_params import StructuredOutputsParams

VOCAB = 128
# One thread: these models are tiny, and on a shared 2-core machine a second thread mostly waits.
KW = dict(dtype="float32", kv_cache_memory=16 << 20, generation_config="none", seed=0, num_threads=1)


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("spec-draft")
    # initializer_range 0.3: peaked distributions (a few likely tokens), as a trained model's are.
    paths = {name: root / name for name in ("target", "draft", "near", "other_vocab")}
    target = save_tiny_checkpoint("llama", str(paths["target"]), seed=0, vocab_size=VOCAB, initializer_range=0.3)
    # "near": the target with noise on every weight, a draft that is right about half the time.
    with torch.no_grad():
        for param in target.parameters():
            param.add_(torch.randn_like(param) * 0.1 * param.std())
    target.save_pretrained(str(paths["near"]))
    tiny_tokenizer(VOCAB).save_pretrained(str(paths["near"]))
    save_tiny_checkpoint("llama", str(paths["draft"]), seed=1, vocab_size=VOCAB, initializer_range=0.3,
                         num_hidden_layers=1, hidden_size=32, intermediate_size=64)
    save_tiny_checkpoint("llama", str(paths["other_vocab"]), seed=2, vocab_size=96)
    return {k: str(v) for k, v in paths.items()}


def _spec(draft: str, k: int = 3, **extra) -> dict:
    return dict({"method": "draft_model", "model": draft, "num_speculative_tokens": k,
                 "disable_by_batch_size": None}, **extra)


def _prompts(n: int, seed: int = 1) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    lengths = [3, 17, 9, 33, 1, 24, 40, 12]
    return [{"prompt_token_ids": torch.randint(10, VOCAB, (lengths[i % 8] + i // 8,), generator=g).tolist()}
            for i in range(n)]


@pytest.fixture(scope="module")
def reference(ckpts):
    return LLM(ckpts["target"], **KW)


def _counts(llm):
    s = llm.engine.stats()
    return s.spec_num_drafts, s.spec_num_draft_tokens, s.spec_num_accepted_tokens, s.spec_accepted_per_position


@pytest.mark.parametrize("draft", ["target", "draft"])
def test_greedy_output_identical_on_32_prompts(ckpts, reference, draft):
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    prompts = _prompts(32)
    ref = reference.generate(prompts, params, use_tqdm=False)
    llm = LLM(ckpts["target"], **KW, speculative_config=_spec(ckpts[draft]))
    got = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in ref]
    drafts, proposed, accepted, per_position = _counts(llm)
    assert drafts > 100 and len(per_position) == 3
    if draft == "target":      # its own draft: every draft is what the target picks
        assert accepted == proposed
    else:
        assert 0 < accepted < proposed
    assert per_position[0] >= per_position[1] >= per_position[2]
    spec_draft = llm.engine.speculator.draft
    assert not spec_draft.shadows and spec_draft.block_manager.num_used_blocks == 0


def test_rejection_rule_keeps_the_target_distribution():
    """One verification per sequence, 20,000 sequences in one call: the token emitted at the draft's
    position is distributed as p, for a random draft (q) and for a one-hot one (n-gram)."""
    torch.manual_seed(0)
    vocab, n = 12, 20000
    p_logits = torch.randn(vocab) * 1.5
    q = torch.softmax(torch.randn(vocab) * 1.5, dim=0)
    p = torch.softmax(p_logits, dim=0)
    params = SamplingParams(temperature=1.0)
    row = SamplingRow(params=params, prompt_token_ids=[1], output_token_ids=[], generator=None)
    logits = p_logits.repeat(2 * n, 1)                    # each sequence: the draft row and the bonus row
    rows = [row] * (2 * n)
    for one_hot in (False, True):
        drafts = torch.multinomial(q, n, replacement=True).tolist() if not one_hot else [3] * n
        groups = [([d], None if one_hot else q.unsqueeze(0)) for d in drafts]
        out = verify(logits, rows, groups, Sampler())
        first = Counter(out.token_ids[0::2])
        accepted = sum(1 for i, d in enumerate(drafts) if out.token_ids[2 * i] == d)
        expected_accept = float(torch.minimum(p, q).sum()) if not one_hot else float(p[3])
        assert abs(accepted / n - expected_accept) < 4 * math.sqrt(expected_accept / n)
        _chi_square(first, {t: float(p[t]) for t in range(vocab)}, n)


def _chi_square(observed: Counter, probs: dict[int, float], n: int) -> None:
    cats = [t for t, pr in probs.items() if pr * n >= 5]
    expected = [probs[t] * n for t in cats]
    obs = [observed.get(t, 0) for t in cats]
    rest = 1.0 - sum(probs[t] for t in cats)
    if rest * n >= 5:
        expected.append(rest * n)
        obs.append(n - sum(obs))
    stat = sum((o - e) ** 2 / e for o, e in zip(obs, expected))
    dof = len(expected) - 1
    assert dof >= 2
    # The 0.999 quantile of chi-square(dof) (Wilson-Hilferty): fails by chance once in 1000 runs.
    limit = dof * (1 - 2 / (9 * dof) + 3.09 * math.sqrt(2 / (9 * dof))) ** 3
    assert stat < limit, (stat, limit, obs, expected)


def test_sampled_distribution_unchanged_at_temperature_1(ckpts):
    """10,000 samples of 4 tokens at temperature 1, 2 drafts per step from a noisy copy: the 2nd
    token (given the most frequent 1st: draft 1 verified) and the 3rd (given the most frequent
    first two: draft 2 verified, or the next step's draft 1) against the target's own distribution
    there (chi-square). The prompt (one full block, then one token: the prefix cache serves the
    rest of the batch) is one whose likely tokens are likely enough to condition on."""
    llm = LLM(ckpts["target"], **KW, max_num_seqs=512, speculative_config=_spec(ckpts["near"], k=2))
    prompt = torch.randint(10, VOCAB, (17,), generator=torch.Generator().manual_seed(11)).tolist()
    params = SamplingParams(temperature=1.0, max_tokens=4, ignore_eos=True, n=100, detokenize=False)
    outs = llm.generate([{"prompt_token_ids": prompt}] * 100, params, use_tqdm=False)
    samples = [tuple(c.token_ids) for o in outs for c in o.outputs]
    assert len(samples) == 10000
    drafts, proposed, accepted, per_position = _counts(llm)
    assert drafts >= 10000 and 0.1 * proposed < accepted < 0.9 * proposed   # rejections and acceptances
    assert per_position[1] > 1000
    first = Counter(t[0] for t in samples).most_common(1)[0][0]
    second = Counter(t[1] for t in samples if t[0] == first)
    pair = (first, second.most_common(1)[0][0])
    third = Counter(t[2] for t in samples if t[:2] == pair)
    for prefix, observed in (([first], second), (list(pair), third)):
        n = sum(observed.values())
        assert n > 1000
        exact = llm.generate([{"prompt_token_ids": prompt + prefix}],
                             SamplingParams(temperature=0.0, max_tokens=1, logprobs=VOCAB), use_tqdm=False)
        probs = {t: math.exp(lp) for t, lp in exact[0].outputs[0].logprobs[0].items()}
        _chi_square(observed, probs, n)


def test_draft_kv_rolled_back_and_blocks_accounted(ckpts):
    """Step by step with rejections (another model, temperature 1): each shadow holds at most the
    target's tokens and k - 1 drafts, agrees with the target on its confirmed tokens, owns exactly
    the blocks its computed tokens need; rejected drafts release blocks; all freed at the end."""
    k, bs = 3, 4
    llm = LLM(ckpts["target"], **KW, block_size=bs, speculative_config=_spec(ckpts["near"], k=k))
    engine = llm.engine
    draft = engine.speculator.draft
    released = []
    truncate = draft.block_manager.truncate

    def spy(seq, num_tokens):
        before = len(seq.block_table)
        truncate(seq, num_tokens)
        released.append(before - len(seq.block_table))
    draft.block_manager.truncate = spy
    for i, p in enumerate(_prompts(4)):
        engine.add_request(str(i), p, SamplingParams(temperature=1.0, max_tokens=40, ignore_eos=True, seed=i))
    while engine.has_unfinished_requests():
        engine.step()
        for seq in engine.scheduler.running:
            shadow = draft.shadows.get(seq.seq_id)
            if shadow is None:
                continue
            assert shadow.token_ids[:shadow.confirmed] == seq.token_ids[:shadow.confirmed]
            assert shadow.num_computed_tokens <= seq.num_tokens + k - 1
            assert len(shadow.block_table) == -(-shadow.num_computed_tokens // bs)
        draft.block_manager.check_invariants(list(draft.shadows.values()))
        engine.scheduler.block_manager.check_invariants(engine.scheduler.running)
    assert sum(1 for r in released if r > 0) > 5           # rejected drafts gave blocks back
    assert not draft.shadows and draft.block_manager.num_used_blocks == 0
    # Aborted mid-generation: the draft's blocks go with the sequence's.
    engine.add_request("a", _prompts(1)[0], SamplingParams(temperature=1.0, max_tokens=40, ignore_eos=True))
    for _ in range(4):
        engine.step()
    assert draft.shadows
    engine.abort_request("a")
    assert not draft.shadows and draft.block_manager.num_used_blocks == 0


def test_preemption_prefix_cache_and_chunked_prefill_keep_greedy_output(ckpts):
    """A target pool too small for the batch (preemption by recompute), prefill chunks of 32 tokens
    mixed with decodes, prompts sharing a prefix (served from both prefix caches): greedy tokens
    unchanged, run twice."""
    params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    shared = _prompts(1, seed=9)[0]["prompt_token_ids"] * 11                  # 33 tokens: 2 full blocks
    prompts = [{"prompt_token_ids": shared + p["prompt_token_ids"]} for p in _prompts(12)]
    small = dict(KW, kv_cache_memory=None, num_gpu_blocks_override=24, block_size=16, max_num_batched_tokens=32)
    ref = LLM(ckpts["target"], **small).generate(prompts, params, use_tqdm=False)
    llm = LLM(ckpts["target"], **small, speculative_config=_spec(ckpts["target"]))
    got = llm.generate(prompts, params, use_tqdm=False)
    again = llm.generate(prompts, params, use_tqdm=False)
    stats = llm.engine.stats()
    assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0
    assert stats.spec_num_accepted_tokens == stats.spec_num_draft_tokens > 100
    for a, b, c in zip(ref, got, again):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids == c.outputs[0].token_ids
    llm.engine.scheduler.block_manager.check_invariants([])
    draft = llm.engine.speculator.draft
    assert draft.block_manager.prefix_cache_hits > 0
    assert not draft.shadows and draft.block_manager.num_used_blocks == 0


def test_structured_outputs_with_a_draft_model(ckpts, reference):
    so = StructuredOutputsParams(regex=r"( ?(w7|w8|w9|w1[0-9])){6,12} ?w3[0-9]")
    prompts = _prompts(4)
    llm = LLM(ckpts["target"], **KW, speculative_config=_spec(ckpts["target"]))
    greedy = SamplingParams(temperature=0.0, max_tokens=40, structured_outputs=so)
    ref = reference.generate(prompts, greedy, use_tqdm=False)
    got = llm.generate(prompts, greedy, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in ref]
    assert llm.engine.stats().spec_num_accepted_tokens > 0
    random = SamplingParams(temperature=1.0, max_tokens=40, structured_outputs=so, seed=3)
    for out in llm.generate(prompts, random, use_tqdm=False) + got:
        assert re.fullmatch(so.regex, out.outputs[0].text), out.outputs[0].text


def test_seeded_requests_reproducible_with_logprobs(ckpts):
    llm = LLM(ckpts["target"], **KW, speculative_config=_spec(ckpts["draft"]))
    params = SamplingParams(temperature=1.0, max_tokens=24, ignore_eos=True, seed=7, logprobs=2)
    a = llm.generate(_prompts(3), params, use_tqdm=False)
    b = llm.generate(_prompts(3)[:1], params, use_tqdm=False)    # another batch: same tokens
    assert a[0].outputs[0].token_ids == b[0].outputs[0].token_ids
    for out in a:                        # logprobs of the raw distribution, the sampled token's included
        c = out.outputs[0]
        assert len(c.logprobs) == len(c.token_ids) == 24
        assert all(t in lp and len(lp) <= 3 for t, lp in zip(c.token_ids, c.logprobs))
        assert c.cumulative_logprob == pytest.approx(sum(lp[t] for t, lp in zip(c.token_ids, c.logprobs)))


def test_gguf_draft_and_disable_by_batch_size(ckpts, reference, tmp_path):
    """The target written as a float32 GGUF (no tokenizer inside: the target's is used) drafts for
    it; a batch of more decoding sequences than disable_by_batch_size drafts nothing."""
    from transformers import AutoModelForCausalLM

    from model_helpers import write_tiny_gguf
    path = str(tmp_path / "draft.gguf")
    write_tiny_gguf(AutoModelForCausalLM.from_pretrained(ckpts["target"], dtype=torch.float32), path, "llama")
    llm = LLM(ckpts["target"], **KW, speculative_config=_spec(path, disable_by_batch_size=2))
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    llm.generate(_prompts(8), params, use_tqdm=False)
    assert _counts(llm)[0] == 0
    prompts = _prompts(2)
    got = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in reference.generate(
        prompts, params, use_tqdm=False)]
    _, proposed, accepted, _ = _counts(llm)
    assert proposed > 10 and accepted >= 0.9 * proposed


def test_draft_model_config_errors(ckpts):
    from tokenmill.core.config import EngineConfig
    with pytest.raises(ValueError, match="speculative_config method 'draft_model' needs 'model'"):
        EngineConfig.from_kwargs(speculative_config={"method": "draft_model"})
    config = EngineConfig.from_kwargs(speculative_config='{"method": "draft_model", "model": "m", '
                                                         '"num_speculative_tokens": 3}')
    assert config.speculative.method == "draft_model" and config.speculative.model == "m"
    with pytest.raises(ValueError, match=r"speculative_config model .* does not share the target model's vocabulary"):
        LLM(ckpts["target"], **KW, speculative_config=_spec(ckpts["other_vocab"]))
    with pytest.raises(ValueError, match="speculative_config model .* does not exist"):
        LLM(ckpts["target"], **KW, speculative_config=_spec(ckpts["target"] + "-missing"))
