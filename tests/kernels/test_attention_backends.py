"""Attention backends against `reference`: the fast CPU backend over the whole grid, the Triton
backend under TRITON_INTERPRET=1, capability checks, and end-to-end greedy agreement."""
from __future__ import annotations

import importlib.util
import itertools
import os

import pytest
import torch

from tokenmill.attention_backends.cpu_sdpa import CpuSdpaAttention
from tokenmill.attention_backends.interface import (AttentionBackendUnavailable, AttentionConfig,
                                                    build_metadata, check_backend, kv_cache_torch_dtype,
                                                    write_kv)
from tokenmill.attention_backends.reference import ReferenceAttention
from tokenmill.entrypoints.attention_grid import Case, check_cell, make_inputs, run_backend

HAS_TRITON = importlib.util.find_spec("triton") is not None


def _case(d, r, bs, dt, kv="auto", batch="mixed"):
    return Case(d, r, bs, dt, kv, num_kv_heads=2 if r < 8 else 1, batch=batch)


def _compare(cls, case, full=True, seed=0):
    inputs = make_inputs(case, full=full, seed=seed, device="cpu")
    ref = run_backend(ReferenceAttention, case, inputs, "cpu")
    return check_cell(cls.name, cls, case, inputs, ref, "cpu")


@pytest.mark.parametrize("d,r,bs,dt", list(itertools.product((64, 80, 128, 256), (1, 3, 4, 8), (16, 32),
                                                              ("float32", "bfloat16"))))
def test_cpu_sdpa_matches_reference(d, r, bs, dt):
    res = _compare(CpuSdpaAttention, _case(d, r, bs, dt))
    assert res.status == "pass", (res.max_abs_error, res.where)


@pytest.mark.parametrize("dt", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("kv", ["fp8", "fp8_e5m2"])
def test_cpu_sdpa_fp8_kv_cache(dt, kv):
    res = _compare(CpuSdpaAttention, _case(64, 4, 16, dt, kv))
    assert res.status == "pass", (res.max_abs_error, res.where)


def test_cpu_sdpa_decode_only_batch_and_float16():
    for dt in ("float32", "bfloat16", "float16"):
        res = _compare(CpuSdpaAttention, _case(64, 3, 16, dt, batch="decode"))
        assert res.status == "pass", (dt, res.max_abs_error, res.where)


def _random_batch(num_heads, num_kv_heads, head, bs, specs, seed=0, dtype=torch.float32):
    """specs: (query_len, seq_len) per sequence, decodes first. Shuffled block tables."""
    g = torch.Generator().manual_seed(seed)
    need = [(s + bs - 1) // bs for _, s in specs]
    ids = (torch.randperm(sum(need) + 2, generator=g) + 1).tolist()
    tables, p = [], 0
    for n in need:
        tables.append(ids[p:p + n])
        p += n
    md = build_metadata([q for q, _ in specs], [s for _, s in specs], tables, bs)
    t = sum(q for q, _ in specs)
    q = torch.randn(t, num_heads, head, generator=g).to(dtype)
    k = torch.randn(t, num_kv_heads, head, generator=g).to(dtype)
    v = torch.randn(t, num_kv_heads, head, generator=g).to(dtype)
    cache = torch.randn(2, sum(need) + 3, bs, num_kv_heads, head, generator=g).to(dtype)   # stale garbage
    return md, q, k, v, cache


@pytest.mark.parametrize("window,cap", [(5, None), (None, 3.0), (9, 2.0)])
def test_cpu_sdpa_sliding_window_and_soft_cap(window, cap):
    specs = [(1, 40), (1, 7), (1, 33), (20, 20), (9, 45)]
    md, q, k, v, cache = _random_batch(8, 2, 64, 16, specs)
    ref = ReferenceAttention(8, 64, 0.125, 2, sliding_window=window, logits_soft_cap=cap)
    fast = CpuSdpaAttention(8, 64, 0.125, 2, sliding_window=window, logits_soft_cap=cap)
    expect = ref.forward(q, k, v, cache.clone(), md)
    got = fast.forward(q, k, v, cache.clone(), md)
    torch.testing.assert_close(got, expect, atol=1e-4, rtol=1e-4)


def test_cpu_sdpa_reads_garbage_free_padding_and_same_length_decodes():
    # every decode the same length (the no-mask fast path), stale values in unused cache slots
    specs = [(1, 32)] * 5 + [(1, 17)]
    md, q, k, v, cache = _random_batch(9, 3, 64, 16, specs, seed=3)
    expect = ReferenceAttention(9, 64, 0.125, 3).forward(q, k, v, cache.clone(), md)
    got = CpuSdpaAttention(9, 64, 0.125, 3).forward(q, k, v, cache.clone(), md)
    torch.testing.assert_close(got, expect, atol=1e-4, rtol=1e-4)
    md, q, k, v, cache = _random_batch(9, 3, 64, 16, [(1, 32)] * 4, seed=4)
    expect = ReferenceAttention(9, 64, 0.125, 3).forward(q, k, v, cache.clone(), md)
    got = CpuSdpaAttention(9, 64, 0.125, 3).forward(q, k, v, cache.clone(), md)
    torch.testing.assert_close(got, expect, atol=1e-4, rtol=1e-4)


def test_cpu_sdpa_step_cache_survives_reuse_across_layers_and_steps():
    md, q, k, v, cache = _random_batch(4, 2, 64, 16, [(1, 20), (1, 35)], seed=5)
    be = CpuSdpaAttention(4, 64, 0.125, 2)
    caches = [cache.clone(), cache.clone()]
    a = [be.forward(q, k, v, c, md) for c in caches]        # two "layers", one metadata
    torch.testing.assert_close(a[0], a[1])
    md2, q2, k2, v2, cache2 = _random_batch(4, 2, 64, 16, [(1, 50), (1, 3)], seed=6)
    expect = ReferenceAttention(4, 64, 0.125, 2).forward(q2, k2, v2, cache2.clone(), md2)
    torch.testing.assert_close(be.forward(q2, k2, v2, cache2.clone(), md2), expect, atol=1e-4, rtol=1e-4)


def test_build_metadata_and_write_kv():
    # seq 0 needs 2 blocks for 5 tokens but has 1: rejected
    with pytest.raises(ValueError):
        build_metadata([1], [5], [[7]], block_size=4)
    md = build_metadata([1, 3], [5, 3], [[7, 1], [2]], block_size=4)
    assert md.num_decodes == 1 and md.num_seqs == 2 and md.num_tokens == 4
    assert md.slot_mapping.tolist() == [1 * 4 + 0, 8, 9, 10]
    assert md.block_tables.tolist() == [[7, 1], [2, 0]]
    for kv_dtype in ("auto", "fp8"):
        cache = torch.zeros(2, 3, 4, 1, 2, dtype=kv_cache_torch_dtype(kv_dtype, torch.float32))
        key = torch.arange(8.).view(4, 1, 2)
        write_kv(key, -key, cache, torch.tensor([0, 5, 6, 11]))
        flat = cache.float().view(2, 12, 1, 2)
        assert flat[0, 5].tolist() == [[2.0, 3.0]] and flat[1, 11].tolist() == [[-6.0, -7.0]]


def test_validate_lists_every_reason_and_check_backend_raises():
    cfg = AttentionConfig(head_size=96, num_heads=8, num_kv_heads=2, dtype=torch.float16,
                          kv_cache_dtype="fp8", block_size=16, device="cpu")
    from tokenmill.attention_backends.flash_attn import FlashAttentionBackend
    reasons = FlashAttentionBackend.validate(cfg)
    assert any("flash_attn" in r for r in reasons) and any("device 'cpu'" in r for r in reasons)
    assert any("fp8" in r for r in reasons)
    with pytest.raises(AttentionBackendUnavailable) as info:
        check_backend(FlashAttentionBackend, cfg)
    assert isinstance(info.value, ValueError) and info.value.reasons == reasons
    assert CpuSdpaAttention.validate(AttentionConfig(64, 9, 3, torch.bfloat16)) == []
    bad = CpuSdpaAttention.validate(AttentionConfig(64, 9, 4, torch.bfloat16, device="cuda"))
    assert any("multiple" in r for r in bad) and any("device" in r for r in bad)


def test_wrappers_report_missing_packages_as_unsupported():
    from tokenmill.attention_backends.flashinfer import FlashInferBackend
    from tokenmill.attention_backends.ipex import IpexPagedAttention
    from tokenmill.attention_backends.pallas import PallasPagedAttention
    for cls, module in ((FlashInferBackend, "flashinfer"), (IpexPagedAttention, "intel_extension_for_pytorch"),
                        (PallasPagedAttention, "torch_xla")):
        if importlib.util.find_spec(module) is None:
            assert module in (cls.probe() or ""), cls
            assert cls.validate(AttentionConfig(64, 8, 2, torch.bfloat16))


# ------------------------------------------------------------------------------------- triton
@pytest.fixture
def triton_interpreter(monkeypatch):
    if not HAS_TRITON:
        pytest.skip("triton is not installed (pip install triton)")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    from tokenmill.attention_backends.triton_paged import TritonPagedAttention
    return TritonPagedAttention


@pytest.mark.parametrize("d,r,bs,dt", [(64, 3, 16, "float32"), (80, 8, 32, "bfloat16"), (128, 1, 16, "float16"),
                                       (256, 4, 32, "float32")])
def test_triton_paged_matches_reference_under_interpreter(triton_interpreter, d, r, bs, dt):
    res = _compare(triton_interpreter, _case(d, r, bs, dt), full=False)
    assert res.status == "pass", (res.max_abs_error, res.where)


def test_triton_paged_split_kv_decode_soft_cap_and_window(triton_interpreter):
    # long enough contexts that the decode kernel uses several splits
    specs = [(1, 150), (1, 9), (1, 64), (12, 30)]
    for window, cap in ((None, None), (24, 4.0)):
        md, q, k, v, cache = _random_batch(4, 2, 64, 16, specs, seed=7)
        ref = ReferenceAttention(4, 64, 0.125, 2, sliding_window=window, logits_soft_cap=cap)
        tri = triton_interpreter(4, 64, 0.125, 2, sliding_window=window, logits_soft_cap=cap)
        torch.testing.assert_close(tri.forward(q, k, v, cache.clone(), md),
                                   ref.forward(q, k, v, cache.clone(), md), atol=1e-4, rtol=1e-4)


def test_triton_needs_interpreter_on_cpu(monkeypatch):
    if not HAS_TRITON:
        pytest.skip("triton is not installed")
    from tokenmill.attention_backends.triton_paged import TritonPagedAttention
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    reasons = TritonPagedAttention.validate(AttentionConfig(64, 8, 2, torch.float32))
    assert any("TRITON_INTERPRET=1" in r for r in reasons)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert TritonPagedAttention.validate(AttentionConfig(64, 8, 2, torch.float32)) == []
    assert TritonPagedAttention.validate(AttentionConfig(64, 8, 2, torch.float32, kv_cache_dtype="fp8"))


# ------------------------------------------------------------------------- engine end to end
E2E_PROMPTS = ["The capital of France is", "def fibonacci(n):", "1, 2, 3, 4,"]


def _cpu_runnable_backends():
    names = ["cpu_sdpa"]
    if HAS_TRITON:
        # the whole model under the Triton interpreter takes minutes: opt in
        names.append(pytest.param("triton_paged", marks=pytest.mark.skipif(
            os.environ.get("TOKENMILL_SLOW_TESTS") != "1", reason="set TOKENMILL_SLOW_TESTS=1 (slow: interpreter)")))
    return names


@pytest.fixture(scope="module")
def reference_greedy():
    pytest.importorskip("tokenmill.entrypoints.llm")
    from tokenmill import LLM, SamplingParams
    llm = LLM(dtype="float32", max_model_len=512, kv_cache_memory=64 << 20, attention_backend="reference")
    outs = llm.generate(E2E_PROMPTS, SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("backend", _cpu_runnable_backends())
def test_engine_greedy_outputs_identical_per_backend(backend, reference_greedy, monkeypatch):
    pytest.importorskip("tokenmill.entrypoints.llm")
    if backend == "triton_paged":
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    from tokenmill import LLM, SamplingParams
    llm = LLM(dtype="float32", max_model_len=512, kv_cache_memory=64 << 20, attention_backend=backend)
    outs = llm.generate(E2E_PROMPTS, SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == reference_greedy
