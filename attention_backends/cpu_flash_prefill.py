"""cpu_sdpa's bf16 prompt attention on AVX512-BF16 (platforms/csrc/flash_prefill.cpp).

A flash-attention kernel for bf16 queries and keys/values: float32 scores and accumulators, the
probabilities rounded to bf16 for P.V. torch's CPU flash kernel runs small per-block GEMMs far
below the bf16 dot product's rate, and a long prompt spends most of its time there; this one
reads K and V in the pair layouts the bf16 dot product takes, and on a CPU with AMX
multiplies them as tiles (platforms/csrc/flash_tiles.h). Built on first use by
platforms/native_build.py; TOKENMILL_CPU_KERNELS=0, a missing compiler or a CPU without
AVX512-BF16 (the build is refused: `available()` says so) leaves cpu_sdpa on torch's SDPA.
`torch_flash`/`torch_flash_batch`: the same contract on torch's flash kernel, for a CPU whose AMX
tiles this build cannot use (`torch_kernel_is_faster`).
"""
from __future__ import annotations

import ctypes
import functools
from typing import Optional

import torch

from tokenmill.platforms.native_build import NativeLibrary, source

ABI_VERSION = 3
HEAD_SIZES = (64, 128)


def _declare(lib: ctypes.CDLL) -> None:
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    lib.flash_prefill_available.restype = i64
    lib.flash_prefill_available.argtypes = []
    lib.flash_prefill_bf16.restype = i64
    lib.flash_prefill_bf16.argtypes = [p, i64, p, i64, p, i64, p, i64, i64, i64, i64, i64, i64, ctypes.c_float,
                                       i64, i64, p, i64]
    lib.flash_prefill_batch_bf16.restype = i64
    lib.flash_prefill_batch_bf16.argtypes = [p, i64, p, i64, p, i64, p, i64, p, i64, i64, i64, i64, ctypes.c_float, i64,
                                             p, i64]


LIBRARY = NativeLibrary(source("flash_prefill.cpp"), ABI_VERSION, _declare)


@functools.lru_cache(maxsize=None)
def available() -> Optional[str]:
    """None when the kernel runs here, else why not."""
    why = LIBRARY.available()
    if why is None and not LIBRARY.require().flash_prefill_available():
        why = "this CPU has no AVX512-BF16"
    return why


@functools.lru_cache(maxsize=None)
def torch_kernel_is_faster() -> bool:
    """Whether torch's own CPU flash attention beats this kernel here: on a CPU with AMX tiles
    that this build cannot use (torch's brgemm multiplies its bf16 blocks on them, while this
    kernel would fall back to AVX512-BF16 dot products, several times slower than tiles). Without
    AMX, or with this build's own AMX tiles, this kernel is the faster one."""
    probe = getattr(torch.cpu, "_is_amx_tile_supported", None)
    if probe is None or not probe():
        return False
    return available() is not None or LIBRARY.require().flash_prefill_available() != 3


def torch_flash(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, q_offset: int, causal: bool,
                return_lse: bool = False):
    """flash_prefill's contract (bf16 q [Tq, H, D] at positions q_offset + i, k/v [Tk, Hkv, D];
    out bf16 [Tq, H, D], lse [H, Tq]) on torch's CPU flash kernel, for any head size."""
    tq, heads, _ = q.shape
    tk, kv_heads, _ = k.shape
    if heads % kv_heads:
        raise ValueError(f"flash_prefill: {heads} query heads are not a multiple of {kv_heads} KV heads")
    mask, top_left = None, causal
    if causal and (q_offset or tq != tk):
        # torch's is_causal aligns the first query with the first key; ours sits at q_offset.
        seen = torch.arange(tk) <= torch.arange(q_offset, q_offset + tq).unsqueeze(1)
        mask = torch.zeros((tq, tk), dtype=q.dtype).masked_fill_(~seen, float("-inf"))
        top_left = False
    out, lse = _torch_flash_heads(q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), scale, top_left, mask)
    return (out[0], lse[0]) if return_lse else out[0]


def torch_flash_batch(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, starts: torch.Tensor,
                      causal: bool, return_lse: bool = False):
    """flash_prefill_batch's contract on torch's CPU flash kernel: prompts of one length in one
    call, others one call each."""
    total, heads, d = q.shape
    bounds = starts.tolist()
    lengths = {b - a for a, b in zip(bounds, bounds[1:])}
    if len(lengths) == 1:
        batch, length = len(bounds) - 1, lengths.pop()
        out, lse = _torch_flash_heads(q.view(batch, length, heads, d), k.view(batch, length, -1, d),
                                      v.view(batch, length, -1, d), scale, causal, None)
        out = out.reshape(total, heads, d)
        lse = lse.transpose(0, 1).reshape(heads, total)
    else:
        parts = [torch_flash(q[a:b], k[a:b], v[a:b], scale, 0, causal, True) for a, b in zip(bounds, bounds[1:])]
        out = torch.cat([o for o, _ in parts])
        lse = torch.cat([l for _, l in parts], dim=1)
    return (out, lse) if return_lse else out


def _torch_flash_heads(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal: bool,
                       mask: Optional[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """[B, T, H(kv), D] operands -> out [B, Tq, H, D], lse [B, H, Tq]. The KV heads are repeated
    for the group: measured faster than SDPA's own GQA, and the flash op takes equal heads only."""
    group = q.shape[2] // k.shape[2]
    k, v = k.transpose(1, 2), v.transpose(1, 2)
    if group > 1:
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q.transpose(1, 2), k, v, 0.0, causal, attn_mask=mask, scale=scale)[:2]
    return out.transpose(1, 2), lse


def covers(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether flash_prefill takes these operands (bf16, head sizes 64/128, dims contiguous)."""
    return (q.dtype == k.dtype == v.dtype == torch.bfloat16 and q.shape[-1] in HEAD_SIZES
            and all(t.dim() == 3 and t.stride(2) == 1 and t.stride(1) == t.shape[2] for t in (q, k, v))
            and k.shape == v.shape and available() is None)


def flash_prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, q_offset: int, causal: bool,
                  return_lse: bool = False, window: Optional[int] = None):
    """q [Tq, H, D] at positions q_offset + i, against k/v [Tk, Hkv, D] at positions 0 .. Tk - 1
    (causal: query i sees keys <= q_offset + i; with a sliding `window`, also keys > q_offset + i -
    window). Returns [Tq, H, D] bf16, and with `return_lse`
    the log-sum-exp [H, Tq] float32 of each query's scaled scores. `covers(q, k, v)` first."""
    tq, heads, d = q.shape
    tk, kv_heads, _ = k.shape
    if heads % kv_heads:
        raise ValueError(f"flash_prefill: {heads} query heads are not a multiple of {kv_heads} KV heads")
    out = torch.empty((tq, heads, d), dtype=torch.bfloat16)
    lse = torch.empty((heads, tq), dtype=torch.float32) if return_lse else None
    rc = LIBRARY.require().flash_prefill_bf16(
        q.data_ptr(), q.stride(0), k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0), out.data_ptr(), heads * d,
        tq, tk, heads, kv_heads, d, float(scale), int(q_offset), int(causal),
        lse.data_ptr() if lse is not None else None, int(window or 0))
    if rc != 0:
        raise ValueError(f"flash_prefill: head size {d} is not one of {HEAD_SIZES}")
    return (out, lse) if return_lse else out


def flash_prefill_batch(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, starts: torch.Tensor,
                        causal: bool, return_lse: bool = False, window: Optional[int] = None):
    """Whole prompts back to back in one call: prompt p is rows starts[p] .. starts[p + 1] - 1 of
    q [T, H, D] and k/v [T, Hkv, D] and attends to its own keys only, from position 0 (a batch of
    fresh prompts, or chunks' own tokens). `starts` int64 [batch + 1]. Returns [T, H, D] bf16, and
    with `return_lse` the log-sum-exp [H, T] float32; `window` as flash_prefill's. `covers(q, k, v)`
    first."""
    total, heads, d = q.shape
    kv_heads = k.shape[1]
    if heads % kv_heads:
        raise ValueError(f"flash_prefill: {heads} query heads are not a multiple of {kv_heads} KV heads")
    starts = starts.to(torch.int64).contiguous()
    if starts.numel() < 2 or int(starts[0]) != 0 or int(starts[-1]) != total:
        raise ValueError(f"flash_prefill: starts must run from 0 to the {total} rows")
    out = torch.empty((total, heads, d), dtype=torch.bfloat16)
    lse = torch.empty((heads, total), dtype=torch.float32) if return_lse else None
    rc = LIBRARY.require().flash_prefill_batch_bf16(
        q.data_ptr(), q.stride(0), k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0), out.data_ptr(), heads * d,
        starts.data_ptr(), starts.numel() - 1, heads, kv_heads, d, float(scale), int(causal),
        lse.data_ptr() if lse is not None else None, int(window or 0))
    if rc != 0:
        raise ValueError(f"flash_prefill: head size {d} is not one of {HEAD_SIZES}")
    return (out, lse) if return_lse else out
