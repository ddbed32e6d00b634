"""Gemma 4 text (core/models/gemma4.py): random-weight gemma4_text checkpoints that transformers
writes, greedy tokens identical to transformers' float32 `generate` through `tokenmill.LLM` on
prompts longer than the sliding window (chunked prefill, mixed batches, a second pass from the
prefix cache), logits close; one config per shape of the network: per-layer inputs with KV sharing
and a double-wide MLP on the sharing layers (E2B-like), the MoE block with keys-as-values on the
global layers (26B-A4B-like), and a plain one whose global layers differ only in KV heads."""
from __future__ import annotations

import pytest
import torch

from model_helpers import (assert_greedy_twice, assert_logits_match, hf_greedy, load_for_test,
                           make_llm, run_prompt, tiny_tokenizer)

VOCAB = 1000
SLIDING, FULL = "sliding_attention", "full_attention"
BASE = dict(vocab_size=VOCAB, bos_token_id=1, eos_token_id=2, pad_token_id=0, hidden_size=64, intermediate_size=128,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
            sliding_window=8, final_logit_softcapping=5.0)
CONFIGS = {
    # Global layers with twice the head size; the last two layers read layers 0 and 1's KV.
    "per_layer_inputs": dict(BASE, num_hidden_layers=4, layer_types=[SLIDING, FULL] * 2, global_head_dim=32,
                             num_kv_shared_layers=2, hidden_size_per_layer_input=8, vocab_size_per_layer_input=VOCAB,
                             use_double_wide_mlp=True),
    # Global layers: head size 32, one KV head, keys as values; layers 3 and 4 read layers 1 and 2's KV.
    "moe": dict(BASE, num_hidden_layers=5, layer_types=[SLIDING, SLIDING, FULL, SLIDING, FULL], global_head_dim=32,
                num_global_key_value_heads=1, attention_k_eq_v=True, num_kv_shared_layers=2,
                hidden_size_per_layer_input=0, enable_moe_block=True, num_experts=4, top_k_experts=2,
                moe_intermediate_size=32),
    # Global layers: the sliding layers' head size, one KV head, keys as values; no sharing.
    "dense": dict(BASE, num_hidden_layers=4, layer_types=[SLIDING, SLIDING, SLIDING, FULL], global_head_dim=16,
                  num_global_key_value_heads=1, attention_k_eq_v=True, hidden_size_per_layer_input=0),
}
PROMPTS = [[3 + (i * 37 + j * 11) % (VOCAB - 3) for j in range(n)] for i, n in enumerate((45, 11, 23, 33))]


def save(name: str, directory, seed: int = 0):
    """model_helpers.save_random_checkpoint, the layer scalars (buffers, which init leaves at 1) too."""
    import transformers
    torch.manual_seed(seed)
    config = transformers.AutoConfig.for_model("gemma4_text", **CONFIGS[name])
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn_like(param) * 0.05)
        for layer in model.model.layers:
            layer.layer_scalar.add_(torch.randn_like(layer.layer_scalar) * 0.2)
    model.save_pretrained(str(directory))
    tiny_tokenizer(VOCAB).save_pretrained(str(directory))
    return model


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_greedy_matches_transformers(tmp_path, name):
    hf = save(name, tmp_path)
    expected = hf_greedy(hf, PROMPTS)
    llm = make_llm(tmp_path)
    assert type(llm.engine.bundle.model).__name__ == "Gemma4ForCausalLM"
    assert_greedy_twice(llm, PROMPTS, expected)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_logits_match_transformers(tmp_path, name):
    assert_logits_match(save(name, tmp_path, seed=1), tmp_path, PROMPTS[0])


def test_lora_adapter_matches_peft(tmp_path):
    """A PEFT adapter on every projection (no v_proj on the keys-as-values layers, no k/v on the
    sharing ones): peft's greedy tokens."""
    from lora_helpers import ALL_TARGETS, make_adapter

    from tokenmill.core.lora.request import LoRARequest
    from tokenmill.core.sampling_params import SamplingParams
    base = save("moe", tmp_path / "base")
    peft_model = make_adapter(str(tmp_path / "base"), str(tmp_path / "adapter"), seed=7, targets=ALL_TARGETS)
    prompts = PROMPTS[:2]
    expected = hf_greedy(peft_model, prompts)
    assert expected != hf_greedy(base, prompts)                      # the adapter changes the tokens
    llm = make_llm(tmp_path / "base", enable_lora=True, max_lora_rank=8)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True),
                        lora_request=LoRARequest("a", 1, str(tmp_path / "adapter")), use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outs] == expected


def test_config_reaches_the_layers(tmp_path):
    """Sharing layers hold no cache and no K/V projections; one pool geometry for every layer."""
    save("moe", tmp_path)
    model = load_for_test(tmp_path).model
    layers = model.model.layers
    assert [a.sliding_window for a in model.attention_layers] == [8, 8, None]       # layers 3 and 4 share
    assert model.model.producers == {3: 1, 4: 2}
    assert not hasattr(layers[3].self_attn, "k_proj") and not hasattr(layers[4].self_attn, "attn")
    # A checkpoint's K/V tensors of a sharing layer are skipped, as transformers skips them.
    assert model.checkpoint_name("model.layers.3.self_attn.k_proj.weight") is None
    assert model.checkpoint_name("model.layers.1.self_attn.k_proj.weight") == "model.layers.1.self_attn.k_proj.weight"
    assert {(a.num_kv_heads, a.head_size, a.scale) for a in model.attention_layers} == {(2, 32, 1.0)}
    assert layers[2].self_attn.v_proj is None and layers[1].self_attn.v_proj is not None   # keys as values
    assert (layers[2].self_attn.head_dim, layers[2].self_attn.num_kv_heads) == (32, 1)
    assert run_prompt(model, PROMPTS[0]).abs().max() <= 5.0                          # the final soft-cap

    save("per_layer_inputs", tmp_path / "ple")
    model = load_for_test(tmp_path / "ple").model
    widths = [layer.mlp.down_proj.input_size for layer in model.model.layers]
    assert widths == [128, 128, 256, 256]                                             # double-wide on sharing
    assert model.model.embed_tokens_per_layer.weight.shape == (VOCAB, 4 * 8)


def test_experts_dense_form_sums_as_the_routed_one():
    """The capture-safe form of the shared expert op (every expert on every token, weighted 0 where
    not picked) gives the routed sums for Gemma 4's router and experts (in float64: the matmuls over
    more rows may round differently)."""
    import transformers

    from tokenmill.core.layers import moe
    from tokenmill.core.models.gemma4_moe import Gemma4Experts, Gemma4Router
    config = transformers.AutoConfig.for_model("gemma4_text", **CONFIGS["moe"])
    torch.manual_seed(0)
    router, experts = Gemma4Router(config, torch.float64), Gemma4Experts(config, "gelu_tanh", torch.float64)
    for p in list(router.parameters()) + list(experts.parameters()):
        p.data.normal_()
    hidden = torch.randn(7, 64, dtype=torch.float64)
    weights, ids = router(hidden)
    assert ids.shape == (7, 2) and len(set(ids.flatten().tolist())) > 2
    dense = moe._dense(hidden, experts.gate_up_proj, experts.down_proj, weights, ids, "gelu_tanh")
    torch.testing.assert_close(dense, experts(hidden, ids, weights))


def test_unsupported_config_refused():
    import transformers

    from tokenmill.core.models.gemma4 import Gemma4ForCausalLM
    kwargs = dict(CONFIGS["dense"], use_bidirectional_attention="all")
    config = transformers.AutoConfig.for_model("gemma4_text", **kwargs)
    with pytest.raises(ValueError, match="bidirectional"):
        Gemma4ForCausalLM.attention_config(config, torch.float32)


def test_listed_by_tokenmill_models():
    from tokenmill.entrypoints.models_cmd import collect, render
    data = collect()
    rows = {row["name"]: row for row in data["architectures"]}
    row = rows["Gemma4ForCausalLM"]
    assert row["implementation"] == "native" and row["state"] == "loaded"
    features = row["features"]
    assert features["sliding_window"]["supported"] is True
    assert features["fast_path"]["supported"] is False and "eagerly" in features["fast_path"]["detail"]
    assert features["tp"]["supported"] is False and features["pp"]["supported"] is False
    assert "Gemma4ForCausalLM" in render(data)
