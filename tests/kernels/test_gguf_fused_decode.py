"""quantization="gguf" through the cpu platform's fused decode step (platforms/cpu_fused_decode.py):
the GGUF method's natively packed parts are multiplied in place by the same kernels its eager
matmuls call, the stored embedding is looked up by the model's own `embed`, and the LM head stays
the method's. So a decode step agrees with the eager gguf path to float rounding, greedy tokens are
the same, no weight is copied, and a layer in a tiled format sends the model back to eager.

Tiny random llama GGUF files written by tests/gguf_writers.py (as tests/models/test_gguf_native.py).
"""
from __future__ import annotations

import logging
import os

import pytest
import torch
from gguf import GGMLQuantizationType as Q

from gguf_writers import tiny_llama_tensors, write_gguf
from model_helpers import tiny_tokenizer

from tokenmill.quantization.interface import PlatformPacked
from tokenmill import LLM, SamplingParams
from tokenmill.core.loaders.resident import resident_weight_bytes
from tokenmill.platforms import cpu_decode_kernels as native
from tokenmill.platforms.cpu_gguf_kernels import available as kernels_available

pytestmark = pytest.mark.skipif(kernels_available() is not None or native.NativeHeadKernel.available() is not None,
                                reason="no native GGUF / fused decode kernels here")

DIMS = dict(layers=2, hidden=256, intermediate=512, heads=4, kv_heads=2, vocab=1024)
PROMPT = [1, 17, 400, 23, 99, 512, 7, 1000, 3, 250, 64, 800, 5, 42, 333, 901, 11, 600, 77, 128]
MAX_RATIO = 1.10            # resident weights (model + what the fused step keeps) / file bytes
# Both paths quantize activations to int8 per 32 with the same kernels; the fused step's norms,
# rope and SiLU differ from the eager ones only in float rounding.
MAX_RELATIVE = 1e-5


def _write(tmp_path, choose) -> tuple[str, str]:
    """A tiny llama GGUF whose tensor `name` is stored in choose(name) -> (path, tokenizer dir)."""
    per_type: dict = {}
    stored = {}
    for name in tiny_llama_tensors(DIMS, Q.Q8_0)[0]:
        qtype = choose(name)
        if qtype not in per_type:
            per_type[qtype] = tiny_llama_tensors(DIMS, qtype, seed=3)[0]
        stored[name] = per_type[qtype][name]
    path = str(tmp_path / "model.gguf")
    write_gguf(path, DIMS, stored)
    tiny_tokenizer(DIMS["vocab"]).save_pretrained(str(tmp_path / "tok"))
    return path, str(tmp_path / "tok")


def _k_quant_mix(name: str) -> Q:
    # As llama.cpp's Q4_K_M mixes them: attention and the embedding (the tied head) Q6_K, gate/up
    # Q4_K, down Q8_0.
    return Q.Q8_0 if ".ffn_down" in name else Q.Q4_K if ".ffn_" in name else Q.Q6_K


FILES = {"Q4_0": lambda name: Q.Q4_0, "Q4_1": lambda name: Q.Q4_1,
         "Q8_0": lambda name: Q.Q8_0, "K-quant mix": _k_quant_mix}


def _llm(path: str, tok: str, **kwargs) -> LLM:
    return LLM(path, tokenizer=tok, quantization="gguf", kv_cache_memory=16 << 20, generation_config="none",
               **kwargs)


def _decode_step_both_ways(llm: LLM, prompt: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """The logits of one decode step after `prompt`, fused and eager, from the same KV cache."""
    from tokenmill.attention_backends.interface import build_metadata

    runner = llm.engine.runner
    n = len(prompt) + 1
    blocks = list(range((n + runner.block_size - 1) // runner.block_size))
    with torch.inference_mode():
        runner.forward(torch.tensor(prompt), torch.arange(n - 1), build_metadata([n - 1], [n - 1], [blocks],
                                                                                 runner.block_size))
        decode = build_metadata([1], [n], [blocks], runner.block_size, num_decodes=1)
        ids, pos = torch.tensor([prompt[-1]]), torch.tensor([n - 1])
        fused_hidden = runner.forward(ids, pos, decode)
        eager_hidden = runner._forward_eager(ids, pos, decode)
        return runner.model.compute_logits(fused_hidden), runner.model.compute_logits(eager_hidden)


def _greedy(llm: LLM, steps: int = 16) -> list[int]:
    params = SamplingParams(temperature=0, max_tokens=steps, ignore_eos=True)
    return list(llm.generate([{"prompt_token_ids": PROMPT}], params, use_tqdm=False)[0].outputs[0].token_ids)


def _extra_bytes(model: torch.nn.Module, step) -> int:
    """Bytes the fused step holds that are not the model's own parameters or buffers."""
    owned = {t.untyped_storage().data_ptr() for t in list(model.parameters()) + list(model.buffers())}
    return sum(t.untyped_storage().nbytes() for t in step._keep if t.untyped_storage().data_ptr() not in owned)


@pytest.mark.parametrize("name", list(FILES))
def test_fused_step_equals_the_eager_gguf_path(tmp_path, name):
    path, tok = _write(tmp_path, FILES[name])
    llm = _llm(path, tok)
    runner = llm.engine.runner
    assert hasattr(runner.forward, "fused_step"), "gguf decode steps did not take the fused path"
    step = runner.forward.fused_step
    parts = [p for m in runner.model.modules() for p in getattr(m, "gguf_parts", [])]
    assert parts and all(p.native for p in parts)
    fused_logits, eager_logits = _decode_step_both_ways(llm, PROMPT)
    rel = ((fused_logits - eager_logits).norm() / eager_logits.norm()).item()
    assert rel < MAX_RELATIVE, rel
    assert resident_weight_bytes(runner.model) + _extra_bytes(runner.model, step) <= MAX_RATIO * os.path.getsize(path)
    # The engine's own greedy decode, fused vs eager: token for token.
    fused_tokens = _greedy(llm)
    eager = _llm(path, tok, enforce_eager=True)
    assert not hasattr(eager.engine.runner.forward, "fused_step")
    assert fused_tokens == _greedy(eager)


def test_the_step_reads_the_methods_packed_weights_in_place(tmp_path):
    path, tok = _write(tmp_path, FILES["Q4_0"])
    runner = _llm(path, tok).engine.runner
    step = runner.forward.fused_step
    qkv = runner.model.model.layers[0].self_attn.qkv_proj
    packed = qkv.quant_method.weight_form(qkv, PlatformPacked).parts
    assert step._layers[0].qkv.weight == packed.linear.weight == packed.tensors[0].data_ptr()
    assert step._embed is runner.model.model.embed_tokens           # rows by the model's own lookup
    assert _extra_bytes(runner.model, step) == 0                      # weights, norms, rope table: the model's


def test_a_tiled_format_runs_eagerly_and_says_why(tmp_path, caplog):
    path, tok = _write(tmp_path, lambda name: Q.Q5_0 if ".ffn_down" in name else Q.Q4_0)
    with caplog.at_level(logging.INFO, logger="tokenmill.platforms.cpu"):
        llm = _llm(path, tok)
    assert not hasattr(llm.engine.runner.forward, "fused_step")
    assert any("fused_decode: running the model eagerly" in r.getMessage() and "down" in r.getMessage()
               for r in caplog.records)
    assert _greedy(llm, 8) == _greedy(_llm(path, tok, enforce_eager=True), 8)


def test_graph_capture_fused_decode_is_accepted_for_gguf(tmp_path):
    path, tok = _write(tmp_path, FILES["Q8_0"])
    assert hasattr(_llm(path, tok, graph_capture="fused_decode").engine.runner.forward, "fused_step")
    assert not hasattr(_llm(path, tok, graph_capture="none").engine.runner.forward, "fused_step")


def test_decode_steps_are_one_native_step_and_the_heads_native_matmul(tmp_path):
    """Each step (the 20-token prompt too: up to MAX_FUSED_TOKENS) is one fused_decode_step call
    plus the tied Q8_0 head's own native matmul (never dequantized); no per-linear calls."""
    path, tok = _write(tmp_path, lambda name: Q.Q8_0 if name == "token_embd.weight" else Q.Q4_0)
    llm = _llm(path, tok)
    lib = llm.engine.runner.forward.fused_step._lib
    real_step, real_matmul = lib.fused_decode_step, lib.fused_matmul
    steps, matmul_rows = [], []

    def step(model, args):
        steps.append(args._obj.tokens)
        return real_step(model, args)

    def matmul(linear, *args):
        matmul_rows.append(linear._obj.n)
        return real_matmul(linear, *args)

    lib.fused_decode_step, lib.fused_matmul = step, matmul
    try:
        out = _greedy(llm, 5)
    finally:
        lib.fused_decode_step, lib.fused_matmul = real_step, real_matmul
    assert len(out) == 5 and steps == [len(PROMPT)] + [1] * 4
    assert matmul_rows == [DIMS["vocab"]] * 5
