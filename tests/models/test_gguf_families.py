"""GGUF files of the dense families llama.cpp's converter writes (core/loaders/gguf_families.py).

Each family's tiny random HF checkpoint is converted the way convert_hf_to_gguf.py lays it out
(tests/gguf_writers.py convert_hf_checkpoint: its metadata keys, gguf-py's tensor names, its
transforms: q/k permuted, Gemma norms + 1, fused q/k/v and gate/up kept fused). F32 files load to
greedy tokens identical to transformers' float32 `generate` on the HF checkpoint; Q8_0 files (the
converter's --outtype q8_0) to logits close to it, dequantized at load and kept quantized. Then the
values llama.cpp hardcodes where the file is silent, and the error for an architecture not read.
"""
from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q, GGUFWriter

from gguf_writers import convert_hf_checkpoint
from model_helpers import (generate, hf_greedy, hf_last_logits, load_for_test, make_llm, run_prompt,
                           save_random_checkpoint)

from tokenmill.core.loaders.gguf_file import GGUFFile
from tokenmill.core.loaders.gguf_loader import GGUF_ARCHITECTURES, gguf_config

torch.set_num_threads(1)

VOCAB = 1000
DIMS = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
            max_position_embeddings=256, vocab_size=VOCAB, bos_token_id=1, eos_token_id=2, pad_token_id=0)
WINDOW = dict(sliding_window=8)            # shorter than the prompts
# case -> (HF model_type, GGUF architecture, config, our class). Configs stay within what the
# converter writes and llama.cpp reads: Gemma's query_pre_attn_scalar is head_dim (llama.cpp derives
# it), SmolLM3 NoPE every fourth layer, GLM's eps 1e-5 (chatglm writes its layernorm_epsilon default),
# StarCoder2 without a window (none is written).
CASES = {
    "gemma2": ("gemma2", "gemma2", dict(DIMS, head_dim=16, query_pre_attn_scalar=16, attn_logit_softcapping=2.0,
                                        final_logit_softcapping=3.0, **WINDOW), "Gemma2ForCausalLM"),
    "gemma3": ("gemma3_text", "gemma3", dict(DIMS, num_hidden_layers=6, head_dim=16, query_pre_attn_scalar=16,
                                             rope_parameters={"sliding_attention": {"rope_type": "default",
                                                                                    "rope_theta": 10000.0},
                                                              "full_attention": {"rope_type": "linear", "factor": 2.0,
                                                                                 "rope_theta": 1000000.0}},
                                             **WINDOW), "Gemma3ForCausalLM"),
    "phi3": ("phi3", "phi3", dict(DIMS, partial_rotary_factor=0.5, tie_word_embeddings=False), "Phi3ForCausalLM"),
    "phi3-longrope": ("phi3", "phi3", dict(DIMS, partial_rotary_factor=0.5, original_max_position_embeddings=64,
                                           rope_scaling={"rope_type": "longrope", "long_factor": [1.0, 1.5, 2.0, 3.0],
                                                         "short_factor": [1.0, 1.1, 1.2, 1.4]}), "Phi3ForCausalLM"),
    "olmo2": ("olmo2", "olmo2", dict(DIMS), "Olmo2ForCausalLM"),
    "olmo3": ("olmo3", "olmo2", dict(DIMS, **WINDOW), "Olmo3ForCausalLM"),
    "granite": ("granite", "granite", dict(DIMS, embedding_multiplier=3.0, residual_multiplier=0.5,
                                           attention_multiplier=0.2, logits_scaling=2.0), "GraniteForCausalLM"),
    "glm": ("glm", "chatglm", dict(DIMS, head_dim=16, attention_bias=True, rms_norm_eps=1e-5), "GlmForCausalLM"),
    "glm4": ("glm4", "glm4", dict(DIMS, head_dim=16, attention_bias=True), "Glm4ForCausalLM"),
    "cohere2": ("cohere2", "cohere2", dict(DIMS, logit_scale=0.5, **WINDOW), "Cohere2ForCausalLM"),
    "exaone4": ("exaone4", "exaone4", dict(DIMS, **WINDOW), "Exaone4ForCausalLM"),
    "smollm3": ("smollm3", "smollm3", dict(DIMS), "SmolLM3ForCausalLM"),
    "starcoder2": ("starcoder2", "starcoder2", dict(DIMS, use_bias=True, sliding_window=None), "Starcoder2ForCausalLM"),
}
# Longer than every window, and within the 64 positions the chatglm file states (its converter writes
# the hidden size as context length for GlmForCausalLM) and Phi-3's original length (short factors).
PROMPTS = [[3 + (i * 37 + j * 11) % (VOCAB - 3) for j in range(n)] for i, n in enumerate((29, 13))]
MAX_TOKENS = 8


def _convert(tmp_path, case: str, qtype: Q = Q.F32, seed: int = 0):
    model_type, arch, config, _ = CASES[case]
    hf_dir = tmp_path / "hf"
    hf = save_random_checkpoint(model_type, config, str(hf_dir), VOCAB, seed)
    path = tmp_path / f"{case}.{qtype.name}.gguf"
    convert_hf_checkpoint(str(hf_dir), str(path), arch, qtype)
    return hf, str(path), str(hf_dir)


@pytest.mark.parametrize("case", sorted(CASES))
def test_f32_greedy_matches_transformers(tmp_path, case):
    hf, path, hf_dir = _convert(tmp_path, case)
    expected = hf_greedy(hf, PROMPTS, MAX_TOKENS)
    llm = make_llm(path, tokenizer=hf_dir)
    assert llm.engine.bundle.source.kind == "gguf"
    assert type(llm.engine.bundle.model).__name__ == CASES[case][3]
    assert [list(o.outputs[0].token_ids) for o in generate(llm, PROMPTS, MAX_TOKENS)] == expected
    logits = run_prompt(llm.engine.bundle.model, PROMPTS[0])
    torch.testing.assert_close(logits, hf_last_logits(hf, PROMPTS[0]), atol=2e-4, rtol=2e-4)


@pytest.mark.parametrize("case", sorted(CASES))
def test_q8_0_logits_close_to_transformers(tmp_path, case):
    hf, path, hf_dir = _convert(tmp_path, case, Q.Q8_0, seed=1)
    got, want = run_prompt(load_for_test(path, tokenizer=hf_dir).model, PROMPTS[0]), hf_last_logits(hf, PROMPTS[0])
    rel = ((got - want).norm() / want.norm()).item()
    # 8-bit weights with fp16 block scales (embedding and head too) on logits this flat: a few percent.
    assert rel < 0.06, rel
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() >= 0.85


@pytest.mark.parametrize("case", ["phi3", "glm4", "glm", "gemma3", "granite"])
def test_q8_0_kept_quantized(tmp_path, case):
    """quantization="gguf": the blocks stay as stored, fused q/k/v and gate/up split by whole rows,
    permuted q/k rows moved back. Dequantized a tile at a time (no native kernels): the dequantized
    file's logits; with the cpu platform's kernels, to their int8-activation rounding."""
    from tokenmill.platforms.cpu import CpuPlatform
    from tokenmill.platforms.interface import QuantKernels

    class TiledCpu(CpuPlatform):
        def quantization_kernels(self, name):
            return QuantKernels()

    _, path, hf_dir = _convert(tmp_path, case, Q.Q8_0, seed=2)
    want = run_prompt(load_for_test(path, tokenizer=hf_dir).model, PROMPTS[0])
    for platform, bound in ((TiledCpu(), 1e-5), (CpuPlatform(), 0.04)):
        kept = load_for_test(path, platform=platform, quantization="gguf", tokenizer=hf_dir).model
        assert [p for m in kept.modules() for p in getattr(m, "gguf_parts", [])]
        got = run_prompt(kept, PROMPTS[0])
        assert ((got - want).norm() / want.norm()).item() < bound
        assert (got.argmax(-1) == want.argmax(-1)).float().mean() >= 0.85


_FILES = itertools.count()


def _metadata_file(tmp_path, arch: str, layers: int = 4, **keys) -> GGUFFile:
    """A GGUF of `arch` with the network's sizes, these extra `{arch}.` keys, and a token embedding."""
    path = str(tmp_path / f"{arch}-{next(_FILES)}.gguf")
    w = GGUFWriter(path, arch)
    w.add_block_count(layers)
    w.add_embedding_length(64)
    w.add_feed_forward_length(128)
    w.add_head_count(4)
    w.add_head_count_kv(2)
    for key, value in keys.items():
        w.add_key_value(f"{arch}.{key}", value, *_value_type(value))
    w.add_tensor("token_embd.weight", np.zeros((32, 64), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return GGUFFile(path)


def _value_type(value):
    from gguf import GGUFValueType as V
    if isinstance(value, list):
        return V.ARRAY, V.BOOL
    return (V.FLOAT32,) if isinstance(value, float) else (V.UINT32,)


def _config(tmp_path, arch: str, layers: int = 4, **keys):
    return gguf_config(_metadata_file(tmp_path, arch, layers, **keys))


def test_llama_cpp_rules_where_the_file_is_silent(tmp_path):
    # Gemma: queries scaled by 1/sqrt(hidden / heads) for the 27B (46 / 62 layers), else 1/sqrt(head_dim).
    head_dim = {"attention.key_length": 32}
    assert _config(tmp_path, "gemma2", 46, **head_dim).query_pre_attn_scalar == 16
    assert _config(tmp_path, "gemma2", 4, **head_dim).query_pre_attn_scalar == 32
    assert _config(tmp_path, "gemma3", 62, **head_dim).query_pre_attn_scalar == 16
    # Gemma 3: five local layers to a global one, the local ones at base 10000 unless the file says.
    g3 = _config(tmp_path, "gemma3", 6, **{"attention.sliding_window": 8, "rope.freq_base": 1e6})
    assert g3.layer_types == ["sliding_attention"] * 5 + ["full_attention"] and g3.sliding_window == 8
    assert g3.rope_parameters["sliding_attention"]["rope_theta"] == 10000.0
    assert g3.rope_parameters["full_attention"]["rope_theta"] == 1e6
    # Gemma 2 alternates, starting local; Cohere 2 has three local layers to a global one.
    window = {"attention.sliding_window": 8}
    assert _config(tmp_path, "gemma2", **window).layer_types == ["sliding_attention", "full_attention"] * 2
    assert _config(tmp_path, "cohere2", **window).layer_types == ["sliding_attention"] * 3 + ["full_attention"]
    # OLMo 2 files with a window are OLMo 3; a stored pattern wins over the default period.
    assert type(_config(tmp_path, "olmo2")).__name__ == "Olmo2Config"
    olmo3 = _config(tmp_path, "olmo2", **window, **{"attention.sliding_window_pattern": [True, False] * 2})
    assert olmo3.architectures == ["Olmo3ForCausalLM"]
    assert olmo3.layer_types == ["sliding_attention", "full_attention"] * 2
    exaone4 = _config(tmp_path, "exaone4", 6, **window, **{"attention.sliding_window_pattern": 3})
    assert exaone4.layer_types == ["sliding_attention", "sliding_attention", "full_attention"] * 2
    assert _config(tmp_path, "exaone4").layer_types == ["full_attention"] * 4        # no window: rope everywhere
    # SmolLM3: no rope on every fourth layer; Granite without attention.scale: 1/sqrt(head_dim).
    assert _config(tmp_path, "smollm3", 8).no_rope_layers == [1, 1, 1, 0] * 2
    assert _config(tmp_path, "granite").attention_multiplier == 16 ** -0.5
    # Phi-4's converter writes window 0 for "none"; GLM rotates half a head unless the file says.
    assert _config(tmp_path, "phi3", **{"attention.sliding_window": 0}).sliding_window is None
    assert _config(tmp_path, "glm4").rope_parameters["partial_rotary_factor"] == 0.5


def test_unsupported_architecture_names_the_supported_ones(tmp_path):
    gguf = _metadata_file(tmp_path, "mamba")
    with pytest.raises(ValueError, match="GGUF architecture 'mamba' is not supported; supported:") as err:
        gguf_config(gguf)
    assert all(repr(arch) in str(err.value) for arch in GGUF_ARCHITECTURES)
    assert {"gemma2", "gemma3", "phi3", "olmo2", "granite", "chatglm", "glm4", "cohere2", "exaone4", "smollm3",
            "starcoder2", "llama", "qwen3"} <= set(GGUF_ARCHITECTURES)
    with pytest.raises(ValueError, match="supported: .*'gemma3'"):
        load_for_test(gguf.path)
