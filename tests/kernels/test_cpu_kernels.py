"""The native CPU kernels (platforms/csrc/cpu_kernels.cpp; cpu_sdpa's
attention_backends/csrc/paged_decode.cpp) against plain torch."""
from __future__ import annotations

import ctypes

import pytest
import torch

from tokenmill.attention_backends import cpu_flash_prefill, cpu_paged_decode
from tokenmill.attention_backends.cpu_sdpa import CpuSdpaAttention
from tokenmill.attention_backends.interface import build_metadata, from_kv, to_kv
from tokenmill.platforms import cpu_kernels
from tokenmill.platforms.cpu import CpuPlatform
from tokenmill.quantization import cpu_int4

from model_helpers import decode_batch

pytestmark = pytest.mark.skipif(cpu_kernels.available() is not None or cpu_paged_decode.available() is not None,
                                reason=str(cpu_kernels.available() or cpu_paged_decode.available()))


def _paged(lens, shared_blocks=0, dtype=torch.float32, seed=0):
    """A random float cache [2, 120 blocks, 16, 3 kv heads, 64] and a decode batch over it."""
    tables, meta = decode_batch(lens, shared_blocks, num_blocks=120, seed=seed)
    torch.manual_seed(seed)
    cache = torch.randn(2, 120, 16, 3, 64).to(dtype)
    return cache, tables, meta


def _attend(q, cache, tables, lens, scale, window=None, first=0, softcap=0.0):
    """Per sequence, per head, in float64: softmax(q k^T) v over positions [start, len) (scores
    soft-capped: cap * tanh(score / cap))."""
    kv_heads = cache.shape[3]
    group = q.shape[1] // kv_heads
    outs, lses = [], []
    for s, n in enumerate(lens):
        rows = torch.cat([cache[:, b] for b in tables[s]], dim=1)[:, :n].double()   # [2, n, Hkv, D]
        start = max(first, n - window if window else 0)
        k = rows[0, start:].repeat_interleave(group, 1)
        v = rows[1, start:].repeat_interleave(group, 1)
        scores = torch.einsum("hd,thd->ht", q[s].double(), k) * scale
        if softcap:
            scores = softcap * torch.tanh(scores / softcap)
        outs.append(torch.einsum("ht,thd->hd", scores.softmax(-1), v))
        lses.append(scores.logsumexp(-1))
    return torch.stack(outs), torch.stack(lses)


FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)
KV_DTYPES = (torch.float32, torch.bfloat16) + FP8
# fp8 caches hold x / scale: scales off 1 check that the kernel reads stored * scale.
SCALES = {torch.float8_e4m3fn: (0.02, 0.015), torch.float8_e5m2: (0.5, 2.0)}


def _cache(shape, dtype, seed):
    """A random cache [2, ...] of `dtype` and the float32 values attention reads from it."""
    torch.manual_seed(seed)
    values = torch.randn(shape)
    if dtype not in FP8:
        cache = values.to(dtype)
        return cache, cache.float(), (1.0, 1.0)
    k_scale, v_scale = SCALES[dtype]
    cache = torch.stack((to_kv(values[0], dtype, k_scale), to_kv(values[1], dtype, v_scale)))
    read = torch.stack((from_kv(cache[0], torch.float32, k_scale), from_kv(cache[1], torch.float32, v_scale)))
    return cache, read, (k_scale, v_scale)


@pytest.mark.parametrize("kv_dtype", KV_DTYPES, ids=str)
@pytest.mark.parametrize("window,first", [(None, 0), (40, 0), (None, 64)])
@pytest.mark.parametrize("lens", [[97, 130, 65, 200, 81], [150]])   # one sequence: split by kv head
def test_paged_decode_matches_float64(kv_dtype, window, first, lens):
    """Every cache dtype: float32 and bf16 values as they are, fp8 ones times their scales; the
    bf16/fp8 loops' query and probabilities in two bf16 halves keep 1e-5."""
    tables, meta = decode_batch(lens, 0, num_blocks=120, seed=0)
    cache, read, (k_scale, v_scale) = _cache((2, 120, 16, 3, 64), kv_dtype, seed=0)
    q = torch.randn(len(lens), 9, 64)
    out, lse = cpu_paged_decode.paged_decode(q, cache, meta.block_tables, meta.seq_lens, 0.125, window,
                                             first_pos=first, return_lse=True, k_scale=k_scale, v_scale=v_scale)
    ref, ref_lse = _attend(q, read, tables, lens, 0.125, window, first)
    assert (out.double() - ref).abs().max().item() < 1e-5
    assert (lse.double() - ref_lse).abs().max().item() < 1e-4


@pytest.mark.parametrize("kv_dtype", KV_DTYPES, ids=str)
@pytest.mark.parametrize("heads,kv_heads,head_size", [(8, 2, 128), (8, 8, 64), (12, 2, 64), (4, 2, 80)])
@pytest.mark.parametrize("lens", [[97, 130, 5, 200, 16], [150]])
def test_paged_decode_head_layouts_match_float64(kv_dtype, heads, kv_heads, head_size, lens):
    """The vector loops (head sizes 64 and 128: groups of 1, 4 and 6 query heads, accumulators
    in chunks) and the scalar loop (80) against float64, lengths off and on the 16-row chunks."""
    tables, meta = decode_batch(lens, 0, num_blocks=120, seed=1)
    cache, read, (k_scale, v_scale) = _cache((2, 120, 16, kv_heads, head_size), kv_dtype, seed=1)
    q = torch.randn(len(lens), heads, head_size)
    out = cpu_paged_decode.paged_decode(q, cache, meta.block_tables, meta.seq_lens, 0.1, None,
                                        k_scale=k_scale, v_scale=v_scale)
    ref, _ = _attend(q, read, tables, lens, 0.1)
    assert (out.double() - ref).abs().max().item() < 1e-5


def _attend_entry(kv_dtype):
    """The NATIVE_DECODE_ABI entry for a cache of `kv_dtype`, as the fused step calls it."""
    i64, p = ctypes.c_int64, ctypes.c_void_p
    f32 = ctypes.c_float
    signature = ctypes.CFUNCTYPE(None, p, p, p, p, p, p, i64, p, p, i64, i64, i64, i64, i64, i64, f32, i64,
                                 f32, f32, f32)
    return signature(cpu_paged_decode.native_attend_address(kv_dtype))


@pytest.mark.parametrize("kv_dtype", KV_DTYPES, ids=str)
@pytest.mark.parametrize("shared_blocks,head_size", [(0, 64), (9, 64), (9, 128), (3, 64)])
def test_native_attend_entry_writes_then_attends_with_shared_prefix(kv_dtype, shared_blocks, head_size):
    """The fused step's entry (NATIVE_DECODE_ABI): new K/V rows written to their slots (fp8: the
    same bytes as torch's to_kv), then attention; tables sharing >= 128 leading positions (9
    blocks) take the cascade pass (the prefix once for all rows, merged by log-sum-exp), 3
    shared blocks the plain one. Both equal float64 over the written cache."""
    lens = [170, 200, 161, 190, 145, 177]
    tables, meta = decode_batch(lens, shared_blocks, num_blocks=120, seed=2)
    heads, kv_heads = 9, 3
    cache, _, (k_scale, v_scale) = _cache((2, 120, 16, kv_heads, head_size), kv_dtype, seed=2)
    q = torch.randn(len(lens), heads, head_size)
    k, v = torch.randn(len(lens), kv_heads, head_size), torch.randn(len(lens), kv_heads, head_size)
    out = torch.empty_like(q)
    slots = meta.slot_mapping.to(torch.int64).contiguous()
    _attend_entry(kv_dtype)(q.data_ptr(), k.data_ptr(), v.data_ptr(), cache.data_ptr(), slots.data_ptr(),
                            meta.block_tables.data_ptr(), meta.block_tables.shape[1], meta.seq_lens.data_ptr(),
                            out.data_ptr(), len(lens), heads, kv_heads, head_size, 16, 120, 0.1, 0, k_scale, v_scale,
                            0.0)
    flat = cache.view(2, -1, kv_heads, head_size)
    as_bytes = (lambda t: t.view(torch.uint8)) if kv_dtype in FP8 else (lambda t: t)
    assert torch.equal(as_bytes(flat[0, slots]), as_bytes(to_kv(k, kv_dtype, k_scale)))
    assert torch.equal(as_bytes(flat[1, slots]), as_bytes(to_kv(v, kv_dtype, v_scale)))
    read = torch.stack((from_kv(cache[0], torch.float32, k_scale), from_kv(cache[1], torch.float32, v_scale)))
    ref, _ = _attend(q, read, tables, lens, 0.1)
    # A bf16 or fp8 cache's shared prefix runs on the prompt kernels' bf16 tiles (AVX512-BF16, or
    # AMX where the CPU has them), with the query and the probabilities in bf16 as they have
    # them (2^-8 relative).
    on_tiles = kv_dtype != torch.float32 and shared_blocks >= 9 and cpu_flash_prefill.available() is None
    assert (out.double() - ref).abs().max().item() < (4e-3 if on_tiles else 1e-5)


@pytest.mark.parametrize("kv_dtype", KV_DTYPES, ids=str)
@pytest.mark.parametrize("head_size,window", [(64, 0), (128, 0), (64, 40), (80, 0)])
def test_native_attend_entry_soft_caps_scores(kv_dtype, head_size, window):
    """Gemma 2's logit soft-cap inside the fused step's entry: scores cap * tanh(score / cap) before
    the softmax, on every path (vector and bf16-dot loops, a window, shared prefixes that would
    otherwise take the cascade pass), equal to float64."""
    lens = [170, 200, 161, 190]
    tables, meta = decode_batch(lens, 9, num_blocks=120, seed=5)
    heads, kv_heads, cap = 8, 2, 2.0
    cache, _, (k_scale, v_scale) = _cache((2, 120, 16, kv_heads, head_size), kv_dtype, seed=5)
    q = torch.randn(len(lens), heads, head_size) * 3           # scores well past the cap
    k, v = torch.randn(len(lens), kv_heads, head_size), torch.randn(len(lens), kv_heads, head_size)
    out = torch.empty_like(q)
    _attend_entry(kv_dtype)(q.data_ptr(), k.data_ptr(), v.data_ptr(), cache.data_ptr(),
                            meta.slot_mapping.to(torch.int64).contiguous().data_ptr(), meta.block_tables.data_ptr(),
                            meta.block_tables.shape[1], meta.seq_lens.data_ptr(), out.data_ptr(), len(lens), heads,
                            kv_heads, head_size, 16, 120, 0.125, window, k_scale, v_scale, cap)
    read = torch.stack((from_kv(cache[0], torch.float32, k_scale), from_kv(cache[1], torch.float32, v_scale)))
    capped, _ = _attend(q, read, tables, lens, 0.125, window=window or None, softcap=cap)
    plain, _ = _attend(q, read, tables, lens, 0.125, window=window or None)
    assert (out.double() - capped).abs().max().item() < 1e-5
    assert (out.double() - plain).abs().max().item() > 1e-2       # the cap changed the answer


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("rows", [3, 300])
def test_native_kv_row_write_equals_write_kv(dtype, rows):
    """The native slot write gives write_kv's cache, keys and values read from strided views of a
    fused qkv output; what it does not take (another dtype than the cache's) it leaves untouched."""
    from tokenmill.attention_backends.interface import write_kv
    torch.manual_seed(0)
    cache = torch.zeros(2, 40, 16, 2, 64, dtype=dtype)
    qkv = torch.randn(rows, 8 * 64, dtype=dtype)
    key, value = qkv[:, 4 * 64:6 * 64].view(rows, 2, 64), qkv[:, 6 * 64:]
    slots = torch.randperm(40 * 16)[:rows]
    expected = cache.clone()
    write_kv(key, value, expected, slots)
    assert cpu_paged_decode.write_kv_rows(key, value, cache, slots)
    assert torch.equal(cache, expected)
    assert not cpu_paged_decode.write_kv_rows(key.half(), value.half(), cache, slots)


@pytest.mark.parametrize("kv_dtype", FP8, ids=str)
def test_fp8_writes_round_like_torch(kv_dtype):
    """The kernel's float -> fp8 rounding against torch's on every kind of value: subnormals,
    ties between two fp8 values, values that round up into the next binade, saturation."""
    finfo = torch.finfo(kv_dtype)
    codes = torch.arange(256, dtype=torch.uint8).view(kv_dtype).float()
    codes = codes[torch.isfinite(codes)].unique()
    mids = (codes[1:] + codes[:-1]) / 2                          # exact ties: round to even
    torch.manual_seed(3)
    spread = torch.randn(4096) * torch.exp2(torch.empty(4096).uniform_(-20, 18))
    values = torch.cat([codes, mids, torch.nextafter(mids, codes[1:]), torch.nextafter(mids, codes[:-1]), spread,
                        torch.tensor([finfo.max * 1.01, -finfo.max * 3, 1e30, -1e-30, 0.0, -0.0])])
    rows = (values.numel() + 63) // 64
    padded = torch.zeros(rows * 64)
    padded[:values.numel()] = values
    k = padded.view(rows, 1, 64)
    cache = torch.zeros(2, rows, 1, 1, 64, dtype=kv_dtype)
    slots = torch.arange(rows, dtype=torch.int64)
    tables = torch.arange(rows, dtype=torch.int32).view(rows, 1)
    lens = torch.ones(rows, dtype=torch.int32)
    q, out = torch.zeros(rows, 1, 64), torch.empty(rows, 1, 64)
    _attend_entry(kv_dtype)(q.data_ptr(), k.data_ptr(), k.data_ptr(), cache.data_ptr(), slots.data_ptr(),
                            tables.data_ptr(), 1, lens.data_ptr(), out.data_ptr(), rows, 1, 1, 64, 1, rows, 1.0, 0,
                            1.0, 1.0, 0.0)
    want = to_kv(k, kv_dtype).view(torch.uint8).reshape(-1)
    got = cache[0].reshape(-1).view(torch.uint8)
    assert torch.equal(got, want), (values[(got != want)[:values.numel()]][:8])
    assert torch.equal(out, k.float().clamp(-finfo.max, finfo.max).to(kv_dtype).float())   # one position: v


@pytest.mark.parametrize("kv_dtype", KV_DTYPES, ids=str)
@pytest.mark.parametrize("shared_blocks", [0, 9])
def test_cpu_sdpa_decode_native_equals_torch_path(monkeypatch, kv_dtype, shared_blocks):
    """float32 activations over a float32, bf16 or fp8 cache, with and without a shared prefix
    (cascade): the native kernel and the torch path give the same attention."""
    lens = [170, 200, 161, 190]
    cache, _, meta = _paged(lens, shared_blocks=shared_blocks, dtype=kv_dtype)
    q, k, v = torch.randn(4, 9, 64), torch.randn(4, 3, 64), torch.randn(4, 3, 64)
    backend = CpuSdpaAttention(9, 64, 0.125, 3)
    native = backend.forward(q, k, v, cache.clone(), meta)
    assert (meta._cpu_sdpa_step_cache["cascade"] is not None) == (shared_blocks > 0)
    monkeypatch.setenv("TOKENMILL_CPU_KERNELS", "0")
    plain = backend.forward(q, k, v, cache.clone(), _paged(lens, shared_blocks=shared_blocks, dtype=kv_dtype)[2])
    assert (native - plain).abs().max().item() < 1e-5


PREFILL_KV = [torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2]


def _prefill_batch(chunks, contexts, shared_blocks, heads, kv_heads, head_size, kv_dtype, seed=0):
    """Prompt chunks (query lengths) after cached contexts in a random cache [2, 120, 16, Hkv, D]:
    tables from shuffled blocks, the first `shared_blocks` the same for every chunk."""
    lens = [c + n for c, n in zip(contexts, chunks)]
    tables, meta = decode_batch(lens, shared_blocks, num_blocks=120, seed=seed)
    meta = build_metadata(list(chunks), lens, tables, 16)
    torch.manual_seed(seed)
    values = torch.randn(2, 120, 16, kv_heads, head_size)
    cache = values.bfloat16() if kv_dtype == torch.bfloat16 else to_kv(values, kv_dtype)
    return cache, tables, meta, lens


def _prefill_reference(q, cache, tables, lens, chunks, scale, k_scale=1.0, v_scale=1.0):
    """Each chunk's queries causally over its sequence's positions, in float64."""
    kv_heads = cache.shape[3]
    group = q.shape[1] // kv_heads
    values = (cache.float() if cache.dtype == torch.bfloat16 else from_kv(cache, torch.float32)).double()
    out, row = torch.empty(q.shape, dtype=torch.float64), 0
    for s, (n, chunk) in enumerate(zip(lens, chunks)):
        kv = torch.cat([values[:, b] for b in tables[s]], dim=1)[:, :n]
        k = kv[0].repeat_interleave(group, 1) * k_scale               # [n, H, D]
        v = kv[1].repeat_interleave(group, 1) * v_scale
        qs = q[row:row + chunk].double()
        scores = torch.einsum("qhd,khd->hqk", qs, k) * scale
        seen = torch.arange(n)[None] <= torch.arange(n - chunk, n)[:, None]
        probs = scores.masked_fill(~seen, float("-inf")).softmax(-1)
        out[row:row + chunk] = torch.einsum("hqk,khd->qhd", probs, v)
        row += chunk
    return out


@pytest.mark.parametrize("kv_dtype", PREFILL_KV, ids=str)
@pytest.mark.parametrize("q_dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("shared_blocks,chunks,contexts", [
    (0, [37], [0]),                          # a fresh prompt reads its own keys back
    (0, [5, 32, 17], [40, 0, 100]),          # chunks after private context, one fresh
    (4, [32, 32, 32, 9], [64, 64, 64, 75]),  # W3's shape: chunks after one shared 64-token prefix
])
@pytest.mark.parametrize("heads,kv_heads,head_size", [(9, 3, 64), (4, 2, 128)])
def test_paged_prefill_matches_float64(kv_dtype, q_dtype, shared_blocks, chunks, contexts, heads, kv_heads,
                                       head_size):
    """Prompt chunks over a bf16 or fp8 cache, the query rows strided as a fused QKV output's:
    float64 attention within the bf16 rounding of the query and the probabilities."""
    cache, tables, meta, lens = _prefill_batch(chunks, contexts, shared_blocks, heads, kv_heads, head_size, kv_dtype)
    fused = torch.randn(sum(chunks), heads + 2 * kv_heads, head_size).to(q_dtype)
    q = fused[:, :heads]
    k_scale, v_scale = (0.5, 2.0) if kv_dtype != torch.bfloat16 else (1.0, 1.0)
    out = cpu_paged_decode.paged_prefill(q, cache, meta.block_tables, meta.seq_lens,
                                         torch.tensor(meta.query_start_loc_cpu), 0.125, k_scale, v_scale)
    if out is None:
        pytest.skip("paged_prefill does not run on this CPU (no AVX512-BF16, or AMX: flash_prefill's tiles)")
    assert out.dtype == q_dtype and out.shape == q.shape
    want = _prefill_reference(q, cache, tables, lens, chunks, 0.125, k_scale, v_scale)
    assert (out.double() - want).abs().max().item() < 2e-2 * v_scale


@pytest.mark.parametrize("kv_dtype", PREFILL_KV, ids=str)
def test_cpu_sdpa_prefill_native_equals_torch_path(monkeypatch, kv_dtype):
    """A step of two decodes and three prompt chunks (after a shared prefix, after private
    context, fresh): the native paged prefill and the torch path agree to bf16 rounding."""
    chunks, contexts = [1, 1, 32, 32, 20], [90, 120, 64, 64, 0]
    cache, _, meta, _ = _prefill_batch(chunks, contexts, 4, 9, 3, 64, kv_dtype)
    tokens = sum(chunks)
    q, k, v = torch.randn(tokens, 9, 64), torch.randn(tokens, 3, 64), torch.randn(tokens, 3, 64)
    backend = CpuSdpaAttention(9, 64, 0.125, 3)
    native_cache = cache.clone()
    native = backend.forward(q, k, v, native_cache, meta)
    if not cpu_paged_decode.prefill_may_run():
        pytest.skip("paged_prefill does not run on this CPU")
    monkeypatch.setenv("TOKENMILL_CPU_KERNELS", "0")
    plain_cache = cache.clone()
    plain = backend.forward(q, k, v, plain_cache, _prefill_batch(chunks, contexts, 4, 9, 3, 64, kv_dtype)[2])
    assert torch.equal(native_cache.view(torch.uint8), plain_cache.view(torch.uint8))   # the same writes
    assert (native - plain).abs().max().item() < 2e-2


def test_int8_quantize_and_dequantize_match_torch():
    torch.manual_seed(0)
    x = torch.randn(64, 576)
    x[:, 17] *= 60                      # outlier channels, as LLM activations have
    x[:, 300] *= 25
    weight = torch.randn(960, 576)
    int8_weight, channel_scale = cpu_int4.quantize_int8_per_channel(weight)
    by_channel = weight.t().contiguous().t()
    bias = torch.randn(960)
    q, token_scale, channels, values = cpu_kernels.quantize_rows_int8(x, 16)
    assert {17, 300} <= set(channels.tolist())
    assert torch.equal(values, x[:, channels])
    kernels = CpuPlatform().quantization_kernels("int4")     # what the platform hands the int4 method
    assert {"quantize_rows_int8", "dequantize_int32"} <= set(kernels.offered()) <= {
        "quantize_rows_int8", "dequantize_int32", "pack_s8", "matmul_s8"}
    native = cpu_int4.int8_matmul_per_token(x, int8_weight, channel_scale, by_channel, 16, bias, kernels)
    plain = cpu_int4.int8_matmul_per_token(x, int8_weight, channel_scale, by_channel, 16, bias)
    torch.testing.assert_close(native, plain, atol=1e-3, rtol=1e-5)
    exact = x @ weight.t() + bias
    # int8 error stays small next to the output's scale, thanks to the outlier channels.
    assert (native - exact).abs().max() < 0.01 * exact.abs().max()
    if kernels.pack_s8 is not None:
        # The batched path the int4 method takes with them: activations per 32 inputs, the same
        # int8 weights, no outlier channels: the two groups holding the 60x / 25x channels lose
        # their small values (measured 1.4 % of the output's scale here, 0.5 % for the weights'
        # own rounding), every other group keeps its own scale.
        s8 = kernels.matmul_s8(x, kernels.pack_s8(int8_weight.t(), channel_scale), bias)
        assert (s8 - exact).abs().max() < 0.02 * exact.abs().max()
        x[:, 17] /= 60
        x[:, 300] /= 25
        s8 = kernels.matmul_s8(x, kernels.pack_s8(int8_weight.t(), channel_scale), bias)
        exact = x @ weight.t() + bias
        assert (s8 - exact).abs().max() < 0.015 * exact.abs().max()      # measured 1.1 %


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_layer_kernels_match_the_torch_layers(dtype):
    """RMSNorm (with and without the residual add; Gemma's (1 + w) form, also over a per-head
    [T, heads, D] view), rotary embedding on a strided view of a fused qkv output, and SiLU- and
    GELU-tanh-and-multiply: native and torch agree to float32 rounding; in bf16 they
    round where torch's bf16 ops round, so all but a few elements (exp's last bit) are equal."""
    from tokenmill.core.layers.activation import GatedActivation, SiluAndMul
    from tokenmill.core.layers.norm import RMSNorm
    from tokenmill.core.layers.rotary import RotaryEmbedding
    from tokenmill.platforms.cpu_layer_kernels import NativeGatedMul, NativeRMSNorm, NativeRotary

    def agree(got, want):
        if dtype == torch.float32:
            torch.testing.assert_close(got, want)
        else:
            assert got.dtype == torch.bfloat16 and (got == want).float().mean() > 0.999
            torch.testing.assert_close(got, want, rtol=1e-2, atol=1e-2)

    torch.manual_seed(0)
    for rows in (1, 5, 40):                       # 40: the threaded branch
        norm = RMSNorm(576, 1e-5, dtype=dtype)
        norm.weight.data.normal_()
        x, res = torch.randn(rows, 576, dtype=dtype), torch.randn(rows, 576, dtype=dtype)
        plain, plain_pair = norm(x), norm(x, res)
        norm.use_kernel(NativeRMSNorm())
        agree(norm(x), plain)
        for got, want in zip(norm(x, res), plain_pair):
            agree(got, want)

        gemma = RMSNorm(576, 1e-6, dtype=dtype, offset=1.0)
        gemma.weight.data.normal_(0, 0.3)
        head_norm = RMSNorm(64, 1e-6, dtype=dtype, offset=1.0)
        head_norm.weight.data.normal_(0, 0.3)
        heads = torch.randn(rows, 12, 64, dtype=dtype)[:, :9]       # q heads of a fused q|k view
        plain, plain_pair, plain_heads = gemma(x), gemma(x, res), head_norm(heads)
        gemma.use_kernel(NativeRMSNorm())
        head_norm.use_kernel(NativeRMSNorm())
        agree(gemma(x), plain)
        for got, want in zip(gemma(x, res), plain_pair):
            agree(got, want)
        assert head_norm(heads).shape == (rows, 9, 64)
        agree(head_norm(heads), plain_heads)
        assert NativeRMSNorm()(x, None, gemma.weight, 1e-6, offset=1.0) is not NotImplemented

        rope = RotaryEmbedding(64, 512, 1.0 / (10000 ** (torch.arange(0, 64, 2).float() / 64)), dtype=dtype)
        qkv = torch.randn(rows, (9 + 3 + 3) * 64, dtype=dtype)
        qk = qkv[:, :12 * 64].view(rows, 12, 64)  # row stride 15 * 64: not contiguous
        positions = torch.randint(0, 512, (rows,))
        plain = rope(positions, qk)
        rope.use_kernel(NativeRotary())
        rope.new_forward()
        agree(rope(positions, qk), plain)
        for rotary_dim, interleaved in ((48, False), (32, True), (64, True)):     # Phi-3, GLM, GPT-J
            inv_freq = 1.0 / (10000 ** (torch.arange(0, rotary_dim, 2).float() / rotary_dim))
            partial = RotaryEmbedding(64, 512, inv_freq, dtype=dtype, rotary_dim=rotary_dim, interleaved=interleaved)
            plain = partial(positions, qk)
            partial.use_kernel(NativeRotary())
            partial.new_forward()
            agree(partial(positions, qk), plain)
            assert NativeRotary()(positions, qk, partial.cos_sin_cache, rotary_dim=rotary_dim,
                                  interleaved=interleaved) is not NotImplemented

        act = SiluAndMul()
        h = torch.randn(rows, 2 * 1536, dtype=dtype)
        plain = act(h)
        act.use_kernel(NativeGatedMul("silu"))
        agree(act(h), plain)

        geglu = GatedActivation("gelu_tanh")
        plain = geglu(h)
        geglu.use_kernel(NativeGatedMul("gelu_tanh"))
        agree(geglu(h), plain)
        assert NativeGatedMul("gelu_tanh")(h) is not NotImplemented
    # What a kernel does not cover falls back to torch.
    assert NativeGatedMul("silu")(torch.randn(2, 8, dtype=torch.float16)) is NotImplemented
    assert NativeRMSNorm()(x, None, norm.weight.float() if dtype == torch.bfloat16 else norm.weight.bfloat16(),
                           1e-5) is NotImplemented


def test_kernels_off_by_environment(monkeypatch):
    """TOKENMILL_CPU_KERNELS=0: nothing native is offered, so every layer stays on torch."""
    from tokenmill.core.config import EngineConfig
    monkeypatch.setenv("TOKENMILL_CPU_KERNELS", "0")
    config = EngineConfig.from_kwargs(quantization="int4", dtype="float32")
    platform = CpuPlatform()
    assert platform.layer_kernels(config).offered() == {} and platform.quantization_kernels("int4").offered() == []
    assert cpu_kernels.available() and cpu_paged_decode.available()
    monkeypatch.delenv("TOKENMILL_CPU_KERNELS")
    assert set(platform.layer_kernels(config).offered()) == {"rms_norm", "rotary", "silu_and_mul", "gelu_tanh_and_mul",
                                                             "lm_head", "moe", "gated_delta_rule"}
