"""The native dense families on the cpu platform's fast decode path (platforms/cpu_fused_decode.py):
every family whose layers are in the native step's vocabulary decodes through it — (1 + w) and
sandwich / post norms, LayerNorm, GeGLU / GELU / xIELU, plain FFNs, partial and GPT-J rotary, NoPE
layers, per-layer rope tables, q/k norms per head and over the projection, parallel blocks, residual
and embedding scales, attention soft-capping — with the hidden states of a decode step matching the
eager model's, in bf16 and int4; sliding and full layers read their own KV group's block tables (hybrid KV); a layer the
step does not express runs eagerly between native ranges and the log says which."""
from __future__ import annotations

import dataclasses
import logging

import pytest
import torch

from model_helpers import fused_and_eager_decode, generate, make_llm, save_tiny_checkpoint
from family_configs import FAMILIES, PROMPTS, save_family

from tokenmill.core.models.llama import LlamaForCausalLM
from tokenmill.platforms import cpu_decode_kernels as native
from tokenmill.platforms.interface import DecoderStackSpec
from tokenmill.plugins import discovery

pytestmark = pytest.mark.skipif(native.NativeHeadKernel.available() is not None,
                                reason=f"fused decode kernels unavailable: {native.NativeHeadKernel.available()}")

MODES = {"bfloat16": dict(dtype="bfloat16"), "int4": dict(quantization="int4", kv_cache_dtype="bfloat16")}


def _fast_llm(path, mode: str, **kwargs):
    if mode == "bfloat16" and not native.LIBRARY.require().fused_decode_caps() & 2:
        pytest.skip("no AVX512-BF16")
    return make_llm(path, **{**dict(dtype="float32", max_num_batched_tokens=64), **MODES[mode], **kwargs})


@pytest.mark.parametrize("mode", sorted(MODES))
@pytest.mark.parametrize("model_type", sorted(FAMILIES))
def test_every_family_decodes_through_the_native_step(tmp_path, model_type, mode):
    save_family(model_type, tmp_path)
    # One block table for all layers: the comparison below builds its own single-table metadata.
    llm = _fast_llm(tmp_path, mode, disable_hybrid_kv_cache_manager=True)
    report = llm.engine.runner.fast_path_report()
    assert report["took_the_model"], report
    assert llm.engine.runner.decode_program.eager_layers == []
    fused, eager = fused_and_eager_decode(llm, PROMPTS[0])
    cosine = torch.nn.functional.cosine_similarity(fused, eager, dim=-1)
    assert cosine.min() > 0.995, cosine
    out = generate(llm, PROMPTS[:2], max_tokens=4)
    assert llm.engine.runner.forward.last_path == "fused_decode"
    assert all(len(o.outputs[0].token_ids) == 4 for o in out)


@pytest.mark.parametrize("model_type", ["gemma3_text", "cohere2", "exaone4"])
def test_sliding_and_full_layers_read_their_own_block_tables(tmp_path, model_type):
    """Hybrid KV on (sliding layers keep only their window's blocks, the blocks behind it freed):
    the fused step reads each layer's group's tables and gives the tokens it gives with one table
    for all layers, over prompts longer than the window."""
    save_family(model_type, tmp_path)
    hybrid = _fast_llm(tmp_path, "bfloat16")
    runner = hybrid.engine.runner
    assert runner.kv_layout.hybrid and len(runner.kv_layout.groups) > 1
    assert runner.fast_path_report()["took_the_model"]
    got = [list(o.outputs[0].token_ids) for o in generate(hybrid, PROMPTS, max_tokens=12)]
    assert runner.forward.last_path == "fused_decode"
    one_table = _fast_llm(tmp_path, "bfloat16", disable_hybrid_kv_cache_manager=True)
    assert got == [list(o.outputs[0].token_ids) for o in generate(one_table, PROMPTS, max_tokens=12)]


class MoeLayersForCausalLM(LlamaForCausalLM):
    """Llama whose decoder_stack() declares some layers' FFN an expert FFN: a vocabulary entry the
    native step does not express, so those layers run eagerly between native ones."""
    moe_layers: tuple[int, ...] = (1,)

    def decoder_stack(self) -> DecoderStackSpec:
        spec = super().decoder_stack()
        for i in self.moe_layers:
            spec.layers[i].structure = dataclasses.replace(spec.layers[i].structure, ffn="moe")
        return spec


@pytest.mark.parametrize("moe_layers,logged", [
    ((1,), "layers 1 run eagerly between native ranges: layers 1: ffn moe"),
    ((0, 2), "layers 0,2 run eagerly between native ranges: layers 0,2: ffn moe")])
def test_a_layer_outside_the_vocabulary_runs_eagerly_between_native_ones(tmp_path, monkeypatch, caplog, moe_layers,
                                                                        logged):
    """Layer 1 eager: native, eager, native. Layers 0 and 2: the embedding and the final norm as
    native calls of their own around them."""
    import json
    monkeypatch.setattr(MoeLayersForCausalLM, "moe_layers", moe_layers)
    known = dict(discovery.model_architectures())
    known[MoeLayersForCausalLM.__name__] = MoeLayersForCausalLM
    monkeypatch.setattr(discovery, "model_architectures", lambda: known)
    save_tiny_checkpoint("llama", str(tmp_path), num_hidden_layers=3)
    config = json.loads((tmp_path / "config.json").read_text())
    config["architectures"] = [MoeLayersForCausalLM.__name__]
    (tmp_path / "config.json").write_text(json.dumps(config))
    with caplog.at_level(logging.INFO, logger="tokenmill.platforms.cpu"):
        llm = _fast_llm(tmp_path, "bfloat16")
    runner = llm.engine.runner
    assert runner.decode_program.eager_layers == list(moe_layers)
    assert any(logged in r.getMessage() for r in caplog.records)
    fused, eager = fused_and_eager_decode(llm, PROMPTS[0])
    assert torch.nn.functional.cosine_similarity(fused, eager, dim=-1).min() > 0.995
    got = [list(o.outputs[0].token_ids) for o in generate(llm, PROMPTS, max_tokens=8)]
    assert runner.forward.last_path == "fused_decode"
    assert all(len(tokens) == 8 for tokens in got)
