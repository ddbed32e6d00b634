"""DeepSeek-V2 and DeepSeek-V3 (core/models/deepseek.py) with multi-head latent attention
(core/layers/mla.py, attention_backends/mla.py): greedy tokens identical to transformers' float32
on random-weight checkpoints it writes, over chunked prefills, from the prefix cache and at tensor or
pipeline parallel size 2; int8 / int4 close to float32; the cache
holding one latent + rope row per token; the absorbed decode equal to the expanded form; backends
without MLA passed over with their reason; the cpu fast decode path refusing MLA layers by name."""
from __future__ import annotations

import logging

import pytest
import torch

from model_helpers import (assert_server_greedy, generate, hf_greedy, hf_last_logits, load_for_test, make_llm,
                           run_prompt, save_moe_checkpoint)

from tokenmill.attention_backends.interface import AttentionConfig, build_metadata
from tokenmill.attention_backends.mla import CpuMLAAttention, write_latent
from tokenmill.attention_backends.reference import ReferenceAttention
from tokenmill.attention_backends.selector import select_backend
from tokenmill.core.layers.moe import FusedMoE

VOCAB = 1000
MLA = dict(kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16)
DIMS = dict(vocab_size=VOCAB, bos_token_id=1, eos_token_id=2, pad_token_id=0, hidden_size=64, intermediate_size=96,
            num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=256,
            n_routed_experts=8, moe_intermediate_size=32, num_experts_per_tok=2, first_k_dense_replace=1, **MLA)
FAMILIES = {
    # V2-Lite's plain q_proj (no q_lora_rank), two shared experts, softmax routing limited to 2 of 4 groups.
    "deepseek_v2": dict(DIMS, q_lora_rank=None, n_shared_experts=2, topk_method="group_limited_greedy", n_group=4,
                        topk_group=2, routed_scaling_factor=1.5),
    # The low-rank query, sigmoid routing with a correction bias over groups, renormalized and scaled;
    # yarn rope whose mscale_all_dim scales the softmax.
    "deepseek_v3": dict(DIMS, q_lora_rank=24, n_shared_experts=1, n_group=4, topk_group=2, norm_topk_prob=True,
                        routed_scaling_factor=2.5,
                        rope_parameters={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
                                         "mscale": 1.0, "mscale_all_dim": 1.0, "rope_theta": 10000.0}),
}
ARCHITECTURES = {"deepseek_v2": "DeepseekV2ForCausalLM", "deepseek_v3": "DeepseekV3ForCausalLM"}
PROMPTS = [[3 + (i * 37 + j * 11) % (VOCAB - 3) for j in range(n)] for i, n in enumerate((45, 11, 23, 33))]
ROW = MLA["kv_lora_rank"] + MLA["qk_rope_head_dim"]          # cached numbers per token and layer


def save_family(model_type: str, directory, seed: int = 0, **overrides):
    """A random-weight transformers model saved with a tokenizer (routers decisive; V3's correction
    bias random, so it changes which experts win); the float32 model."""
    return save_moe_checkpoint(model_type, {**FAMILIES[model_type], **overrides}, directory, seed, VOCAB,
                               correction_bias_scale=0.1)


@pytest.mark.parametrize("model_type", sorted(FAMILIES))
def test_greedy_matches_transformers(tmp_path, model_type, caplog):
    """16 tokens after prompts prefilled in 32-token chunks, batched with decodes; again from the
    prefix cache. The cache holds one latent + rope row per token and layer, logged against an
    uncompressed cache."""
    hf = save_family(model_type, tmp_path)
    expected = hf_greedy(hf, PROMPTS, max_tokens=16)
    with caplog.at_level(logging.INFO, logger="tokenmill.model_runner"):
        llm = make_llm(tmp_path)
    runner = llm.engine.runner
    model = llm.engine.bundle.model
    assert type(model).__name__ == ARCHITECTURES[model_type]
    assert [isinstance(layer.mlp, FusedMoE) for layer in model.model.layers] == [False, True, True]
    assert runner.backend_cls is CpuMLAAttention and runner.layers[0].kv_cache.shape[1:] == (16, ROW)
    assert runner.bytes_per_block == 16 * 3 * ROW * 4          # block_size x layers x (L + R) x float32
    full = 4 * (16 + 8 + 16)                                    # heads x (nope + rope + v)
    assert f"MLA KV cache: {3 * ROW * 4} bytes per token" in caplog.text
    assert f"an uncompressed cache would need {3 * full * 4}" in caplog.text
    first = generate(llm, PROMPTS, max_tokens=16)
    assert [list(o.outputs[0].token_ids) for o in first] == expected
    second = generate(llm, PROMPTS, max_tokens=16)
    assert [list(o.outputs[0].token_ids) for o in second] == expected
    assert second[0].num_cached_tokens >= 32


@pytest.mark.parametrize("model_type,overrides", [("deepseek_v2", {}), ("deepseek_v2", {"topk_method": "greedy"}),
                                                  ("deepseek_v3", {}), ("deepseek_v3", {"rope_interleave": False})])
def test_logits_match_transformers(tmp_path, model_type, overrides):
    """One prefill through the reference backend (the expanded form): transformers' float32 logits."""
    hf = save_family(model_type, tmp_path, seed=1, **overrides)
    model = load_for_test(tmp_path).model
    torch.testing.assert_close(run_prompt(model, PROMPTS[0]), hf_last_logits(hf, PROMPTS[0]), atol=2e-4, rtol=2e-4)


def test_long_prompt_in_small_chunks(tmp_path):
    """A 150-token prompt prefilled 16 tokens a step (each chunk attends to the cached ones before it)."""
    hf = save_family("deepseek_v3", tmp_path, seed=2)
    prompt = [[3 + (j * 13) % (VOCAB - 3) for j in range(150)]]
    llm = make_llm(tmp_path, max_num_batched_tokens=16)
    assert [list(o.outputs[0].token_ids) for o in generate(llm, prompt, max_tokens=16)] == \
        hf_greedy(hf, prompt, max_tokens=16)


def _mla_inputs(query_lens: list[int], seq_lens: list[int], heads: int = 4, seed: int = 0):
    """Random MLA queries and new rows over shuffled blocks whose earlier rows are already cached."""
    g = torch.Generator().manual_seed(seed)
    nope, rope, v, rank, block_size = 16, 8, 16, 32, 4
    tables, free = [], torch.randperm(64, generator=g).tolist()
    for s in seq_lens:
        tables.append([free.pop() for _ in range((s + block_size - 1) // block_size)])
    meta = build_metadata(query_lens, seq_lens, tables, block_size)
    t = sum(query_lens)
    cache = torch.randn(64, block_size, rank + rope, generator=g)     # the context before each query
    args = (torch.randn(t, heads, nope, generator=g), torch.randn(t, heads, rope, generator=g),
            torch.randn(t, rank, generator=g), torch.randn(t, rope, generator=g))
    return args, cache, meta, torch.randn(heads, nope + v, rank, generator=g) * 0.3


@pytest.mark.parametrize("query_lens,seq_lens", [([1, 1, 1], [5, 17, 40]),             # decodes: absorbed
                                                 ([1, 1, 9, 20], [9, 30, 9, 33])])     # mixed with prefill chunks
def test_cpu_mla_matches_the_expanded_reference(query_lens, seq_lens):
    """cpu_mla's absorbed decode (attention over the cached latent rows, W_UK folded into the query
    and W_UV into the output) and its SDPA prefill equal the reference's expanded form."""
    args, cache, meta, kv_b = _mla_inputs(query_lens, seq_lens)
    scale = 24 ** -0.5
    ours, ref = CpuMLAAttention(4, 40, scale, 1), ReferenceAttention(4, 40, scale, 1)
    got = ours.forward_mla(*args, cache.clone(), meta, kv_b)
    want = ref.forward_mla(*args, cache.clone(), meta, kv_b)
    assert got.shape == (sum(query_lens), 4, 16)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_absorbed_decode_reads_only_the_latent_rows(monkeypatch):
    """The decode batch never expands the context through kv_b_proj: only the expanded form calls
    F.linear (once per prefill sequence); a decode-only batch calls it never."""
    import torch.nn.functional as F
    args, cache, meta, kv_b = _mla_inputs([1, 1], [12, 30])
    calls = []
    real = F.linear
    monkeypatch.setattr(F, "linear", lambda *a, **k: calls.append(a[0].shape) or real(*a, **k))
    CpuMLAAttention(4, 40, 0.2, 1).forward_mla(*args, cache, meta, kv_b)
    assert calls == []


def test_write_latent_places_rows_at_their_slots():
    cache = torch.zeros(4, 2, 5)
    latent, k_pe = torch.arange(6.).view(2, 3), -torch.arange(4.).view(2, 2)
    write_latent(latent, k_pe, cache, torch.tensor([5, 0]))
    assert cache[2, 1].tolist() == [0, 1, 2, 0, -1] and cache[0, 0].tolist() == [3, 4, 5, -2, -3]
    assert cache.abs().sum() == (cache[2, 1].abs().sum() + cache[0, 0].abs().sum())


def test_backends_without_mla_are_passed_over_with_the_reason(caplog):
    from tokenmill.attention_backends.cpu_sdpa import CpuSdpaAttention
    backends = {"cpu_sdpa": CpuSdpaAttention, "cpu_mla": CpuMLAAttention, "reference": ReferenceAttention}
    mla = AttentionConfig(head_size=ROW, num_heads=4, num_kv_heads=1, dtype=torch.float32, mla=True)
    with caplog.at_level(logging.INFO, logger="tokenmill.attention_backends"):
        assert select_backend(backends, ["cpu_sdpa", "cpu_mla", "reference"], mla) is CpuMLAAttention
    assert "cpu_sdpa: multi-head latent attention (MLA) not supported" in caplog.text
    with pytest.raises(ValueError, match="'cpu_sdpa' cannot run here: multi-head latent attention"):
        select_backend(backends, ["cpu_sdpa"], mla, requested="cpu_sdpa")
    assert select_backend(backends, ["cpu_sdpa", "cpu_mla", "reference"], mla, requested="reference") \
        is ReferenceAttention
    plain = AttentionConfig(head_size=16, num_heads=4, num_kv_heads=2, dtype=torch.float32)
    assert CpuMLAAttention.validate(plain) == ["runs multi-head latent attention (MLA) layers only"]
    assert select_backend(backends, ["cpu_mla", "reference"], plain) is ReferenceAttention


def test_fast_path_refuses_mla_layers_by_name(tmp_path):
    """The cpu native decode step does not express MLA: its vocabulary check names the layers, and
    an engine on the platform's default decode program runs the model eagerly."""
    from tokenmill.platforms.cpu_native_layers import outside_vocabulary
    save_family("deepseek_v3", tmp_path)
    llm = make_llm(tmp_path, dtype="bfloat16")
    model = llm.engine.bundle.model
    assert "layers 0-2: attention mla" in outside_vocabulary(model.decoder_stack())
    report = llm.engine.runner.fast_path_report()
    assert not report["took_the_model"] and report["attention_backend"] == "cpu_mla"
    if report["decode_program"] == "fused_decode" and "AVX512" not in (report["eager_reason"] or ""):
        assert "attention mla" in report["eager_reason"]
    assert len(generate(llm, PROMPTS[:2], max_tokens=4)[1].outputs[0].token_ids) == 4


def test_features():
    from tokenmill.core.models.features import model_features
    from tokenmill.plugins import discovery
    registered = discovery.model_architectures()
    for name in ARCHITECTURES.values():
        features = model_features(registered[name])
        assert features["fast_path"]["supported"] is False and "MLA" in features["fast_path"]["detail"]
        assert features["lora"]["supported"] is True and "not kv_b_proj" in features["lora"]["detail"]
        assert features["tp"]["supported"] is True


@pytest.mark.parametrize("model_type,parallel", [("deepseek_v2", {"tensor_parallel_size": 2}),
                                                 ("deepseek_v3", {"tensor_parallel_size": 2}),
                                                 ("deepseek_v3", {"pipeline_parallel_size": 2}),
                                                 ("deepseek_v3", {"tensor_parallel_size": 2,
                                                                  "enable_expert_parallel": True})])
def test_two_ranks_match_transformers(tmp_path, model_type, parallel):
    """tp=2: each rank holds half of the heads (q, kv_b, o) and caches the whole latent; pp=2: the
    layers over two stages; tp=2 with expert parallelism: 4 of the 8 routed experts per rank (grouped
    top-k routing unchanged, the shared expert tensor-parallel). transformers' tokens either way."""
    hf = save_family(model_type, tmp_path)
    prompts = PROMPTS[:2]
    llm = make_llm(tmp_path, **parallel)
    try:
        assert [list(o.outputs[0].token_ids) for o in generate(llm, prompts, max_tokens=12)] == \
            hf_greedy(hf, prompts, max_tokens=12)
    finally:
        llm.engine.executor.shutdown()


def test_int8_and_int4_quantize_all_but_kv_b_proj(tmp_path):
    """Run-time int8 / int4 cover the projections and the experts; kv_b_proj, which the backend reads
    as a matrix, stays dense. The last logits stay close to float32's."""
    save_family("deepseek_v3", tmp_path)
    prompt = PROMPTS[0]
    dense = run_prompt(make_llm(tmp_path).engine.bundle.model, prompt)[-1]
    for method, similarity in (("int8", 0.999), ("int4", 0.97)):
        model = make_llm(tmp_path, quantization=method).engine.bundle.model
        attn = model.model.layers[1].self_attn
        assert type(attn.kv_b_proj.quant_method).__name__ == "UnquantizedLinearMethod"
        assert attn.kv_b_proj.weight.dtype == torch.float32
        assert method in type(attn.o_proj.quant_method).__name__.lower()
        assert method in type(model.model.layers[1].mlp.quant_method).__name__.lower()      # the experts
        got = run_prompt(model, prompt)[-1]
        assert torch.nn.functional.cosine_similarity(dense, got, dim=0) > similarity


def test_ngram_speculative_decoding(tmp_path):
    """Drafted tokens verified in one step (a query of k + 1 tokens per sequence, attended in the
    expanded form) give transformers' tokens; the tiny model's repetitive output accepts some."""
    hf = save_family("deepseek_v2", tmp_path)
    ngram = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1,
             "disable_by_batch_size": None}
    llm = make_llm(tmp_path, speculative_config=ngram)
    assert [list(o.outputs[0].token_ids) for o in generate(llm, PROMPTS, max_tokens=16)] == \
        hf_greedy(hf, PROMPTS, max_tokens=16)
    assert llm.engine.stats().spec_num_accepted_tokens > 0


@pytest.mark.parametrize("model_type", sorted(FAMILIES))
def test_lora_on_attention_matches_peft(tmp_path, model_type):
    """A PEFT adapter on the query, latent and output projections: peft's greedy tokens. One on
    kv_b_proj (read as a matrix by the backend) or the experts is refused (peft writes a
    `shared_experts.down_proj` target as target_parameters on the routed experts)."""
    from lora_helpers import make_adapter

    from tokenmill.core.lora.request import LoRARequest
    from tokenmill.core.sampling_params import SamplingParams
    base = save_family(model_type, tmp_path / "base")
    query = ["q_proj"] if FAMILIES[model_type]["q_lora_rank"] is None else ["q_a_proj", "q_b_proj"]
    targets = [*query, "kv_a_proj_with_mqa", "o_proj"]
    peft_model = make_adapter(str(tmp_path / "base"), str(tmp_path / "adapter"), seed=7, targets=targets)
    prompts = PROMPTS[:2]
    expected = hf_greedy(peft_model, prompts)
    assert expected != hf_greedy(base, prompts)                      # the adapter changes the tokens
    llm = make_llm(tmp_path / "base", enable_lora=True, max_lora_rank=8)
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                        lora_request=LoRARequest("a", 1, str(tmp_path / "adapter")), use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outs] == expected
    for i, refused in enumerate(["kv_b_proj", "shared_experts.down_proj"]):
        make_adapter(str(tmp_path / "base"), str(tmp_path / f"bad{i}"), seed=8, targets=[refused])
        with pytest.raises(ValueError, match="does not have as (a )?LoRA target|experts is not supported"):
            llm.generate([{"prompt_token_ids": prompts[0]}], params,
                         lora_request=LoRARequest(f"bad{i}", 2 + i, str(tmp_path / f"bad{i}")), use_tqdm=False)


def test_server_answers_as_transformers(tmp_path):
    """`tokenmill serve DIR` through the openai SDK: transformers' greedy tokens."""
    hf = save_family("deepseek_v3", tmp_path)
    prompts = PROMPTS[:2]
    expected = hf_greedy(hf, prompts)
    assert_server_greedy(tmp_path, prompts, expected)
