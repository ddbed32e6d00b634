"""Mixture-of-experts layers inside the cpu platform's native decode step (platforms/cpu_fused_moe.py,
cpu_decode_step.cpp FusedMoeFfn): the step's router against select_experts (softmax / sigmoid,
renormalized, grouped top-k with a correction bias, routed scaling, bf16 logits); Qwen3-MoE and
Qwen2-MoE (shared expert with its sigmoid gate) decoding with every layer native, in bf16 and with
int4 / int8 experts, against the eager model's hidden states and transformers' float32 tokens."""
from __future__ import annotations

import pytest
import torch

from model_helpers import fused_and_eager_decode, generate, hf_greedy, make_llm, save_moe_checkpoint

from tokenmill.core.layers.moe import FusedMoE
from tokenmill.core.models.moe_families import moe_spec
from tokenmill.platforms import cpu_decode_kernels as native
from tokenmill.platforms.cpu_fused_moe import pack_moe, route
from tokenmill.platforms.cpu_moe import NativeMoe

pytestmark = pytest.mark.skipif(native.NativeHeadKernel.available() is not None,
                                reason=f"fused decode kernels unavailable: {native.NativeHeadKernel.available()}")

VOCAB = 1000
DIMS = dict(hidden_size=64, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
            max_position_embeddings=256, num_experts_per_tok=2, vocab_size=VOCAB, bos_token_id=1, eos_token_id=2,
            pad_token_id=0, num_experts=8, moe_intermediate_size=32)
FAMILIES = {
    # Every layer sparse, the top-k weights renormalized.
    "qwen3_moe": dict(DIMS, head_dim=16, norm_topk_prob=True),
    # A shared expert with its sigmoid gate; layer 1 dense (mlp_only_layers).
    "qwen2_moe": dict(DIMS, shared_expert_intermediate_size=64, mlp_only_layers=[1]),
}
PROMPTS = [[3 + (i * 37 + j * 11) % (VOCAB - 3) for j in range(n)] for i, n in enumerate((45, 11, 23, 33))]
MODES = {"bfloat16": dict(dtype="bfloat16"), "int4": dict(quantization="int4", kv_cache_dtype="bfloat16"),
         "int8": dict(quantization="int8", kv_cache_dtype="bfloat16")}
EXPERT_FORMATS = {"bfloat16": "bf16", "int4": "q4", "int8": "s8"}


def _bf16_ok() -> bool:
    return bool(native.LIBRARY.require().fused_decode_caps() & 2)


@pytest.mark.parametrize("case", ["softmax", "softmax_renormalized", "sigmoid_scaled", "grouped", "grouped_bias",
                                  "bf16"])
def test_the_steps_router_matches_select_experts(case):
    if case == "bf16" and not _bf16_ok():
        pytest.skip("no AVX512-BF16")
    dtype = torch.bfloat16 if case == "bf16" else torch.float32
    grouped = case.startswith("grouped")
    layer = FusedMoE(64, 32, 16, 4, dtype, scoring="sigmoid" if case != "softmax" and case != "bf16" else "softmax",
                     renormalize=case != "softmax", num_groups=4 if grouped else None,
                     topk_groups=2 if grouped else None, correction_bias=case == "grouped_bias",
                     routed_scaling_factor=2.5 if case in ("sigmoid_scaled", "grouped_bias") else 1.0,
                     weights_in_hidden_dtype=True)
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        layer.w13.copy_(torch.randn(layer.w13.shape, generator=g) * 0.1)
        layer.w2.copy_(torch.randn(layer.w2.shape, generator=g) * 0.1)
        layer.gate.weight.copy_(torch.randn(16, 64, generator=g) * 0.5)
        if case == "grouped_bias":
            layer.gate.e_score_correction_bias.copy_(torch.randn(16, generator=g) * 0.3)
    layer.use_kernel(NativeMoe(round_weights=dtype == torch.float32))
    keep: list = []
    ffn = pack_moe(moe_spec(layer), lambda linear, name: None, keep)
    x = torch.randn(40, 64, generator=g).to(dtype)
    weights, ids = route(ffn, x)
    want_weights, want_ids = layer.route(x)
    if grouped:                                    # from at most topk_groups groups
        assert all(len(set(row)) <= 2 for row in (ids // 4).tolist())
    if case == "grouped_bias":                     # the bias changes which experts win
        unbiased = FusedMoE(64, 32, 16, 4, dtype, scoring="sigmoid", num_groups=4, topk_groups=2)
        unbiased.gate.weight.data.copy_(layer.gate.weight)
        assert not torch.equal(ids, unbiased.route(x)[1])
    # As dense [tokens, experts] routing matrices: tied scores may list their experts in either order.
    def dense(w, i):
        return torch.zeros(40, 16).scatter_add_(1, i, w.float())
    rows = torch.ones(40, dtype=torch.bool)
    if case == "bf16":
        # bf16 logits tie often; where the 4th and 5th best tie, either expert is a right answer.
        top = torch.softmax(layer.gate(x).float(), dim=-1).topk(5, dim=-1).values
        rows = top[:, 3] > top[:, 4]
        assert rows.sum() >= 30
    torch.testing.assert_close(dense(weights, ids)[rows], dense(want_weights, want_ids)[rows], atol=1e-6, rtol=1e-5)


def _fast_llm(path, mode: str):
    if mode == "bfloat16" and not _bf16_ok():
        pytest.skip("no AVX512-BF16")
    return make_llm(path, **{**dict(dtype="float32", max_num_batched_tokens=64,
                                    disable_hybrid_kv_cache_manager=True), **MODES[mode]})


@pytest.mark.parametrize("mode", sorted(MODES))
def test_qwen3_moe_decodes_with_its_expert_layers_inside_the_native_step(tmp_path, mode):
    """Every layer native (no eager layer between native ranges); a decode step's hidden states are
    the eager model's; in bf16 the greedy tokens begin as transformers' float32 ones (bf16 rounding
    parts them later, at the near-ties a random model has, as it parts the eager bf16 model's)."""
    hf = save_moe_checkpoint("qwen3_moe", FAMILIES["qwen3_moe"], tmp_path)
    llm = _fast_llm(tmp_path, mode)
    runner = llm.engine.runner
    assert runner.fast_path_report()["took_the_model"]
    assert runner.decode_program.eager_layers == []
    sparse = [layer.mlp for layer in llm.engine.bundle.model.model.layers]
    assert all(mlp._prepared.weight_format == EXPERT_FORMATS[mode] for mlp in sparse)
    fused, eager = fused_and_eager_decode(llm, PROMPTS[0])
    assert torch.nn.functional.cosine_similarity(fused, eager, dim=-1).min() > 0.999
    got = [list(o.outputs[0].token_ids) for o in generate(llm, PROMPTS, max_tokens=4)]
    assert runner.forward.last_path == "fused_decode"
    if mode == "bfloat16":
        assert got == hf_greedy(hf, PROMPTS, max_tokens=4)
    else:
        assert all(len(tokens) == 4 for tokens in got)


@pytest.mark.parametrize("mode", ["bfloat16", "int4"])
def test_expert_token_counts_include_the_native_steps_routing(tmp_path, mode):
    """The native step routes in the layers' place and still fills their token counters: every MoE
    layer's counts add up to every forwarded token (prompts, then each decode) times top_k."""
    save_moe_checkpoint("qwen3_moe", FAMILIES["qwen3_moe"], tmp_path)
    llm = _fast_llm(tmp_path, mode)
    generate(llm, PROMPTS, max_tokens=6)
    assert llm.engine.runner.forward.last_path == "fused_decode"
    forwarded = sum(len(p) for p in PROMPTS) + len(PROMPTS) * (6 - 1)
    counts = llm.engine.stats().moe_expert_tokens
    assert sorted(counts, key=int) == ["0", "1", "2", "3"]
    assert all(sum(row) == forwarded * DIMS["num_experts_per_tok"] for row in counts.values()), counts


def test_qwen2_moe_shared_expert_and_dense_layers_in_the_native_step(tmp_path):
    """Qwen2-MoE: sparse layers with the shared expert times sigmoid(its gate) and a dense layer, all
    native: transformers' float32 greedy tokens, and the eager bf16 model's."""
    hf = save_moe_checkpoint("qwen2_moe", FAMILIES["qwen2_moe"], tmp_path)
    llm = _fast_llm(tmp_path, "bfloat16")
    runner = llm.engine.runner
    assert runner.decode_program.eager_layers == []
    fused, eager = fused_and_eager_decode(llm, PROMPTS[0])
    assert torch.nn.functional.cosine_similarity(fused, eager, dim=-1).min() > 0.999
    got = [list(o.outputs[0].token_ids) for o in generate(llm, PROMPTS, max_tokens=12)]
    assert runner.forward.last_path == "fused_decode"
    assert got == hf_greedy(hf, PROMPTS, max_tokens=12)
    eager_llm = make_llm(tmp_path, dtype="bfloat16", max_num_batched_tokens=64, enforce_eager=True)
    assert got == [list(o.outputs[0].token_ids) for o in generate(eager_llm, PROMPTS, max_tokens=12)]


def test_float32_experts_keep_the_layer_eager_and_say_why(tmp_path, monkeypatch):
    """Without the native MoE op's packed experts (here: the platform offers no moe kernel) the
    sparse layers run eagerly between native ones, and the report says why."""
    from tokenmill.platforms import cpu_moe
    monkeypatch.setattr(cpu_moe, "moe_kernel", lambda *args, **kwargs: None)
    save_moe_checkpoint("qwen2_moe", FAMILIES["qwen2_moe"], tmp_path)
    llm = _fast_llm(tmp_path, "bfloat16")
    program = llm.engine.runner.decode_program
    assert program.eager_layers == [0, 2, 3]
    assert any("experts not packed by the native MoE op" in why for why in program._beyond)
