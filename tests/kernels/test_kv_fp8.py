"""`--kv-cache-dtype fp8` (e4m3, e5m2) with per-tensor k/v scales: what the backends store and
read, the scales a checkpoint carries, and the KV block count an fp8 cache buys."""
from __future__ import annotations

import logging
import re

import pytest
import torch

from model_helpers import save_tiny_checkpoint, single_sequence_metadata
from tokenmill.attention_backends import cpu_paged_decode
from tokenmill.attention_backends.cpu_sdpa import CpuSdpaAttention
from tokenmill.attention_backends.interface import from_kv, kv_round_trip, to_kv
from tokenmill.attention_backends.reference import ReferenceAttention

torch.set_num_threads(1)
FP8 = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
H, HKV, D, BS = 4, 2, 16, 16


def test_writes_saturate_and_scales_round_trip():
    x = torch.tensor([1000.0, -1000.0, 3.0, 0.5])
    stored = to_kv(x, torch.float8_e4m3fn)                  # a plain cast would give NaN for +-1000
    assert torch.isfinite(stored.float()).all() and stored.float().abs().max() == 448
    scaled = from_kv(to_kv(x, torch.float8_e4m3fn, 4.0), torch.float32, 4.0)
    assert torch.allclose(scaled, x, rtol=0.07)             # e4m3: 3 mantissa bits
    assert torch.equal(kv_round_trip(x, torch.float32, 4.0), x)        # not fp8: scales unused


def _attend(backend_cls, kv_name, k_scale, v_scale, q, k, v, prompt_len):
    """Prefill `prompt_len` tokens then decode the rest one by one; outputs of every token."""
    impl = backend_cls(H, D, D ** -0.5, HKV, kv_cache_dtype=kv_name)
    impl.k_scale, impl.v_scale = k_scale, v_scale
    dtype = FP8.get(kv_name, torch.float32)
    n = q.shape[0]
    cache = torch.zeros(backend_cls.kv_cache_shape(n // BS + 2, BS, HKV, D), dtype=dtype)
    outs = [impl.forward(q[:prompt_len], k[:prompt_len], v[:prompt_len], cache,
                         single_sequence_metadata(prompt_len, BS))]
    for t in range(prompt_len, n):
        outs.append(impl.forward(q[t:t + 1], k[t:t + 1], v[t:t + 1], cache, single_sequence_metadata(1, BS, t)))
    return torch.cat(outs), impl, cache


@pytest.mark.parametrize("backend_cls", [ReferenceAttention, CpuSdpaAttention], ids=lambda c: c.name)
@pytest.mark.parametrize("kv_name", list(FP8))
def test_scaled_fp8_cache_attends_to_what_it_stores(backend_cls, kv_name):
    torch.manual_seed(0)
    n = 40
    q = torch.randn(n, H, D) / 50             # scores of order one: a softmax fp8 rounding does not flip
    k = torch.randn(n, HKV, D) * 200          # beyond e4m3's 448 without a scale
    v = torch.randn(n, HKV, D) * 100
    k_scale, v_scale = float(k.abs().max()) / 400, float(v.abs().max()) / 400
    got, impl, cache = _attend(backend_cls, kv_name, k_scale, v_scale, q, k, v, prompt_len=24)
    # The same attention over exactly what an fp8 cache with these scales holds, in float32.
    dtype = FP8[kv_name]
    want, _, _ = _attend(ReferenceAttention, "auto", 1.0, 1.0, q, kv_round_trip(k, dtype, k_scale),
                         kv_round_trip(v, dtype, v_scale), prompt_len=24)
    assert torch.allclose(got, want, atol=1e-3 * float(want.abs().max()), rtol=1e-3)
    # The cache holds x / scale: nothing saturated, the read gives back x to fp8 rounding.
    assert cache.float().abs().max() <= 401
    exact, _, _ = _attend(ReferenceAttention, "auto", 1.0, 1.0, q, k, v, prompt_len=24)
    assert ((got - exact).norm() / exact.norm()) < (0.15 if kv_name == "fp8_e5m2" else 0.06)   # 2 vs 3 mantissa bits
    if backend_cls is CpuSdpaAttention and cpu_paged_decode.available() is None:
        # the decodes above ran on the native paged kernel, which reads fp8 blocks in place
        assert impl.native_decode_fn(cache) is not None and impl._native_decode_ok(q[:1], cache)


def test_an_unscaled_e4m3_cache_would_saturate():
    torch.manual_seed(0)
    q, k, v = torch.randn(20, H, D), torch.randn(20, HKV, D) * 2000, torch.randn(20, HKV, D)
    read = {}
    for name, scale in (("unscaled", 1.0), ("scaled", float(k.abs().max()) / 448)):
        _, _, cache = _attend(ReferenceAttention, "fp8_e4m3", scale, 1.0, q, k, v, prompt_len=20)
        read[name] = from_kv(cache[0].reshape(-1, HKV, D)[:20], torch.float32, scale)
    rel = {name: float((keys - k).norm() / k.norm()) for name, keys in read.items()}
    assert rel["scaled"] < 0.05 and rel["unscaled"] > 0.5, rel


def _add_tensors(directory, extra: dict) -> None:
    from safetensors.torch import load_file, save_file
    path = f"{directory}/model.safetensors"
    tensors = load_file(path)
    tensors.update(extra)
    save_file(tensors, path, metadata={"format": "pt"})


@pytest.mark.parametrize("naming", ["self_attn.{}_scale", "self_attn.{}_proj.output_scale"])
def test_scales_are_read_from_the_checkpoint(tmp_path, naming):
    from model_helpers import load_for_test
    save_tiny_checkpoint("llama", str(tmp_path))
    scales = {(i, kind): 0.5 + i + (kind == "v") for i in range(2) for kind in ("k", "v")}
    _add_tensors(tmp_path, {f"model.layers.{i}.{naming.format(kind)}": torch.tensor(value)
                            for (i, kind), value in scales.items()})
    bundle = load_for_test(tmp_path, kv_cache_dtype="fp8")
    layers = bundle.model.attention_layers
    assert [(layer.impl.k_scale, layer.impl.v_scale) for layer in layers] == [
        (scales[(i, "k")], scales[(i, "v")]) for i in range(len(layers))]
    plain = load_for_test(tmp_path)             # a float cache: the scales are not used
    assert all(layer.impl.k_scale == 1.0 and layer.impl.v_scale == 1.0 for layer in plain.model.attention_layers)


def _logged_blocks(caplog, **kwargs) -> int:
    from tokenmill import LLM
    caplog.clear()
    with caplog.at_level(logging.INFO):
        llm = LLM(**kwargs)
    del llm
    line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("KV cache:"))
    return int(re.match(r"KV cache: (\d+) blocks", line).group(1))


def test_fp8_doubles_the_logged_block_count_against_bf16(tmp_path, caplog):
    save_tiny_checkpoint("llama", str(tmp_path))
    common = dict(model=str(tmp_path), kv_cache_memory=8 << 20, num_threads=1, generation_config="none",
                  enforce_eager=True)
    bf16 = _logged_blocks(caplog, kv_cache_dtype="bfloat16", **common)
    fp8 = _logged_blocks(caplog, kv_cache_dtype="fp8", **common)
    assert bf16 > 0 and fp8 == 2 * bf16
