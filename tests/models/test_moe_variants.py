"""The mixture-of-experts variants of the dense families (core/models/moe_variants.py): PhiMoE,
Granite 3 MoE (with and without a shared expert), FlexOlmo, EXAONE-MoE and Cohere 2 MoE (softmax
and sigmoid routers, LayerNorm and RMSNorm, shared experts averaged or summed) on random-weight
checkpoints transformers writes: greedy tokens identical to transformers' float32 `generate` over
chunked prefills and the prefix cache, with prompts longer than the sliding windows; one through
the server, one at tensor_parallel_size=2. The routers PhiMoE's sparsemixer and Cohere 2 MoE's
top-k sigmoid against transformers' own."""
from __future__ import annotations

import json

import pytest
import torch

from model_helpers import (assert_greedy_twice, assert_server_greedy, generate, hf_greedy, make_llm,
                           save_moe_checkpoint)

from tokenmill.core.layers.moe import FusedMoE, select_experts

VOCAB = 1000
DIMS = dict(hidden_size=64, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
            max_position_embeddings=256, num_experts_per_tok=2, vocab_size=VOCAB, bos_token_id=1, eos_token_id=2,
            pad_token_id=0)
WINDOW = dict(sliding_window=8)           # shorter than every prompt
GRANITE = dict(DIMS, num_local_experts=8, embedding_multiplier=3.0, residual_multiplier=0.5, attention_multiplier=0.2,
               logits_scaling=2.0)
# PhiMoE's longrope: short factors throughout, cos/sin times short_mscale below the original length
# (every prompt here stays below it: transformers recomputes the whole cache past it).
LONGROPE = dict(rope_type="longrope", rope_theta=10000.0, original_max_position_embeddings=64, short_mscale=1.2,
                long_mscale=1.4, short_factor=[1.0 + 0.3 * i for i in range(8)],
                long_factor=[2.0 + i for i in range(8)])
COHERE = dict(DIMS, head_dim=16, num_experts=8, num_shared_experts=1, first_k_dense_replace=1, logit_scale=0.5,
              prefix_dense_intermediate_size=96, **WINDOW)
# case -> (model_type, config, architecture, router parameter name, sparse layers)
CASES = {
    "phimoe": ("phimoe", dict(DIMS, num_local_experts=4, attention_bias=True, rope_parameters=LONGROPE, **WINDOW),
               "PhimoeForCausalLM", "mlp.router.weight", [0, 1, 2, 3]),
    "granitemoe": ("granitemoe", GRANITE, "GraniteMoeForCausalLM", "router.weight", [0, 1, 2, 3]),
    "granitemoeshared": ("granitemoeshared", dict(GRANITE, shared_intermediate_size=32),
                         "GraniteMoeSharedForCausalLM", "router.weight", [0, 1, 2, 3]),
    "flex_olmo": ("flex_olmo", dict(DIMS, num_experts=8, norm_topk_prob=True), "FlexOlmoForCausalLM",
                  "mlp.gate.weight", [0, 1, 2, 3]),
    # Grouped routing with a correction bias (4 experts in each of 2 groups, 1 group eligible).
    "exaone_moe": ("exaone_moe", dict(DIMS, head_dim=16, num_experts=8, moe_intermediate_size=32, num_shared_experts=1,
                                      first_k_dense_replace=1, n_group=2, topk_group=1,
                                      layer_types=["sliding_attention", "full_attention"] * 2, **WINDOW),
                   "ExaoneMoeForCausalLM", "mlp.gate.weight", [1, 2, 3]),
    # Layer 0 dense, full attention with rope (prefix_dense_sliding_window_pattern 1), layers 1-2
    # sliding, layer 3 full without rope; LayerNorms, softmax router, shared expert averaged.
    "cohere2_moe": ("cohere2_moe", COHERE, "Cohere2MoeForCausalLM", "mlp.gate.weight", [1, 2, 3]),
    "cohere2_moe_sigmoid": ("cohere2_moe", dict(COHERE, expert_selection_fn="sigmoid", rms_norm_eps=1e-5,
                                                shared_expert_combination_strategy="sum"),
                            "Cohere2MoeRmsForCausalLM", "mlp.gate.weight", [1, 2, 3]),
}
PROMPTS = [[3 + (i * 37 + j * 11) % (VOCAB - 3) for j in range(n)] for i, n in enumerate((45, 11, 23, 33))]


def save_case(case: str, directory, seed: int = 0):
    model_type, config, _, router, _ = CASES[case]
    return save_moe_checkpoint(model_type, config, directory, seed, VOCAB, router=router,
                               correction_bias_scale=0.3 if case == "exaone_moe" else 0.0)


@pytest.mark.parametrize("case", sorted(CASES))
def test_greedy_matches_transformers(tmp_path, case):
    hf = save_case(case, tmp_path)
    expected = hf_greedy(hf, PROMPTS)
    llm = make_llm(tmp_path)
    model = llm.engine.bundle.model
    assert type(model).__name__ == CASES[case][2]
    assert [i for i, layer in enumerate(model.model.layers) if isinstance(layer.mlp, FusedMoE)] == CASES[case][4]
    assert_greedy_twice(llm, PROMPTS, expected)


def test_granite_moe_through_the_server(tmp_path):
    hf = save_case("granitemoeshared", tmp_path, seed=1)
    assert_server_greedy(tmp_path, PROMPTS[:2], hf_greedy(hf, PROMPTS[:2]))


def test_granite_moe_shared_at_tp2(tmp_path):
    """Each rank holds half of every fused expert (input_linear's gate and up rows, output_linear's
    columns) and of the fused shared expert: transformers' tokens."""
    hf = save_case("granitemoeshared", tmp_path)
    llm = make_llm(tmp_path, tensor_parallel_size=2)
    try:
        assert [list(o.outputs[0].token_ids) for o in generate(llm, PROMPTS[:2])] == hf_greedy(hf, PROMPTS[:2])
    finally:
        llm.engine.executor.shutdown()


def test_sparsemixer_matches_transformers():
    """PhiMoE's router at inference, on logits with near ties inside and outside the jitter margin."""
    from transformers.models.phimoe.modeling_phimoe import sparsemixer
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(200, 8, generator=g)
    logits[::3, 5] = logits[::3].max(-1).values * (1 - 0.015)      # within 2 * 0.01 of the best
    logits[1::3, 2] = logits[1::3].max(-1).values * (1 - 0.03)     # outside it
    weights, ids = select_experts(logits, 2, "sparsemixer", jitter_eps=0.01)
    want_weights, want_ids = sparsemixer(logits, jitter_eps=0.01, training=False)
    assert torch.equal(ids, want_ids) and torch.equal(weights, want_weights)
    assert (weights < 1).any() and (weights == 1).any()           # both kinds of margin occur
    with pytest.raises(ValueError, match="picks 2 experts"):
        select_experts(logits, 3, "sparsemixer")


@pytest.mark.parametrize("selection", ["softmax", "sigmoid"])
def test_cohere2_moe_router_matches_transformers(selection):
    from transformers import AutoConfig
    from transformers.models.cohere2_moe.modeling_cohere2_moe import Cohere2MoeTopKRouter
    router = Cohere2MoeTopKRouter(AutoConfig.for_model("cohere2_moe", **dict(COHERE, expert_selection_fn=selection)))
    torch.nn.init.normal_(router.weight, generator=torch.Generator().manual_seed(1))
    hidden = torch.randn(50, 64, generator=torch.Generator().manual_seed(2))
    logits, want_weights, want_ids = router(hidden)
    weights, ids = select_experts(logits, 2, f"topk_{selection}", renormalize=True)
    assert torch.equal(ids, want_ids)
    torch.testing.assert_close(weights, want_weights, atol=0, rtol=1e-6)


def test_what_the_variants_refuse(tmp_path):
    from tokenmill.attention_backends.reference import ReferenceAttention
    from tokenmill.core.models.moe_variants import Cohere2MoeForCausalLM, PhimoeForCausalLM
    from transformers import AutoConfig
    config = AutoConfig.for_model("phimoe", **dict(CASES["phimoe"][1], lm_head_bias=True))
    with pytest.raises(ValueError, match="lm_head_bias"):
        PhimoeForCausalLM(config, ReferenceAttention, torch.float32)
    config = AutoConfig.for_model("cohere2_moe", **COHERE)
    config.shared_expert_combination_strategy = "max"
    with pytest.raises(ValueError, match="shared_expert_combination_strategy 'max'"):
        Cohere2MoeForCausalLM(config, ReferenceAttention, torch.float32)


def test_listed_by_tokenmill_models():
    from tokenmill.core.models.features import model_features
    from tokenmill.plugins import discovery
    registered = discovery.model_architectures()
    for name in {architecture for _, _, architecture, _, _ in CASES.values()} - {"Cohere2MoeRmsForCausalLM"}:
        assert model_features(registered[name])["lora"]["supported"] is False


def test_exaone_moe_skips_multi_token_prediction_weights(tmp_path):
    """K-EXAONE checkpoints carry mtp.* tensors: not weights here."""
    from safetensors.torch import load_file, save_file
    hf = save_case("exaone_moe", tmp_path)
    tensors = load_file(str(tmp_path / "model.safetensors"))
    tensors["mtp.layers.0.eh_proj.weight"] = torch.zeros(64, 128)
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["architectures"] == ["ExaoneMoeForCausalLM"]
    llm = make_llm(tmp_path)
    assert [list(o.outputs[0].token_ids) for o in generate(llm, PROMPTS[1:2])] == hf_greedy(hf, PROMPTS[1:2])


@pytest.mark.parametrize("case", ["granitemoe", "granitemoeshared"])
def test_granite_moe_gguf_matches_transformers(tmp_path, case):
    """GGUF "granitemoe" files as llama.cpp's converter writes them (q/k permuted, the fused gate/up of
    the experts and of the shared expert split into ffn_gate/up_exps and _shexp): transformers' tokens."""
    from gguf_writers import convert_hf_checkpoint
    hf = save_case(case, tmp_path / "hf")
    path = str(tmp_path / f"{case}.gguf")
    convert_hf_checkpoint(str(tmp_path / "hf"), path, "granitemoe")
    llm = make_llm(path, tokenizer=str(tmp_path / "hf"))
    assert type(llm.engine.bundle.model).__name__ == CASES[case][2]
    assert [list(o.outputs[0].token_ids) for o in generate(llm, PROMPTS[:2])] == hf_greedy(hf, PROMPTS[:2])
