"""The decode program a platform composes from a model's layer spec (platforms/interface.py
DecodeProgram, LayerStructure; the cpu platform's fused_decode): a new dense family written only in
the existing vocabulary runs through it with no C++ and no platform code; layers outside what the
program expresses run eagerly (tests/models/test_family_fast_path.py: between native ones), and the log
says which; `bench throughput --profile` shows which
program and kernels ran."""
from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path

import pytest
import torch

from model_helpers import save_tiny_checkpoint

from tokenmill import LLM, SamplingParams
from tokenmill.core.models.llama import LlamaForCausalLM
from tokenmill.platforms import cpu_decode_kernels as native
from tokenmill.platforms.cpu_fused_decode import outside_vocabulary
from tokenmill.platforms.interface import DecoderStackSpec, LayerStructure
from tokenmill.plugins import discovery

pytestmark = pytest.mark.skipif(native.NativeHeadKernel.available("bf16") is not None,
                                reason=f"bf16 decode kernels unavailable: {native.NativeHeadKernel.available('bf16')}")


class BiasedQkNormForCausalLM(LlamaForCausalLM):
    """A family that exists nowhere: Qwen2's q/k/v biases with Qwen3's per-head q/k norms and a
    sliding window on every other layer, said in the existing layer vocabulary and nothing else."""
    qk_norm = "head"

    @classmethod
    def qkv_bias(cls, config) -> bool:
        return True


class SinksForCausalLM(BiasedQkNormForCausalLM):
    """Declares attention sinks on every layer: no native attention entry has them, so no layer runs
    natively and the whole model runs eagerly."""

    def decoder_stack(self) -> DecoderStackSpec:
        spec = super().decoder_stack()
        for layer in spec.layers:
            layer.structure = dataclasses.replace(layer.structure, attention_sinks=True)
        return spec


def _register(monkeypatch, cls: type) -> None:
    known = dict(discovery.model_architectures())
    known[cls.__name__] = cls
    monkeypatch.setattr(discovery, "model_architectures", lambda: known)


def _checkpoint(tmp_path: Path, architecture: str) -> str:
    """A tiny qwen3-shaped checkpoint with biases, relabelled as `architecture`; the LM head scaled up
    so that greedy choices have margins wider than bf16 rounding."""
    model = save_tiny_checkpoint("qwen3", str(tmp_path), attention_bias=True, sliding_window=8,
                                 layer_types=["sliding_attention", "full_attention"], use_sliding_window=True)
    with torch.no_grad():
        model.lm_head.weight.mul_(6.0)
    model.save_pretrained(str(tmp_path))
    config = json.loads((tmp_path / "config.json").read_text())
    config["architectures"] = [architecture]
    (tmp_path / "config.json").write_text(json.dumps(config))
    return str(tmp_path)


def _greedy(llm: LLM, prompts: list[list[int]], n: int = 12) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                                                          use_tqdm=False)]


def test_a_new_family_in_the_existing_vocabulary_decodes_through_the_fast_program(tmp_path, monkeypatch):
    _register(monkeypatch, BiasedQkNormForCausalLM)
    path = _checkpoint(tmp_path, "BiasedQkNormForCausalLM")
    prompts = [[5 + (7 * i + j) % 900 for j in range(9 + 5 * i)] for i in range(4)]
    fast = LLM(model=path, dtype="bfloat16", max_model_len=256, kv_cache_memory="16MiB")
    runner = fast.engine.runner
    assert hasattr(runner.forward, "fused_step"), runner.fast_path_report()
    report = runner.fast_path_report()
    assert report["decode_program"] == "fused_decode" and report["took_the_model"]
    spec = runner.model.decoder_stack()
    assert spec.layers[0].q_norm is not None and spec.layers[0].qkv.bias is not None
    assert [layer.attention.sliding_window for layer in spec.layers] == [8, None]
    got = _greedy(fast, prompts)
    eager = _greedy(LLM(model=path, dtype="bfloat16", max_model_len=256, kv_cache_memory="16MiB",
                        enforce_eager=True), prompts)
    assert got == eager


def test_a_model_no_layer_of_which_the_program_expresses_runs_eagerly_and_says_why(tmp_path, monkeypatch, caplog):
    _register(monkeypatch, SinksForCausalLM)
    path = _checkpoint(tmp_path, "SinksForCausalLM")
    with caplog.at_level(logging.INFO, logger="tokenmill.platforms.cpu"):
        llm = LLM(model=path, dtype="bfloat16", max_model_len=256, kv_cache_memory="16MiB")
    runner = llm.engine.runner
    assert not hasattr(runner.forward, "fused_step")
    assert any("layers 0-1: attention_sinks True" in r.getMessage() for r in caplog.records)
    report = runner.fast_path_report()
    assert not report["took_the_model"] and "attention_sinks True" in report["eager_reason"]
    assert len(_greedy(llm, [[5, 6, 7]], 3)[0]) == 3


def test_vocabulary_entries_are_grouped_by_layer_ranges():
    sinks = type("L", (), {"structure": LayerStructure(attention_sinks=True)})
    moe = type("L", (), {"structure": LayerStructure(ffn="moe")})
    both = type("L", (), {"structure": LayerStructure(attention_sinks=True, ffn="moe")})
    spec = DecoderStackSpec(embedding=torch.empty(0), final_norm=torch.empty(0), eps=1e-6, cos_sin=torch.empty(0),
                            num_heads=1, num_kv_heads=1, head_size=64, hidden_size=64, intermediate_size=64,
                            layers=[sinks, moe, moe, both])
    assert outside_vocabulary(spec) == ["layers 0,3: attention_sinks True", "layers 1-3: ffn moe"]


def test_bench_profile_prints_the_program_the_kernels_and_the_time_per_path(capsys):
    from tokenmill.entrypoints.cli import main
    assert main(["bench", "throughput", "--workload", "W2", "--dtype", "bfloat16", "--max-model-len", "512",
                 "--kv-cache-memory", "32MiB", "--profile"]) == 0
    out = capsys.readouterr().out
    assert "decode program fused_decode: runs the model" in out
    assert "attention cpu_sdpa (native decode entry: yes)" in out
    assert "layer kernels: " in out and "lm_head native_head" in out
    assert "fused_decode   decode-only" in out and "of decode-step time" in out
