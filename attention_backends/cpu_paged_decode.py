"""cpu_sdpa's native paged decode attention (platforms/csrc/paged_decode.cpp).

It reads K/V blocks in place: the gather + SDPA path it replaces copied every sequence's whole
context into a contiguous tensor each decode step, which cost more than the attention itself.
Built on first use by the shared helper platforms/native_build.py (which holds no kernel and
imports nothing of tokenmill's); TOKENMILL_CPU_KERNELS=0 or a missing compiler leaves cpu_sdpa
on its torch path.
"""
from __future__ import annotations

import ctypes
from typing import Optional

import torch

from tokenmill.platforms.native_build import NativeLibrary, source

ABI_VERSION = 6

# The cache dtypes the kernel reads, by the suffix of their entries (fp8 caches as their bytes).
_SUFFIX = {torch.float32: "f32", torch.bfloat16: "bf16kv", torch.float8_e4m3fn: "fp8e4m3",
           torch.float8_e5m2: "fp8e5m2"}
KV_DTYPES = tuple(_SUFFIX)
# The caches paged_prefill reads (bf16 tiles: every fp8 value is a bf16 value).
_PREFILL_SUFFIXES = ("bf16kv", "fp8e4m3", "fp8e5m2")
PREFILL_HEAD_SIZES = (64, 128)


def _declare(lib: ctypes.CDLL) -> None:
    p, i64, f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
    for suffix in _SUFFIX.values():
        decode = getattr(lib, f"paged_decode_{suffix}")
        decode.argtypes = [p, p, p, i64, p, p, i64, i64, i64, i64, i64, i64, f32, i64, i64, p, f32, f32]
        decode.restype = None
        getattr(lib, f"paged_attend_{suffix}").restype = None
        if suffix in _PREFILL_SUFFIXES:
            prefill = getattr(lib, f"paged_prefill_{suffix}")
            prefill.argtypes = [p, i64, i64, p, p, i64, p, p, p, i64, i64, i64, i64, i64, i64, f32, f32, f32]
            prefill.restype = i64
    lib.scatter_kv_rows.argtypes = [p, p, i64, p, p, i64, p, i64]
    lib.scatter_kv_rows.restype = None


LIBRARY = NativeLibrary(source("paged_decode.cpp"), ABI_VERSION, _declare)


def available() -> Optional[str]:
    """None when the kernel loads here, else why not. Cheap once loaded (asked per layer)."""
    return LIBRARY.available()


def paged_decode(q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
                 seq_lens: torch.Tensor, scale: float, sliding_window: Optional[int],
                 first_pos: int = 0, return_lse: bool = False, k_scale: float = 1.0, v_scale: float = 1.0):
    """q [B, H, D] float32 (one token per sequence) attending to its sequence's positions
    [first_pos, seq_lens[b]) in the paged cache [2, num_blocks, block_size, Hkv, D] (float32,
    bfloat16, or fp8 e4m3 / e5m2 holding k / k_scale and v / v_scale). Returns [B, H, D] float32,
    and with `return_lse` also the log-sum-exp [B, H] of the scaled scores. The caller checks
    `available()` first."""
    lib = LIBRARY.require()
    if q.dtype != torch.float32 or kv_cache.dtype not in _SUFFIX:
        raise ValueError(f"paged_decode takes float32 queries and a cache of one of {list(KV_DTYPES)}, "
                         f"got {q.dtype} and {kv_cache.dtype}")
    q = q.contiguous()
    kv_cache = kv_cache if kv_cache.is_contiguous() else kv_cache.contiguous()
    tables = block_tables if block_tables.dtype == torch.int32 else block_tables.to(torch.int32)
    tables = tables.contiguous()
    lens = seq_lens.to(torch.int32).contiguous()
    num_seqs, num_heads, head_size = q.shape
    _, num_blocks, block_size, num_kv_heads, _ = kv_cache.shape
    out = torch.empty_like(q)
    lse = torch.empty((num_seqs, num_heads), dtype=torch.float32) if return_lse else None
    fn = getattr(lib, f"paged_decode_{_SUFFIX[kv_cache.dtype]}")
    fn(q.data_ptr(), kv_cache.data_ptr(), tables.data_ptr(), tables.shape[1], lens.data_ptr(), out.data_ptr(),
       num_seqs, num_heads, num_kv_heads, head_size, block_size, num_blocks, float(scale),
       int(sliding_window or 0), int(first_pos), lse.data_ptr() if lse is not None else None,
       float(k_scale), float(v_scale))
    return (out, lse) if return_lse else out


def write_kv_rows(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> bool:
    """interface.write_kv for keys and values already in the cache's dtype (bf16 or float32 caches:
    no conversion or scale): each token's [Hkv * D] row copied to its slot natively. False (nothing
    written) where that does not hold; the caller then takes write_kv."""
    if (key.dtype != kv_cache.dtype or value.dtype != kv_cache.dtype or key.dtype not in (torch.float32, torch.bfloat16)
            or not kv_cache.is_contiguous() or slot_mapping.dtype != torch.int64 or available() is not None):
        return False
    rows, width = slot_mapping.numel(), kv_cache.shape[3] * kv_cache.shape[4]
    key, value = key.reshape(rows, width), value.reshape(rows, width)
    if key.stride(1) != 1 or value.stride() != key.stride():
        key, value = key.contiguous(), value.contiguous()
    slots = slot_mapping.contiguous()
    half = kv_cache.shape[1] * kv_cache.shape[2] * width * kv_cache.element_size()
    LIBRARY.require().scatter_kv_rows(key.data_ptr(), value.data_ptr(), key.stride(0) * key.element_size(),
                                      kv_cache.data_ptr(), kv_cache.data_ptr() + half, width * key.element_size(),
                                      slots.data_ptr(), rows)
    return True


def native_attend_address(kv_dtype: torch.dtype) -> Optional[int]:
    """The address of the write-and-attend entry (interface.NATIVE_DECODE_ABI) for a cache of
    `kv_dtype`, None for other dtypes. The caller checks `available()` first."""
    lib = LIBRARY.require()
    suffix = _SUFFIX.get(kv_dtype)
    return ctypes.cast(getattr(lib, f"paged_attend_{suffix}"), ctypes.c_void_p).value if suffix else None


_prefill_runs_here: Optional[bool] = None     # None until the first call says


def prefill_may_run() -> bool:
    """False once paged_prefill has found that it does not run here."""
    return _prefill_runs_here is not False


def paged_prefill(q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
                  starts: torch.Tensor, scale: float, k_scale: float = 1.0, v_scale: float = 1.0,
                  out: Optional[torch.Tensor] = None) -> Optional[torch.Tensor]:
    """Causal attention of prompt chunks whose K/V are already written to a bf16 or fp8 cache
    [2, num_blocks, block_size, Hkv, D]: chunk s is rows starts[s] .. starts[s + 1] - 1 of q
    [T, H, D] (float32 or bf16), its last query at position seq_lens[s] - 1; block_tables [S, W]
    its blocks. A prefix of blocks every chunk shares is read once (cascade), and each chunk's
    positions follow it in one online softmax (no merge). q's rows may be strided (a view of a
    fused QKV output). Returns `out` (or a new [T, H, D] in q's dtype), or None where the kernel
    does not run (no AVX512-BF16, an AMX host: cpu_sdpa keeps its flash path)."""
    global _prefill_runs_here
    if _prefill_runs_here is False:
        return None
    suffix = _SUFFIX.get(kv_cache.dtype)
    if suffix not in _PREFILL_SUFFIXES or q.dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"paged_prefill takes float32 or bf16 queries and a bf16 or fp8 cache, "
                         f"got {q.dtype} and {kv_cache.dtype}")
    total, num_heads, head_size = q.shape
    _, num_blocks, block_size, num_kv_heads, _ = kv_cache.shape
    if head_size not in PREFILL_HEAD_SIZES or num_heads % num_kv_heads:
        raise ValueError(f"paged_prefill: head size {head_size} (one of {PREFILL_HEAD_SIZES}) with "
                         f"{num_heads} query heads over {num_kv_heads} KV heads")
    if q.stride(2) != 1 or q.stride(1) != head_size:
        q = q.contiguous()
    tables = block_tables.to(torch.int32).contiguous()
    lens = seq_lens.to(torch.int32).contiguous()
    starts = starts.to(torch.int64).contiguous()
    if starts.numel() != lens.numel() + 1 or int(starts[0]) != 0 or int(starts[-1]) != total:
        raise ValueError(f"paged_prefill: starts must run from 0 to the {total} query rows, one chunk a sequence")
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype)
    elif out.shape != q.shape or out.dtype != q.dtype or not out.is_contiguous():
        raise ValueError(f"paged_prefill: out must be a contiguous {q.dtype} tensor of shape {tuple(q.shape)}")
    rc = getattr(LIBRARY.require(), f"paged_prefill_{suffix}")(
        q.data_ptr(), q.stride(0), int(q.dtype == torch.bfloat16), kv_cache.data_ptr(), tables.data_ptr(),
        tables.shape[1],
        lens.data_ptr(), starts.data_ptr(), out.data_ptr(), lens.numel(), num_heads, num_kv_heads, head_size,
        block_size, num_blocks, float(scale), float(k_scale), float(v_scale))
    _prefill_runs_here = rc == 0
    return out if rc == 0 else None
