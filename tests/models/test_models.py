"""Our models against transformers' float32 reference, on tiny random-weight checkpoints."""
from __future__ import annotations

import os

import pytest
import torch

from model_helpers import (hf_last_logits, load_for_test, run_prompt, save_tiny_checkpoint,
                           single_sequence_metadata)

from tokenmill.attention_backends.reference import ReferenceAttention
from tokenmill.core.models.registry import resolve_architecture
from tokenmill.plugins import discovery

PROMPT = [5, 17, 256, 999, 3, 42, 42, 7, 100, 512, 64, 1, 0, 880, 23, 19, 301, 77, 640, 12, 9]  # 21 tokens


def _load(path, **kwargs):
    return load_for_test(path, **kwargs)


def _assert_matches(bundle, hf_model, prompt=PROMPT):
    ours = run_prompt(bundle.model, prompt)
    ref = hf_last_logits(hf_model, prompt)
    assert ours.dtype == torch.float32
    torch.testing.assert_close(ours[-1], ref[-1], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(ours, ref, atol=1e-4, rtol=1e-4)
    assert ours[-1].argmax() == ref[-1].argmax()


@pytest.mark.parametrize("kind,overrides", [
    ("llama", {}),
    ("llama3", {}),
    ("llama", {"tie_word_embeddings": True}),
    ("llama", {"attention_bias": True, "mlp_bias": True}),
    ("mistral", {"sliding_window": 8}),
    ("qwen2", {}),
    ("qwen3", {}),
    ("qwen3", {"tie_word_embeddings": True}),
])
def test_matches_transformers(tmp_path, kind, overrides):
    hf_model = save_tiny_checkpoint(kind, str(tmp_path), **overrides)
    seen = []
    bundle = _load(tmp_path, seen=seen)
    assert bundle.architecture == hf_model.config.architectures[0]
    assert bundle.max_model_len == hf_model.config.max_position_embeddings
    assert bundle.weight_dtype == bundle.dtype == torch.float32 and bundle.quantization is None
    # The backend was chosen once, from the geometry, before building: every layer holds it.
    assert len(seen) == 1 and bundle.attention_backend is ReferenceAttention
    assert (seen[0].num_heads, seen[0].num_kv_heads, seen[0].sliding_window) == (4, 2, overrides.get("sliding_window"))
    assert len(bundle.model.attention_layers) == 2
    assert all(isinstance(layer.impl, ReferenceAttention) for layer in bundle.model.attention_layers)
    _assert_matches(bundle, hf_model)
    if overrides.get("tie_word_embeddings"):
        assert bundle.model.lm_head.weight is bundle.model.model.embed_tokens.weight


def test_prefill_then_decode_matches(tmp_path):
    """Feeding the prompt in two steps (prefill chunk, then single-token decodes) through the
    paged cache gives the same logits as one pass."""
    hf_model = save_tiny_checkpoint("llama", str(tmp_path))
    model = _load(tmp_path).model
    ref = hf_last_logits(hf_model, PROMPT)
    from model_helpers import allocate_kv_caches
    allocate_kv_caches(model, num_blocks=4)
    split = 17                                  # crosses a block boundary at 16
    with torch.no_grad():
        model(torch.tensor(PROMPT[:split]), torch.arange(split), single_sequence_metadata(split))
        for pos in range(split, len(PROMPT)):
            hidden = model(torch.tensor([PROMPT[pos]]), torch.tensor([pos]),
                           single_sequence_metadata(1, start_pos=pos))
            torch.testing.assert_close(model.compute_logits(hidden)[0], ref[pos], atol=1e-4, rtol=1e-4)


def test_sharded_checkpoint(tmp_path):
    hf_model = save_tiny_checkpoint("llama", str(tmp_path), max_shard_size="100KB")
    assert os.path.isfile(tmp_path / "model.safetensors.index.json")
    _assert_matches(_load(tmp_path), hf_model)


def test_generation_config_and_eos(tmp_path):
    hf_model = save_tiny_checkpoint("llama", str(tmp_path))
    import json
    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"do_sample": True, "temperature": 0.6, "top_p": 0.9, "eos_token_id": [2, 7]}))
    bundle = _load(tmp_path)
    assert bundle.generation_defaults == {"temperature": 0.6, "top_p": 0.9}
    assert bundle.tokenizer.chat_template
    assert bundle.eos_token_ids[:2] == [2, 7] and len(set(bundle.eos_token_ids)) == len(bundle.eos_token_ids)
    del hf_model


def test_bfloat16_runs(tmp_path):
    save_tiny_checkpoint("qwen3", str(tmp_path))
    bundle = _load(tmp_path, dtype="bfloat16")
    assert next(bundle.model.parameters()).dtype == torch.bfloat16 == bundle.dtype
    logits = run_prompt(bundle.model, PROMPT)
    assert logits.dtype == torch.float32 and torch.isfinite(logits).all()


def test_unknown_architecture_lists_registered():
    with pytest.raises(ValueError) as info:
        resolve_architecture(["GPTNeoXForCausalLM"], discovery.model_architectures())
    message = str(info.value)
    assert "GPTNeoXForCausalLM" in message
    for name in ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"):
        assert name in message


def test_unknown_architecture_from_checkpoint(tmp_path):
    save_tiny_checkpoint("llama", str(tmp_path))
    import json
    config = json.loads((tmp_path / "config.json").read_text())
    config["architectures"] = ["FancyNewForCausalLM"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="FancyNewForCausalLM.*LlamaForCausalLM"):
        _load(tmp_path)


def test_extra_architecture_is_used(tmp_path):
    from tokenmill.core.models.llama import LlamaForCausalLM

    class PluginLlama(LlamaForCausalLM):
        pass

    registered = {**discovery.model_architectures(), "Mine": PluginLlama}
    assert resolve_architecture(["Other", "Mine"], registered) == ("Mine", PluginLlama)
    assert resolve_architecture(["LlamaForCausalLM"], registered) == ("LlamaForCausalLM", LlamaForCausalLM)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_rms_norm_is_bitwise_hf(dtype):
    from transformers.models.llama.modeling_llama import LlamaRMSNorm
    from tokenmill.core.layers.norm import RMSNorm
    torch.manual_seed(0)
    ours, ref = RMSNorm(576, 1e-5, dtype), LlamaRMSNorm(576, eps=1e-5).to(dtype)
    with torch.no_grad():
        ours.weight.copy_(torch.randn(576))
        ref.weight.copy_(ours.weight)
    x, residual = (torch.randn(2, 37, 576) * 4).to(dtype), torch.randn(2, 37, 576).to(dtype)
    assert torch.equal(ours(x), ref(x))
    normed, summed = ours(x, residual)
    assert torch.equal(summed, x + residual) and torch.equal(normed, ref(x + residual))


@pytest.mark.parametrize("kind,overrides", [
    ("llama", {}), ("llama", {"tie_word_embeddings": True}), ("llama3", {}), ("qwen2", {}), ("qwen3", {}),
])
def test_gguf_checkpoint_matches_transformers(tmp_path, kind, overrides):
    """A tiny model written as llama.cpp would (permuted Q/K for llama) loads back, through the
    same generic loader as HF directories, to the HF network."""
    from model_helpers import write_tiny_gguf
    hf_model = save_tiny_checkpoint(kind, str(tmp_path / "hf"), **overrides)
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(hf_model, str(path), "llama" if kind == "llama3" else kind)
    bundle = _load(path, tokenizer=str(tmp_path / "hf"))
    assert bundle.source.kind == "gguf" and bundle.architecture == hf_model.config.architectures[0]
    assert bundle.hf_config.tie_word_embeddings == hf_model.config.tie_word_embeddings
    ours = run_prompt(bundle.model, PROMPT)
    torch.testing.assert_close(ours, hf_last_logits(hf_model, PROMPT), atol=1e-4, rtol=1e-4)


def _tiny_llama(tmp_path):
    from tokenmill.core.models.llama import LlamaForCausalLM
    hf_model = save_tiny_checkpoint("llama", str(tmp_path))
    return hf_model, LlamaForCausalLM(hf_model.config, ReferenceAttention, torch.float32)


def test_load_weights_reports_missing_and_unexpected(tmp_path):
    from tokenmill.core.loaders.weights import load_weights
    hf_model, model = _tiny_llama(tmp_path)
    state = {k: v for k, v in hf_model.state_dict().items() if k != "model.layers.1.self_attn.k_proj.weight"}
    with pytest.raises(ValueError, match=r"lacks weights for: model\.layers\.1\.self_attn\.qkv_proj\.weight\[1\]$"):
        load_weights(model, state.items())
    with pytest.raises(ValueError, match="'model.extra.weight' has no place"):
        load_weights(model, [*hf_model.state_dict().items(), ("model.extra.weight", torch.zeros(1))])
    wrong = dict(hf_model.state_dict(), **{"model.norm.weight": torch.zeros(3)})
    with pytest.raises(ValueError, match="'model.norm.weight'.*shape mismatch"):
        load_weights(model, wrong.items())


def test_every_parameter_has_a_weight_loader(tmp_path):
    _, model = _tiny_llama(tmp_path)
    assert all(callable(getattr(p, "weight_loader", None)) for p in model.parameters())


@pytest.mark.parametrize("tie", [False, True])
def test_packed_linear_kernel_is_bitwise_in_bf16(tmp_path, tie):
    from tokenmill.core.layers.kernels import apply_layer_kernels
    from tokenmill.platforms.cpu_linear import MkldnnPackedLinear
    if MkldnnPackedLinear.available():
        pytest.skip(MkldnnPackedLinear.available())
    save_tiny_checkpoint("llama", str(tmp_path), tie_word_embeddings=tie)
    model = _load(tmp_path, dtype="bfloat16").model
    plain = run_prompt(model, PROMPT)
    kernel = MkldnnPackedLinear()
    assert apply_layer_kernels(model, {"linear": kernel, "lm_head": kernel}) == 2 * 4 + 1
    assert torch.equal(run_prompt(model, PROMPT), plain)
    with pytest.raises(ValueError, match="unknown layer kinds"):
        apply_layer_kernels(model, {"lienar": kernel})
