"""Attention sinks (GPT-OSS: a learned logit per query head in each softmax's denominator, attending
to no value) in every backend that declares supports_attention_sinks, against a float64 computation
over mixed batches (decodes, whole prompts, chunks after cached context) with grouped-query heads,
sliding windows and soft-capping; the selector passes over backends without them, saying why."""
from __future__ import annotations

import importlib.util

import pytest
import torch

from tokenmill.attention_backends.cpu_sdpa import CpuSdpaAttention
from tokenmill.attention_backends.interface import AttentionConfig, build_metadata
from tokenmill.attention_backends.reference import ReferenceAttention

HEADS, KV_HEADS, HEAD, BS, SCALE = 8, 2, 64, 16, 0.125
# (query_len, seq_len) per sequence, decodes first: decodes inside and past a window, a whole
# prompt, chunks after cached context.
SPECS = [(1, 40), (1, 7), (1, 33), (20, 20), (9, 45), (16, 16)]


def batch(seed: int = 0, dtype: torch.dtype = torch.float32):
    g = torch.Generator().manual_seed(seed)
    need = [(s + BS - 1) // BS for _, s in SPECS]
    ids = (torch.randperm(sum(need) + 2, generator=g) + 1).tolist()
    tables, p = [], 0
    for n in need:
        tables.append(ids[p:p + n])
        p += n
    md = build_metadata([q for q, _ in SPECS], [s for _, s in SPECS], tables, BS)
    t = sum(q for q, _ in SPECS)
    q, k, v = (torch.randn(t, h, HEAD, generator=g).to(dtype) for h in (HEADS, KV_HEADS, KV_HEADS))
    cache = torch.randn(2, sum(need) + 3, BS, KV_HEADS, HEAD, generator=g).to(dtype)   # cached context
    sinks = torch.randn(HEADS, generator=g) * 3.0
    return md, q, k, v, cache, sinks


def float64_attention(md, q, k, v, cache, sinks, window=None, cap=None) -> torch.Tensor:
    """softmax over [scores | sink] per head, the sink's column dropped, in float64."""
    cache = cache.double().clone()
    flat = cache.view(2, -1, KV_HEADS, HEAD)
    flat[0, md.slot_mapping] = k.double()
    flat[1, md.slot_mapping] = v.double()
    out = torch.empty(q.shape, dtype=torch.float64)
    group = HEADS // KV_HEADS
    for i in range(md.num_seqs):
        start, end = md.query_start_loc_cpu[i], md.query_start_loc_cpu[i + 1]
        seq_len = md.seq_lens_cpu[i]
        slots = torch.tensor([int(md.block_tables[i, p // BS]) * BS + p % BS for p in range(seq_len)])
        keys = flat[0, slots].repeat_interleave(group, dim=1)                   # [S, H, D]
        values = flat[1, slots].repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q[start:end].double(), keys) * SCALE
        if cap:
            scores = cap * torch.tanh(scores / cap)
        q_pos = torch.arange(seq_len - (end - start), seq_len)[:, None]
        k_pos = torch.arange(seq_len)[None, :]
        allowed = (k_pos <= q_pos) & ((k_pos > q_pos - window) if window else True)
        scores = scores.masked_fill(~allowed, float("-inf"))
        full = torch.cat((scores, sinks.double().view(-1, 1, 1).expand(-1, end - start, 1)), dim=-1)
        out[start:end] = torch.einsum("hqk,khd->qhd", torch.softmax(full, dim=-1)[..., :-1], values)
    return out


def run(cls, md, q, k, v, cache, sinks, window=None, cap=None) -> torch.Tensor:
    backend = cls(HEADS, HEAD, SCALE, KV_HEADS, sliding_window=window, logits_soft_cap=cap)
    backend.sinks = sinks
    return backend.forward(q, k, v, cache.clone(), md)


@pytest.mark.parametrize("cls", [ReferenceAttention, CpuSdpaAttention])
@pytest.mark.parametrize("window,cap", [(None, None), (9, None), (None, 3.0), (12, 2.0)])
def test_sinks_match_float64(cls, window, cap):
    md, q, k, v, cache, sinks = batch()
    want = float64_attention(md, q, k, v, cache, sinks, window, cap)
    torch.testing.assert_close(run(cls, md, q, k, v, cache, sinks, window, cap).double(), want,
                               atol=1e-5, rtol=1e-5)
    # without the sinks the outputs differ: the sinks are not a no-op at this size
    assert not torch.allclose(run(cls, md, q, k, v, cache, None, window, cap).double(), want, atol=1e-3)


@pytest.mark.parametrize("window", [None, 9])
def test_cpu_sdpa_sinks_bfloat16(monkeypatch, window):
    """bf16 over a bf16 cache: prompts on the flash kernels, asked for their log-sum-exp (the sinks'
    share comes from it), decodes on the native kernel; float64's outputs within bf16's tolerance."""
    from tokenmill.attention_backends import cpu_flash_prefill
    asked = []

    def spying(real):
        def spy(*args, **kwargs):
            asked.append(args[6] if len(args) > 6 else kwargs.get("return_lse"))
            return real(*args, **kwargs)
        return spy

    for name in ("flash_prefill", "torch_flash"):
        monkeypatch.setattr(cpu_flash_prefill, name, spying(getattr(cpu_flash_prefill, name)))
    md, q, k, v, cache, sinks = batch(seed=1, dtype=torch.bfloat16)
    want = float64_attention(md, q, k, v, cache, sinks, window)
    torch.testing.assert_close(run(CpuSdpaAttention, md, q, k, v, cache, sinks, window).double(), want,
                               atol=2e-2, rtol=2e-2)
    assert all(asked)                    # a flash call without its lse would have dropped the sinks


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
@pytest.mark.parametrize("window,cap", [(None, None), (9, 2.0)])
def test_triton_sinks_under_interpreter(monkeypatch, window, cap):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    from tokenmill.attention_backends.triton_paged import TritonPagedAttention
    md, q, k, v, cache, sinks = batch(seed=2)
    want = float64_attention(md, q, k, v, cache, sinks, window, cap)
    torch.testing.assert_close(run(TritonPagedAttention, md, q, k, v, cache, sinks, window, cap).double(), want,
                               atol=1e-4, rtol=1e-4)


def test_selector_passes_over_backends_without_sinks():
    from tokenmill.attention_backends.flash_attn import FlashAttentionBackend
    config = AttentionConfig(HEAD, HEADS, KV_HEADS, torch.float32, attention_sinks=True)
    assert CpuSdpaAttention.validate(config) == [] and ReferenceAttention.validate(config) == []
    assert "attention sinks not supported" in FlashAttentionBackend.validate(config)


def test_attention_matrix_has_sinks_rows():
    """`tokenmill attention-matrix` judges sinks like any capability: its sinks cases pass on the CPU
    backends that declare them, and a backend that does not is unsupported with the reason."""
    from tokenmill.attention_backends.flash_attn import FlashAttentionBackend
    from tokenmill.entrypoints import attention_grid as grid
    cases = [c for c in grid.build_grid("quick", "cpu") if c.attention_sinks]
    assert cases and all("sinks" in c.label for c in cases)
    backends = {"cpu_sdpa": CpuSdpaAttention, "flash_attn": FlashAttentionBackend}
    results = grid.run_matrix(backends, cases, device="cpu")
    assert {r.status for r in results if r.backend == "cpu_sdpa"} == {"pass"}
    assert all("attention sinks not supported" in r.reasons for r in results if r.backend == "flash_attn")


def test_cpu_sdpa_decodes_with_sinks_on_the_native_kernel(monkeypatch):
    """Decodes keep the in-place C++ kernel: its log-sum-exp scales the output by Z / (Z + e^sink)."""
    from tokenmill.attention_backends import cpu_paged_decode
    if cpu_paged_decode.available() is not None:
        pytest.skip(f"no native paged decode here: {cpu_paged_decode.available()}")
    calls = []
    real = cpu_paged_decode.paged_decode

    def counting(*args, **kwargs):
        calls.append(kwargs.get("return_lse"))
        return real(*args, **kwargs)

    monkeypatch.setattr(cpu_paged_decode, "paged_decode", counting)
    md, q, k, v, cache, sinks = batch(seed=4)
    nd = md.num_decodes
    want = float64_attention(md, q, k, v, cache, sinks, 9)[:nd]
    got = run(CpuSdpaAttention, md, q, k, v, cache, sinks, 9)[:nd]
    assert calls == [True]
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)
    backend = CpuSdpaAttention(HEADS, HEAD, SCALE, KV_HEADS)
    backend.sinks = sinks
    assert backend.native_decode_fn(cache) is None          # the fused step's ABI has no sinks
