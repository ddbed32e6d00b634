"""The native dense families (core/models/families.py over core/models/decoder.py): random-weight
checkpoints that transformers writes for each, greedy tokens identical to transformers' float32
`generate` on prompts longer than their sliding windows (chunked prefill, mixed batches, a second
pass from the prefix cache), logits close, through the server with the openai SDK, and what each
family's vocabulary entries do (soft-caps, windows, NoPE layers, partial/GPT-J rotary, scalings)."""
from __future__ import annotations

import pytest
import torch

from family_configs import ARCHITECTURES, FAMILIES, PROMPTS, save_family
from model_helpers import (assert_greedy_twice, assert_logits_match, assert_server_greedy, generate, hf_greedy,
                           load_for_test, make_llm, run_prompt)

from tokenmill.core.models.transformers_impl import TransformersForCausalLM

@pytest.mark.parametrize("model_type", sorted(FAMILIES))
def test_greedy_matches_transformers(tmp_path, model_type):
    hf = save_family(model_type, tmp_path)
    expected = hf_greedy(hf, PROMPTS)
    llm = make_llm(tmp_path)                               # model_impl="auto": the native class
    model = llm.engine.bundle.model
    assert not isinstance(model, TransformersForCausalLM)
    assert type(model).__name__ == ARCHITECTURES[model_type]
    assert_greedy_twice(llm, PROMPTS, expected)


@pytest.mark.parametrize("model_type", sorted(FAMILIES))
def test_logits_match_transformers(tmp_path, model_type):
    assert_logits_match(save_family(model_type, tmp_path, seed=1), tmp_path, PROMPTS[0])


def test_vocabulary_entries_reach_the_layers(tmp_path):
    """What each family declares lands where the attention backend and the decode program read it."""
    save_family("gemma3_text", tmp_path / "gemma3")
    model = load_for_test(tmp_path / "gemma3").model
    assert [a.sliding_window for a in model.attention_layers] == [8, None, 8, None]
    assert model.attention_layers[0].scale == 16 ** -0.5
    spec = model.decoder_stack()
    assert [layer.structure.rope_table for layer in spec.layers] == ["sliding_attention", "full_attention"] * 2
    assert {layer.structure.norm_offset for layer in spec.layers} == {1.0}
    assert spec.embedding_scale == 8.0 and spec.final_logit_softcap == 5.0

    save_family("gemma2", tmp_path / "gemma2")
    model = load_for_test(tmp_path / "gemma2").model
    assert all(a.impl.logits_soft_cap == 2.0 for a in model.attention_layers)
    assert run_prompt(model, PROMPTS[0]).abs().max() <= 3.0          # the final soft-cap

    save_family("smollm3", tmp_path / "smollm3")
    spec = load_for_test(tmp_path / "smollm3").model.decoder_stack()
    assert [layer.structure.rotary for layer in spec.layers] == ["neox", "neox", "none", "neox"]

    save_family("glm4", tmp_path / "glm4")
    spec = load_for_test(tmp_path / "glm4").model.decoder_stack()
    assert {(layer.structure.rotary, layer.structure.rotary_dim) for layer in spec.layers} == {("gptj", 8)}
    assert all(layer.attn_out_norm is not None and layer.ffn_out_norm is not None for layer in spec.layers)


def test_fused_checkpoint_tensors_split_over_tensor_parallel_shards(tmp_path):
    """Phi-3 stores q/k/v and gate/up fused: the loader splits them into the layer's shards, so a
    rank's slice is its heads' rows, not the first rows of the fused tensor."""
    from tokenmill.core.loaders.weights import _shards
    from tokenmill.core.layers.linear import Linear

    layer = Linear(64, [64, 32, 32])
    fused = torch.arange(128 * 64, dtype=torch.float32).view(128, 64)
    parts = _shards(layer, fused, None)
    assert [part_id for _, part_id in parts] == [0, 1, 2]
    assert [tuple(p.shape) for p, _ in parts] == [(64, 64), (32, 64), (32, 64)]
    assert torch.equal(parts[1][0], fused[64:96])
    apart = fused[:64]                                             # a checkpoint that stores them apart
    [(part, part_id)] = _shards(layer, apart, 0)
    assert part is apart and part_id == 0


def test_families_listed_as_native(tmp_path):
    from tokenmill.core.models.features import architecture_rows
    rows = {row["name"]: row for row in architecture_rows()}
    for name in ARCHITECTURES.values():
        assert rows[name]["implementation"] == "native" and rows[name]["state"] == "loaded", name
    assert all(rows[name]["features"]["fast_path"]["supported"] for name in ARCHITECTURES.values())
    assert rows["Olmo2ForCausalLM"]["features"]["tp"]["supported"] is False


@pytest.mark.parametrize("model_type", ["gemma3_text", "phi3"])
def test_server_answers_as_transformers(tmp_path, model_type):
    """`tokenmill serve DIR` through the openai SDK: transformers' greedy tokens."""
    hf = save_family(model_type, tmp_path)
    prompts = PROMPTS[:2]
    expected = hf_greedy(hf, prompts)
    assert_server_greedy(tmp_path, prompts, expected)


@pytest.mark.parametrize("model_type", ["phi3", "gemma3_text", "starcoder2"])
def test_tp2_matches_transformers(tmp_path, model_type):
    """At tensor_parallel_size=2 each rank loads its heads' rows of Phi-3's fused q/k/v and gate/up,
    Gemma 3's sandwich norms and q/k norms, StarCoder2's biased plain MLP: transformers' tokens."""
    hf = save_family(model_type, tmp_path)
    prompts = PROMPTS[:2]
    expected = hf_greedy(hf, prompts)
    llm = make_llm(tmp_path, tensor_parallel_size=2)
    try:
        assert [list(o.outputs[0].token_ids) for o in generate(llm, prompts)] == expected
    finally:
        llm.engine.executor.shutdown()


@pytest.mark.parametrize("model_type,targets", [
    ("gemma3_text", ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]),
    ("starcoder2", ["q_proj", "v_proj", "o_proj", "c_fc", "c_proj"]),
])
def test_lora_adapter_matches_peft(tmp_path, model_type, targets):
    """A PEFT adapter on a family's own module names (StarCoder2's c_fc / c_proj): peft's greedy tokens."""
    from lora_helpers import make_adapter

    from tokenmill.core.lora.request import LoRARequest
    base = save_family(model_type, tmp_path / "base")
    peft_model = make_adapter(str(tmp_path / "base"), str(tmp_path / "adapter"), seed=7, targets=targets)
    prompts = PROMPTS[:2]
    expected = hf_greedy(peft_model, prompts)
    assert expected != hf_greedy(base, prompts)                      # the adapter changes the tokens
    llm = make_llm(tmp_path / "base", enable_lora=True, max_lora_rank=8)
    from tokenmill.core.sampling_params import SamplingParams
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True),
                        lora_request=LoRARequest("a", 1, str(tmp_path / "adapter")), use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outs] == expected
