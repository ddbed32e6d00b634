"""model_impl="transformers" (vLLM's --model-impl): architectures with no native implementation run on
transformers' modeling code over tokenmill's paged KV cache, greedy token for token with transformers'
float32 `generate` (chunked prefill, mixed batches, prefix caching); `auto` / `native` resolution and
the refusals; `tokenmill models --json`."""
from __future__ import annotations

import json
import logging

import pytest
import torch

from model_helpers import (generate, hf_greedy, hf_last_logits, load_for_test, make_llm, run_prompt,
                           save_random_checkpoint, save_tiny_checkpoint)

from tokenmill.core.models.registry import resolve_model_class
from tokenmill.core.models.transformers_impl import TransformersForCausalLM
from tokenmill.plugins import discovery

VOCAB = 1000
SPECIAL = dict(vocab_size=VOCAB, bos_token_id=1, eos_token_id=2, pad_token_id=0)
DIMS = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            max_position_embeddings=256, **SPECIAL)
# Tiny configs of architectures tokenmill has no native implementation of.
ARCHS = {
    "gpt2": dict(n_embd=64, n_layer=2, n_head=4, n_positions=256, **SPECIAL),
    "gpt_neox": dict(DIMS),
    "falcon": dict(DIMS),                                   # multi-query: one KV head
    "stablelm": dict(DIMS, num_key_value_heads=2),
    "phi3": dict(DIMS, num_key_value_heads=2),
    # A window shorter than the prompts on every other layer, attention and final logit soft-caps.
    "gemma2": dict(DIMS, num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=16, sliding_window=8,
                   attn_logit_softcapping=2.0, final_logit_softcapping=3.0),
    "olmo2": dict(DIMS, num_key_value_heads=2),
}
# Mixed lengths over 16-token blocks and 32-token prefill chunks.
PROMPTS = [[3 + (i * 37 + j * 11) % (VOCAB - 3) for j in range(n)] for i, n in enumerate((45, 7, 23, 33))]
MAX_TOKENS = 10


def save_checkpoint(model_type: str, directory: str, seed: int = 0):
    return save_random_checkpoint(model_type, ARCHS[model_type], directory, VOCAB, seed)


@pytest.mark.parametrize("model_type", sorted(ARCHS))
def test_greedy_matches_transformers(tmp_path, model_type):
    hf = save_checkpoint(model_type, str(tmp_path))
    expected = hf_greedy(hf, PROMPTS)
    llm = make_llm(tmp_path, model_impl="transformers")
    assert isinstance(llm.engine.bundle.model, TransformersForCausalLM)
    first = generate(llm, PROMPTS)
    assert [list(o.outputs[0].token_ids) for o in first] == expected
    # The same prompts again: their full blocks come from the prefix cache, tokens unchanged.
    second = generate(llm, PROMPTS)
    assert [list(o.outputs[0].token_ids) for o in second] == expected
    assert second[0].num_cached_tokens >= 32 and second[3].num_cached_tokens >= 32


def test_gemma2_window_and_soft_caps(tmp_path):
    """The window on every other layer, the attention soft-cap and the final logit soft-cap (which
    greedy tokens cannot show): logits equal to transformers'."""
    hf = save_checkpoint("gemma2", str(tmp_path))
    model = load_for_test(tmp_path, model_impl="transformers").model
    assert [layer.sliding_window for layer in model.attention_layers] == [8, None]
    assert all(layer.impl.logits_soft_cap == 2.0 for layer in model.attention_layers)
    assert model.attention_layers[0].scale == 16 ** -0.5
    ours = run_prompt(model, PROMPTS[0])
    assert ours.abs().max() <= 3.0
    torch.testing.assert_close(ours, hf_last_logits(hf, PROMPTS[0]), atol=1e-4, rtol=1e-4)


def test_llama_through_transformers_matches_native(tmp_path):
    save_tiny_checkpoint("llama", str(tmp_path))
    prompts = PROMPTS[:3]
    tokens = {}
    for impl in ("native", "transformers"):
        llm = make_llm(tmp_path, model_impl=impl)
        assert isinstance(llm.engine.bundle.model, TransformersForCausalLM) == (impl == "transformers")
        tokens[impl] = [list(o.outputs[0].token_ids) for o in generate(llm, prompts)]
        del llm
    assert tokens["native"] == tokens["transformers"]


def test_auto_picks_native_when_registered_else_transformers(tmp_path):
    save_checkpoint("gpt2", str(tmp_path / "gpt2"))
    bundle = load_for_test(tmp_path / "gpt2")                       # model_impl="auto"
    assert isinstance(bundle.model, TransformersForCausalLM) and bundle.architecture == "GPT2LMHeadModel"
    save_tiny_checkpoint("llama", str(tmp_path / "llama"))
    assert not isinstance(load_for_test(tmp_path / "llama").model, TransformersForCausalLM)


def test_native_on_unregistered_architecture_names_it(tmp_path):
    save_checkpoint("gpt_neox", str(tmp_path))
    with pytest.raises(ValueError, match="model_impl='native'.*GPTNeoXForCausalLM.*model_impl='transformers'"):
        load_for_test(tmp_path, model_impl="native")


def _tiny_config(model_type: str, **overrides):
    import transformers
    return transformers.AutoConfig.for_model(model_type, **dict(DIMS, **overrides))


@pytest.mark.parametrize("model_type,overrides,why", [
    ("bloom", {}, "do not accept a registered attention function"),
    ("falcon", {"alibi": True}, "ALiBi"),
])
def test_neither_implementation_names_both_reasons(model_type, overrides, why):
    config = _tiny_config(model_type, **overrides)
    arch = config.architectures[0] if config.architectures else None
    with pytest.raises(ValueError) as info:
        resolve_model_class(config, discovery.model_architectures(), "auto")
    message = str(info.value)
    assert "no native implementation of" in message and "transformers: " in message and why in message
    assert (arch or model_type) in message
    with pytest.raises(ValueError, match="model_impl='transformers' cannot run"):
        resolve_model_class(config, discovery.model_architectures(), "transformers")


def test_bad_model_impl_is_refused():
    with pytest.raises(ValueError, match="model_impl must be one of auto, native, transformers"):
        resolve_model_class(_tiny_config("gpt2"), discovery.model_architectures(), "jax")


@pytest.mark.parametrize("kwargs,names", [
    ({"tensor_parallel_size": 2}, "tensor_parallel_size=2"),
    ({"pipeline_parallel_size": 2}, "pipeline_parallel_size=2"),
    ({"enable_lora": True}, "enable_lora"),
    ({"quantization": "int4"}, "quantization 'int4'"),
    ({"runner": "pooling"}, "runner 'pooling'"),
])
def test_refusals(tmp_path, kwargs, names):
    from tokenmill.platforms.cpu import CpuPlatform
    save_checkpoint("gpt2", str(tmp_path))
    with pytest.raises(ValueError, match=names) as info:
        load_for_test(tmp_path, model_impl="transformers", platform=CpuPlatform(), **kwargs)
    assert "model_impl='transformers'" in str(info.value)


def test_fast_path_falls_back_to_eager(tmp_path, caplog):
    """bfloat16 asks the cpu platform for its fused decode step; a transformers model has no
    decoder_stack(), so it says so and runs eagerly."""
    save_checkpoint("gpt2", str(tmp_path))
    with caplog.at_level(logging.INFO, logger="tokenmill.platforms.cpu"):
        llm = make_llm(tmp_path, model_impl="transformers", dtype="bfloat16", graph_capture="fused_decode")
    assert "fused_decode: running the model eagerly" in caplog.text
    out = generate(llm, PROMPTS[:2], max_tokens=4)
    assert all(len(o.outputs[0].token_ids) == 4 for o in out)


def test_server_with_model_impl_transformers(tmp_path):
    """`tokenmill serve DIR --model-impl transformers` through the openai SDK: transformers' greedy tokens."""
    import openai

    from tokenmill.entrypoints.openai.testing import ServerProcess
    hf = save_checkpoint("gpt_neox", str(tmp_path))
    prompts = PROMPTS[:2]
    expected = hf_greedy(hf, prompts)
    args = [str(tmp_path), "--model-impl", "transformers", "--device", "cpu", "--dtype", "float32",
            "--served-model-name", "neox", "--num-threads", "1", "--kv-cache-memory", str(16 << 20),
            "--generation-config", "none", "--disable-access-log"]
    with ServerProcess(args) as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=120)
        for prompt, want in zip(prompts, expected):
            out = client.completions.create(model="neox", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                                            logprobs=0, extra_body={"ignore_eos": True,
                                                                    "return_tokens_as_token_ids": True})
            assert [int(t.split(":")[1]) for t in out.choices[0].logprobs.tokens] == want


def test_models_json(capsys, monkeypatch):
    """Every registered architecture (a plugin's too, inheriting or not declaring its features) with
    its implementation and features, and the transformers fallback."""
    import importlib.metadata

    from torch import nn

    from tokenmill.core.models.llama import LlamaForCausalLM
    from tokenmill.entrypoints.cli import main
    from tokenmill.plugins import registry

    class PluginLlama(LlamaForCausalLM):
        pass

    class PluginBare(nn.Module):
        pass

    real = registry._extensions

    def with_plugins(group):
        got, failed = real(group)
        if group == "tokenmill.model_architectures":
            got = got + [(importlib.metadata.EntryPoint(name, f"fake:{cls.__name__}", group), cls)
                         for name, cls in (("PluginLlamaForCausalLM", PluginLlama), ("PluginBareLM", PluginBare))]
        return got, failed

    monkeypatch.setattr(registry, "_extensions", with_plugins)
    discovery.clear_caches()
    try:
        assert main(["models", "--json"]) == 0
    finally:
        discovery.clear_caches()
    data = json.loads(capsys.readouterr().out)
    rows = {r["name"]: r for r in data["architectures"]}
    assert {"LlamaForCausalLM", "Qwen3ForCausalLM", "BertModel", "PluginLlamaForCausalLM", "PluginBareLM"} <= set(rows)
    llama = rows["LlamaForCausalLM"]
    assert llama["implementation"] == "native" and llama["package"] == "tokenmill"
    assert all(llama["features"][f]["supported"] for f in ("tp", "pp", "lora", "quantization", "fast_path",
                                                           "sliding_window", "pooling"))
    assert rows["PluginLlamaForCausalLM"]["features"] == llama["features"]
    bare = rows["PluginBareLM"]["features"]
    assert bare["fast_path"]["supported"] is False and bare["tp"]["supported"] is None
    assert rows["BertModel"]["features"]["tp"]["supported"] is False and rows["BertModel"]["features"]["tp"]["detail"]
    fallback = data["transformers"]
    assert fallback["implementation"] == "transformers" and fallback["available"]
    assert "--model-impl transformers" in fallback["note"]
    assert fallback["features"]["lora"]["supported"] is False and "adapters" in fallback["features"]["lora"]["detail"]
    assert "int4" in data["quantization_methods"]
