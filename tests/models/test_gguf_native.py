"""quantization="gguf": GGUF blocks kept quantized in memory, run by the cpu platform's kernels.

For every block format, a tiny random llama GGUF written by the test (tests/gguf_writers.py):
tokenmill's logits with the blocks kept equal the float32 logits of the same network built from
gguf-py's dequantized weights, to within the kernels' rounding; the weights' resident bytes stay
near the file's. Then the default model re-quantized with gguf-py (Q4_0, Q8_0; Q4_K where rows
allow it): greedy tokens kept-quantized == dequantized-float of the same file.
"""
from __future__ import annotations

import dataclasses

import os

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q

from gguf_writers import requantize_file, tiny_llama_tensors, write_gguf
from model_helpers import load_for_test, run_prompt, tiny_tokenizer
from tokenmill.core.loaders.resident import resident_weight_bytes
from tokenmill.platforms.cpu import CpuPlatform, cpu_flags
from tokenmill.platforms.cpu_gguf_kernels import available as kernels_available

torch.set_num_threads(1)

DIMS = dict(layers=2, hidden=256, intermediate=512, heads=4, kv_heads=2, vocab=1024)
NATIVE = (Q.Q4_0, Q.Q4_1, Q.Q8_0, Q.Q4_K, Q.Q6_K)
TILED = (Q.Q5_0, Q.Q5_1, Q.Q2_K, Q.Q3_K, Q.Q5_K)
# Resident / file bytes of the whole model: every native layout within 10 % of the file's
# (Q4_K's 6-bit codes one byte each: 1.03x of its tensors; Q6_K 1.0x).
MAX_RATIO = 1.10
K_QUANT_RATIO = 1.05             # the packed tensors of one Q4_K / Q6_K weight vs its stored bytes
PROMPT = [1, 17, 400, 23, 99, 512, 7, 1000, 3, 250, 64, 800, 5, 42, 333, 901, 11, 600, 77, 128]

needs_kernels = pytest.mark.skipif(kernels_available() is not None, reason="no native GGUF kernels here")


def _files(tmp_path, qtype):
    stored, floats = tiny_llama_tensors(DIMS, qtype)
    kept_path, float_path = str(tmp_path / f"{qtype.name}.gguf"), str(tmp_path / "float.gguf")
    write_gguf(kept_path, DIMS, stored)
    write_gguf(float_path, DIMS, floats)
    tiny_tokenizer(DIMS["vocab"]).save_pretrained(str(tmp_path / "tok"))
    return kept_path, float_path, str(tmp_path / "tok")


@pytest.mark.parametrize("qtype", NATIVE + TILED, ids=lambda q: q.name)
def test_logits_match_the_dequantized_float_reference(tmp_path, qtype):
    kept_path, float_path, tok = _files(tmp_path, qtype)
    kept = load_for_test(kept_path, platform=CpuPlatform(), quantization="gguf", tokenizer=tok)
    ref = load_for_test(float_path, tokenizer=tok)
    got, want = run_prompt(kept.model, PROMPT), run_prompt(ref.model, PROMPT)
    native = qtype in NATIVE and kernels_available() is None
    parts = [p for m in kept.model.modules() for p in getattr(m, "gguf_parts", [])]
    assert parts and all(p.native == native for p in parts)
    rel = ((got - want).norm() / want.norm()).item()
    if native:
        # Activations quantized to int8 per 32 inputs (llama.cpp's Q8 operand), fp16 scales;
        # Q6_K also re-expressed in 8 bits.
        assert rel < 0.02, rel
        assert (got.argmax(-1) == want.argmax(-1)).float().mean() >= 0.9
    else:
        assert rel < 1e-5, rel           # the same dequantized values, float32 throughout
    # No float copy of any weight: resident bytes near the file's.
    ratio = resident_weight_bytes(kept.model) / os.path.getsize(kept_path)
    assert ratio <= MAX_RATIO, ratio
    assert resident_weight_bytes(ref.model) > 2.5 * os.path.getsize(kept_path)      # the float path's copy


def test_a_batch_of_many_rows_runs_the_same_kernel(tmp_path):
    kept_path, float_path, tok = _files(tmp_path, Q.Q4_0)
    kept = load_for_test(kept_path, platform=CpuPlatform(), quantization="gguf", tokenizer=tok)
    ref = load_for_test(float_path, tokenizer=tok)
    prompt = (PROMPT * 7)[:130]                      # > 8 tokens a pass: the kernel's multi-token loop
    got, want = run_prompt(kept.model, prompt), run_prompt(ref.model, prompt)
    assert ((got - want).norm() / want.norm()).item() < 0.02


class _NoGGUFPlatform(CpuPlatform):
    name = "cpu-without-q5k"

    def native_quantization_formats(self):
        return {k: v for k, v in super().native_quantization_formats().items() if k != "gguf:Q5_K"}


def test_a_format_the_platform_cannot_run_is_refused_naming_who_can(tmp_path):
    kept_path, _, tok = _files(tmp_path, Q.Q5_K)
    with pytest.raises(ValueError) as err:
        load_for_test(kept_path, platform=_NoGGUFPlatform(), quantization="gguf", tokenizer=tok)
    text = str(err.value)
    assert "quantization" in text and "Q5_K" in text and "cpu" in text


def test_quantization_gguf_needs_a_gguf_checkpoint(tmp_path):
    from model_helpers import save_tiny_checkpoint
    save_tiny_checkpoint("llama", str(tmp_path))
    with pytest.raises(ValueError, match="quantization 'gguf'"):
        load_for_test(tmp_path, platform=CpuPlatform(), quantization="gguf")


def test_platforms_list_the_formats_they_run():
    formats = CpuPlatform().native_quantization_formats()
    assert set(formats) >= {f"gguf:{q.name}" for q in NATIVE + TILED}
    want = "native" if {"avx512_vnni", "avx512bw"} <= cpu_flags() else "dequantized-per-tile"
    assert all(formats[f"gguf:{q.name}"] == want for q in NATIVE)
    assert all(formats[f"gguf:{q.name}"] == "dequantized-per-tile" for q in TILED)
    assert CpuPlatform().describe()["quantization_formats"] == formats
    from tokenmill.entrypoints import platforms_cmd
    data = platforms_cmd.collect()
    cpu = next(p for p in data["platforms"] if p["name"] == "cpu")
    assert {k: cpu["quantization_formats"][k] for k in formats} == formats
    text = platforms_cmd.render(data)
    line = next(x for x in text.split("Quantized checkpoint formats", 1)[1].splitlines() if x.startswith("  cpu: "))
    assert ("native gguf:Q4_0" in line if want == "native" else "gguf:Q4_0" in line) and "gguf:Q5_K" in line


def _default_file():
    from tokenmill.core.loaders.model_source import resolve_model_source
    from tokenmill.core.loaders.gguf_file import GGUFFile
    return GGUFFile(resolve_model_source(None).path)


def _mixed(name, shape):
    """One re-quantized file exercising the three formats on the real network, as llama.cpp's
    Q4_K_M mixes them: attention in Q8_0, ffn_down in Q4_K (SmolLM2's 576-wide rows are not whole
    256-value super-blocks, so only ffn_down's 1536-wide rows can be), gate/up in Q4_0; the
    embedding stays the file's Q8_0. gguf-py quantizes Q4_0/Q8_0; it has no Q4_K quantizer, so
    tests/gguf_writers.py packs Q4_K itself from ggml's layout."""
    if len(shape) != 2 or name == "token_embd.weight":
        return None
    if ".attn_" in name:
        return Q.Q8_0
    return Q.Q4_K if shape[1] % 256 == 0 else Q.Q4_0


def _greedy_with_margins(model, ids, steps):
    """Greedy tokens and, at each step, the gap between the best and second-best logit."""
    ids, margins = list(ids), []
    for _ in range(steps):
        top = run_prompt(model, ids)[-1].topk(2)
        ids.append(int(top.indices[0]))
        margins.append(float(top.values[0] - top.values[1]))
    return ids[-steps:], margins


NEAR_TIE = 0.25       # logits: below this gap int8-activation rounding may legitimately pick the other


@needs_kernels
def test_default_model_requantized_greedy_tokens_match_its_float_reference(tmp_path):
    source = _default_file()
    path = str(tmp_path / "smollm2-q8_0-q4_k-q4_0.gguf")
    requantize_file(source, path, _mixed)
    kept = load_for_test(path, platform=CpuPlatform(), quantization="gguf", tokenizer=source.path)
    formats = {p.qtype for m in kept.model.modules() for p in getattr(m, "gguf_parts", [])}
    assert formats == {Q.Q8_0, Q.Q4_K, Q.Q4_0} and all(
        p.native for m in kept.model.modules() for p in getattr(m, "gguf_parts", []))
    assert resident_weight_bytes(kept.model) <= 1.10 * os.path.getsize(path)
    ref = load_for_test(path, tokenizer=source.path)
    compared = 0
    for prompt in ("The capital of France is", "def fibonacci(n):"):
        ids = kept.tokenizer(prompt).input_ids
        want, margins = _greedy_with_margins(ref.model, ids, 6)
        got, _ = _greedy_with_margins(kept.model, ids, 6)
        # Token for token up to the first near-tie of the float reference (there the two may
        # part ways, and after that they continue different texts).
        upto = next((i for i, m in enumerate(margins) if m < NEAR_TIE), len(margins))
        assert got[:upto + 1] == want[:upto + 1] if upto < len(margins) and got[upto] == want[upto] \
            else got[:upto] == want[:upto], (prompt, got, want, margins)
        compared += upto
    assert compared >= 6           # most of the 12 tokens were decisive and matched


def _k_quant_blocks(qtype, n, k, seed=0):
    from gguf_writers import quantize as quantize_blocks
    rng = np.random.default_rng(seed)
    return quantize_blocks((rng.standard_normal((n, k)) * k ** -0.5).astype(np.float32), qtype, rng)


def _int8_activations(x):
    """x with the kernels' activation rounding: int8 per 32 inputs, scale amax / 127."""
    groups = x.reshape(x.shape[0], -1, 32)
    sa = groups.abs().amax(-1, keepdim=True) / 127
    return (torch.round(groups / torch.where(sa > 0, sa, torch.ones_like(sa))) * sa).reshape(x.shape)


@needs_kernels
@pytest.mark.parametrize("qtype", (Q.Q4_K, Q.Q6_K), ids=lambda q: q.name)
def test_k_quant_kernels_run_the_files_values_at_its_size(qtype):
    from gguf.quants import dequantize
    from tokenmill.platforms import cpu_gguf_kernels as kernels
    from tokenmill.quantization import gguf_blocks

    n, k = 96, 768
    blocks = _k_quant_blocks(qtype, n, k)
    weight = torch.from_numpy(dequantize(blocks, qtype).reshape(n, k))
    rows = torch.from_numpy(np.array(blocks))
    packed = (kernels.pack_q4k(*gguf_blocks.q4k_fields(rows)) if qtype == Q.Q4_K
              else kernels.pack_q6k(*gguf_blocks.q6k_fields(rows)))
    assert packed.kind == (kernels.Q4K if qtype == Q.Q4_K else kernels.Q6K)
    assert sum(t.numel() * t.element_size() for t in packed.tensors) <= K_QUANT_RATIO * blocks.nbytes
    picked = torch.tensor([0, 15, 16, 50, 95, 7])
    assert torch.equal(kernels.dequantize_rows(packed, picked), weight[picked])      # bit-exact
    for tokens in (1, 5, 8, 19):                      # single rows, the 8-token pass and remainders
        x = torch.randn(tokens, k)
        got = kernels.matmul(packed, x).double()
        exact = _int8_activations(x).double() @ weight.double().T
        assert ((got - exact).norm() / exact.norm()).item() < 1e-5       # only float accumulation differs
        want = x.double() @ weight.double().T
        assert ((got - want).norm() / want.norm()).item() < 0.02


@needs_kernels
def test_k_quant_shapes_off_the_row_blocks_are_refused():
    from tokenmill.platforms import cpu_gguf_kernels as kernels
    from tokenmill.quantization import gguf_blocks

    rows = torch.from_numpy(np.array(_k_quant_blocks(Q.Q6_K, 24, 256)))
    with pytest.raises(ValueError, match="q"):
        kernels.pack_q6k(*gguf_blocks.q6k_fields(rows))


class _NoKQuantKernelsPlatform(CpuPlatform):
    """The cpu platform as it was before its Q4_K/Q6_K kinds: those repacked as 4-bit affine /
    int8 groups of 32."""
    name = "cpu-without-k-quant-kinds"

    def quantization_kernels(self, name):
        return dataclasses.replace(super().quantization_kernels(name), pack_q4k=None, pack_q6k=None)


def _mixed_k_quant_files(tmp_path):
    """A tiny llama whose attention (and embedding) is Q6_K and MLP Q4_K, with its float reference."""
    q4k_stored, q4k_floats = tiny_llama_tensors(DIMS, Q.Q4_K, seed=3)
    q6k_stored, q6k_floats = tiny_llama_tensors(DIMS, Q.Q6_K, seed=3)
    stored, floats = {}, {}
    for name in q4k_stored:
        use_q4k = ".ffn_" in name
        stored[name] = (q4k_stored if use_q4k else q6k_stored)[name]
        floats[name] = (q4k_floats if use_q4k else q6k_floats)[name]
    kept_path, float_path = str(tmp_path / "q6k-q4k.gguf"), str(tmp_path / "float.gguf")
    write_gguf(kept_path, DIMS, stored)
    write_gguf(float_path, DIMS, floats)
    tiny_tokenizer(DIMS["vocab"]).save_pretrained(str(tmp_path / "tok"))
    return kept_path, float_path, str(tmp_path / "tok")


@needs_kernels
def test_k_quant_model_keeps_file_size_and_greedy_tokens(tmp_path):
    from tokenmill.platforms import cpu_gguf_kernels as kernels
    from tokenmill.quantization.gguf_blocks import row_bytes

    kept_path, float_path, tok = _mixed_k_quant_files(tmp_path)
    kept = load_for_test(kept_path, platform=CpuPlatform(), quantization="gguf", tokenizer=tok)
    before = load_for_test(kept_path, platform=_NoKQuantKernelsPlatform(), quantization="gguf", tokenizer=tok)
    ref = load_for_test(float_path, tokenizer=tok)
    parts = [p for m in kept.model.modules() for p in getattr(m, "gguf_parts", [])]
    assert {p.qtype for p in parts} == {Q.Q4_K, Q.Q6_K}
    assert all(p.packed.kind == (kernels.Q4K if p.qtype == Q.Q4_K else kernels.Q6K) for p in parts)
    for p in parts:
        resident = sum(t.numel() * t.element_size() for t in p.tensors)
        assert resident <= K_QUANT_RATIO * p.n * row_bytes(p.qtype, p.k), (p.qtype, p.n, p.k)
    size = os.path.getsize(kept_path)
    assert resident_weight_bytes(kept.model) <= MAX_RATIO * size < resident_weight_bytes(before.model)
    # The file's weights (new kinds) and the old repacking's roundings of them both stay within
    # the int8-activation error of the float reference: this random network's logits spread ~0.25
    # (std) and move by at most ~0.03 here.
    want_logits = run_prompt(ref.model, PROMPT)
    for model in (kept.model, before.model):
        assert (run_prompt(model, PROMPT) - want_logits).abs().max() < 0.04
    # Greedy tokens: the reference's continuations, fed back; wherever its best logit leads by
    # more than twice that error the kept model picks the same token.
    decisive = 0
    for start in range(0, len(PROMPT), 4):
        prompt = PROMPT[start:start + 4]
        want, margins = _greedy_with_margins(ref.model, prompt, 8)
        steps = torch.tensor(margins) > 0.08
        for model in (kept.model, before.model):
            got = run_prompt(model, prompt + want[:-1])[len(prompt) - 1:].argmax(-1)
            assert torch.equal(got[steps], torch.tensor(want)[steps]), (prompt, got.tolist(), want, margins)
        decisive += int(steps.sum())
    assert decisive >= 10
