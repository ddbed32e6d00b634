"""Our models against transformers' float32 reference, on tiny random-weight checkpoints."""
from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
from model_helpers import hf_last_logits, run_prompt, save_tiny_checkpoint, single_sequence_metadata  # noqa: E402

from tokenmill.attention_backends.reference import ReferenceAttention  # noqa: E402
from tokenmill.core.loaders.loader import load_model  # noqa: E402
from tokenmill.core.models.registry import resolve_architecture  # noqa: E402

PROMPT = [5, 17, 256, 999, 3, 42, 42, 7, 100, 512, 64, 1, 0, 880, 23, 19, 301, 77, 640, 12, 9]  # 21 tokens


def _load(path):
    return load_model(str(path), None, dtype=torch.float32, device=torch.device("cpu"),
                      attn_backend_cls=ReferenceAttention)


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
    bundle = _load(tmp_path)
    assert bundle.architecture == hf_model.config.architectures[0]
    assert bundle.max_model_len == hf_model.config.max_position_embeddings
    assert [layer for layer in bundle.model.attention_layers] and len(bundle.model.attention_layers) == 2
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
    bundle = load_model(str(tmp_path), None, torch.bfloat16, torch.device("cpu"), ReferenceAttention)
    assert next(bundle.model.parameters()).dtype == torch.bfloat16
    logits = run_prompt(bundle.model, PROMPT)
    assert logits.dtype == torch.float32 and torch.isfinite(logits).all()


def test_unknown_architecture_lists_registered():
    with pytest.raises(ValueError) as info:
        resolve_architecture(["GPTNeoXForCausalLM"])
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

    assert resolve_architecture(["LlamaForCausalLM"], {"LlamaForCausalLM": PluginLlama}) is PluginLlama
    assert resolve_architecture(["Mine"], {"Mine": PluginLlama}) is PluginLlama


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
    """A tiny model written as llama.cpp would (permuted Q/K for llama) loads back to the HF network."""
    from model_helpers import write_tiny_gguf
    from tokenmill.core.loaders import gguf_loader
    from tokenmill.core.loaders.gguf_file import GGUFFile
    hf_model = save_tiny_checkpoint(kind, str(tmp_path / "hf"), **overrides)
    path = str(tmp_path / "tiny.gguf")
    write_tiny_gguf(hf_model, path, "llama" if kind == "llama3" else kind)
    gguf = GGUFFile(path)
    config = gguf_loader.gguf_config(gguf)
    assert config.architectures == [hf_model.config.architectures[0]]
    assert config.tie_word_embeddings == hf_model.config.tie_word_embeddings
    model_cls = resolve_architecture(config.architectures)
    model = model_cls(config, ReferenceAttention, torch.float32)
    model.load_weights(gguf_loader.iterate_gguf_weights(gguf, config))
    ours = run_prompt(model.eval(), PROMPT)
    torch.testing.assert_close(ours, hf_last_logits(hf_model, PROMPT), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("tie", [False, True])
def test_packed_linear_kernel_is_bitwise_in_bf16(tmp_path, tie):
    from tokenmill.platforms.cpu_linear import MkldnnPackedLinear, apply_linear_kernel
    if MkldnnPackedLinear.available():
        pytest.skip(MkldnnPackedLinear.available())
    save_tiny_checkpoint("llama", str(tmp_path), tie_word_embeddings=tie)
    model = load_model(str(tmp_path), None, torch.bfloat16, torch.device("cpu"), ReferenceAttention).model
    plain = run_prompt(model, PROMPT)
    assert apply_linear_kernel(model, MkldnnPackedLinear()) == 2 * 4 + 1
    assert torch.equal(run_prompt(model, PROMPT), plain)
