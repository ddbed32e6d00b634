"""cpu_sdpa's native paged decode attention (attention_backends/csrc/paged_decode.cpp).

It reads K/V blocks in place, measured ~10x the gather + SDPA path on a W1-like decode batch.
Built on first use by the shared helper platforms/native_build.py (which holds no kernel and
imports nothing of tokenmill's); TOKENMILL_CPU_KERNELS=0 or a missing compiler leaves cpu_sdpa
on its torch path.
"""
from __future__ import annotations

import ctypes
from pathlib import Path
from typing import Optional

import torch

from tokenmill.platforms.native_build import NativeLibrary

ABI_VERSION = 3

# The cache dtypes the kernel reads, by the suffix of their entries (fp8 caches as their bytes).
_SUFFIX = {torch.float32: "f32", torch.bfloat16: "bf16kv", torch.float8_e4m3fn: "fp8e4m3",
           torch.float8_e5m2: "fp8e5m2"}
KV_DTYPES = tuple(_SUFFIX)


def _declare(lib: ctypes.CDLL) -> None:
    p, i64, f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
    for suffix in _SUFFIX.values():
        decode = getattr(lib, f"paged_decode_{suffix}")
        decode.argtypes = [p, p, p, i64, p, p, i64, i64, i64, i64, i64, i64, f32, i64, i64, p, f32, f32]
        decode.restype = None
        getattr(lib, f"paged_attend_{suffix}").restype = None


LIBRARY = NativeLibrary(Path(__file__).with_name("csrc") / "paged_decode.cpp", ABI_VERSION, _declare)


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


def native_attend_address(kv_dtype: torch.dtype) -> Optional[int]:
    """The address of the write-and-attend entry (interface.NATIVE_DECODE_ABI) for a cache of
    `kv_dtype`, None for other dtypes. The caller checks `available()` first."""
    lib = LIBRARY.require()
    suffix = _SUFFIX.get(kv_dtype)
    return ctypes.cast(getattr(lib, f"paged_attend_{suffix}"), ctypes.c_void_p).value if suffix else None
