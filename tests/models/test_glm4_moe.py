"""GLM-4-MoE (GLM-4.5; core/models/glm4_moe.py) on random-weight checkpoints transformers writes:
greedy tokens identical to transformers' float32 `generate` (chunked prefills, decodes, the prefix
cache), with its sigmoid router over expert groups and a score-correction bias, routed scaling,
a shared expert, a dense first layer, partial rotary, q/k biases, with and without q/k norms;
multi-token-prediction layers past num_hidden_layers are skipped; tensor_parallel_size=2."""
from __future__ import annotations

import pytest
import torch

from model_helpers import (assert_greedy_twice, generate, hf_greedy, make_llm, save_moe_checkpoint)

from tokenmill.core.layers.moe import FusedMoE

VOCAB = 1000
CONFIG = dict(vocab_size=VOCAB, bos_token_id=1, eos_token_id=2, pad_token_id=0, hidden_size=64, intermediate_size=96,
              moe_intermediate_size=32, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
              max_position_embeddings=256, n_routed_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1,
              first_k_dense_replace=1, n_shared_experts=1, routed_scaling_factor=2.5, attention_bias=True)
PROMPTS = [[3 + (i * 37 + j * 11) % (VOCAB - 3) for j in range(n)] for i, n in enumerate((45, 11, 23, 33))]


def save_glm(directory, seed: int = 0, **overrides):
    """A random float32 transformers GLM-4-MoE saved with a tokenizer (routers decisive, the
    correction bias large enough to change which experts win)."""
    return save_moe_checkpoint("glm4_moe", {**CONFIG, **overrides}, directory, seed, VOCAB, correction_bias_scale=0.5)


@pytest.mark.parametrize("qk_norm", [False, True])
def test_greedy_matches_transformers(tmp_path, qk_norm):
    hf = save_glm(tmp_path, use_qk_norm=qk_norm)
    expected = hf_greedy(hf, PROMPTS)
    llm = make_llm(tmp_path)
    model = llm.engine.bundle.model
    layers = model.model.layers
    assert [isinstance(layer.mlp, FusedMoE) for layer in layers] == [False, True, True]     # first_k_dense_replace
    assert all((layer.self_attn.q_norm is not None) == qk_norm for layer in layers)
    assert layers[0].structure.rotary_dim == 8                       # partial_rotary_factor 0.5 of 16
    assert layers[1].mlp.shared_expert is not None and layers[1].mlp.num_groups == 2
    assert_greedy_twice(llm, PROMPTS, expected)


def test_multi_token_prediction_layers_are_skipped(tmp_path):
    """GLM-4.5 checkpoints carry their MTP layer as model.layers.{num_hidden_layers}: not a weight here."""
    from safetensors.torch import load_file, save_file
    hf = save_glm(tmp_path)
    expected = hf_greedy(hf, PROMPTS[:2])
    tensors = load_file(str(tmp_path / "model.safetensors"))
    extra = {name.replace("model.layers.2.", "model.layers.3.", 1): t.clone()
             for name, t in tensors.items() if name.startswith("model.layers.2.")}
    extra["model.layers.3.eh_proj.weight"] = torch.zeros(64, 128)
    save_file({**tensors, **extra}, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    assert [list(o.outputs[0].token_ids) for o in generate(make_llm(tmp_path), PROMPTS[:2])] == expected


def test_tp2_matches_transformers(tmp_path):
    """Heads, every expert's and the shared expert's intermediate size split over two ranks."""
    hf = save_glm(tmp_path, use_qk_norm=True)
    expected = hf_greedy(hf, PROMPTS[:2])
    llm = make_llm(tmp_path, tensor_parallel_size=2)
    try:
        assert [list(o.outputs[0].token_ids) for o in generate(llm, PROMPTS[:2])] == expected
    finally:
        llm.engine.executor.shutdown()


def test_registered_with_features():
    from tokenmill.core.models.features import model_features
    from tokenmill.plugins import discovery
    features = model_features(discovery.model_architectures()["Glm4MoeForCausalLM"])
    assert features["tp"]["supported"] is True
    assert features["lora"]["supported"] is False
