"""Native CPU kernels (paged decode attention for cpu_sdpa; int8 GEMM prologue/epilogue for
platforms/cpu_linear.py), built on first use from csrc/ with the system C++
compiler and called through ctypes.

Why not a torch C++ extension: compiling against torch's headers takes a minute on a 2-core
machine; this file has no torch dependency and builds in about a second, once per machine (the
library is cached under ~/.cache/tokenmill/kernels, keyed by source, flags and CPU flags, since
it is built with -march=native). Without a compiler, or with TOKENMILL_CPU_KERNELS=0, callers
fall back to the pure-torch path; `load()` says why.
"""
from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path
from typing import Optional

import torch

logger = logging.getLogger("tokenmill.attention_backends.cpu_kernels")

SOURCE = Path(__file__).with_name("csrc") / "cpu_kernels.cpp"
ABI_VERSION = 4
# -ffast-math at compile time only: it lets gcc call glibc's vectorized expf. (At link time it
# would add crtfastmath.o, which flips the whole process to flush-denormals-to-zero.)
COMPILE_FLAGS = ("-O3", "-march=native", "-ffast-math", "-fopenmp", "-fPIC", "-std=c++17")
LINK_FLAGS = ("-shared", "-fopenmp")

_lock = threading.Lock()
_library: Optional[ctypes.CDLL] = None
_failure: Optional[str] = None


def _cache_dir() -> Path:
    root = os.environ.get("TOKENMILL_KERNEL_CACHE")
    if root:
        return Path(root)
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "tokenmill" / "kernels"


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return line
    except OSError:
        pass
    return ""


def _compiler() -> Optional[str]:
    for name in (os.environ.get("CXX"), "c++", "g++", "clang++"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


def _build(compiler: str, target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        obj = Path(tmp) / "kernels.o"
        lib = Path(tmp) / target.name
        subprocess.run([compiler, *COMPILE_FLAGS, "-c", str(SOURCE), "-o", str(obj)],
                       check=True, capture_output=True, text=True, timeout=300)
        subprocess.run([compiler, *LINK_FLAGS, str(obj), "-o", str(lib)],
                       check=True, capture_output=True, text=True, timeout=300)
        os.replace(lib, target)      # atomic: concurrent builders never see half a library


def _declare(lib: ctypes.CDLL) -> None:
    p, i64, f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
    for fn in (lib.paged_decode_f32, lib.paged_decode_bf16kv):
        fn.argtypes = [p, p, p, i64, p, p, i64, i64, i64, i64, i64, i64, f32, i64, i64, p]
        fn.restype = None
    lib.rms_norm_f32.argtypes = [p, p, p, f32, p, p, i64, i64]
    lib.rope_f32.argtypes = [p, i64, p, p, p, i64, i64, i64]
    lib.silu_mul_f32.argtypes = [p, p, i64, i64]
    for fn in (lib.rms_norm_f32, lib.rope_f32, lib.silu_mul_f32):
        fn.restype = None
    lib.quantize_rows_int8.argtypes = [p, i64, i64, i64, p, p, p, p]
    lib.quantize_rows_int8.restype = None
    lib.dequantize_int32.argtypes = [p, p, p, p, p, p, i64, i64]
    lib.dequantize_int32.restype = None
    lib.tokenmill_kernels_abi_version.restype = ctypes.c_int


def load() -> tuple[Optional[ctypes.CDLL], Optional[str]]:
    """(library, None) when the kernels can run here, else (None, why not). Builds once."""
    global _library, _failure
    with _lock:
        if _library is not None or _failure is not None:
            return _library, _failure
        if os.environ.get("TOKENMILL_CPU_KERNELS", "1") == "0":
            _failure = "disabled by TOKENMILL_CPU_KERNELS=0"
            return None, _failure
        compiler = _compiler()
        if compiler is None:
            _failure = "no C++ compiler found (set CXX, or install g++)"
            logger.warning("native CPU kernels unavailable: %s; using the torch path", _failure)
            return None, _failure
        key = hashlib.sha256()
        for part in (SOURCE.read_bytes(), " ".join(COMPILE_FLAGS + LINK_FLAGS).encode(),
                     compiler.encode(), _cpu_flags().encode()):
            key.update(part)
        name = f"cpu_kernels-{key.hexdigest()[:16]}.so"
        try:
            target = _cache_dir() / name
            if not target.exists():
                try:
                    _build(compiler, target)
                except PermissionError:        # read-only home: build in the temp directory
                    target = Path(tempfile.gettempdir()) / f"tokenmill-kernels-{os.getuid()}" / name
                    if not target.exists():
                        _build(compiler, target)
            lib = ctypes.CDLL(str(target))
            _declare(lib)
            if lib.tokenmill_kernels_abi_version() != ABI_VERSION:
                raise OSError(f"{target} has ABI {lib.tokenmill_kernels_abi_version()}, expected {ABI_VERSION}")
        except (OSError, subprocess.SubprocessError) as exc:
            detail = getattr(exc, "stderr", "") or str(exc)
            _failure = f"building {SOURCE.name} failed: {detail.strip()[:500]}"
            logger.warning("native CPU kernels unavailable: %s; using the torch path", _failure)
            return None, _failure
        _library = lib
        return _library, None


def available() -> Optional[str]:
    """None when the kernels load here, else why not. Cheap once loaded (called per layer);
    TOKENMILL_CPU_KERNELS=0 turns them off at any time."""
    if os.environ.get("TOKENMILL_CPU_KERNELS", "1") == "0":
        return "disabled by TOKENMILL_CPU_KERNELS=0"
    if _library is not None:
        return None
    return load()[1]


def paged_decode(q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
                 seq_lens: torch.Tensor, scale: float, sliding_window: Optional[int],
                 first_pos: int = 0, return_lse: bool = False):
    """q [B, H, D] float32 (one token per sequence) attending to its sequence's positions
    [first_pos, seq_lens[b]) in the paged cache [2, num_blocks, block_size, Hkv, D] (float32 or
    bfloat16). Returns [B, H, D] float32, and with `return_lse` also the log-sum-exp [B, H] of
    the scaled scores. The caller checks `available()` first."""
    lib, why = load()
    if lib is None:
        raise RuntimeError(f"native CPU kernels unavailable: {why}")
    if q.dtype != torch.float32 or kv_cache.dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"paged_decode takes float32 queries and a float32/bfloat16 cache, "
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
    fn = lib.paged_decode_f32 if kv_cache.dtype == torch.float32 else lib.paged_decode_bf16kv
    fn(q.data_ptr(), kv_cache.data_ptr(), tables.data_ptr(), tables.shape[1], lens.data_ptr(), out.data_ptr(),
       num_seqs, num_heads, num_kv_heads, head_size, block_size, num_blocks, float(scale),
       int(sliding_window or 0), int(first_pos), lse.data_ptr() if lse is not None else None)
    return (out, lse) if return_lse else out


def quantize_rows_int8(x: torch.Tensor, num_outliers: int
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [M, K] float32 -> (q int8 [M, K] with the outlier channels zeroed, token scale [M, 1],
    outlier channels int64 [n], their values float32 [M, n]); n = min(num_outliers, K)."""
    lib, why = load()
    if lib is None:
        raise RuntimeError(f"native CPU kernels unavailable: {why}")
    x = x.contiguous()
    rows, cols = x.shape
    n = min(num_outliers, cols)
    q = torch.empty((rows, cols), dtype=torch.int8)
    scale = torch.empty((rows, 1), dtype=torch.float32)
    outliers = torch.empty(n, dtype=torch.int64)
    values = torch.empty((rows, n), dtype=torch.float32)
    lib.quantize_rows_int8(x.data_ptr(), rows, cols, n, q.data_ptr(), scale.data_ptr(),
                           outliers.data_ptr(), values.data_ptr())
    return q, scale, outliers, values


def dequantize_int32(acc: torch.Tensor, token_scale: torch.Tensor, channel_scale: torch.Tensor,
                     extra: Optional[torch.Tensor] = None, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """acc [M, N] int32 * token_scale [M] * channel_scale [N] (+ extra [M, N]) (+ bias [N]),
    float32, in one pass."""
    lib, why = load()
    if lib is None:
        raise RuntimeError(f"native CPU kernels unavailable: {why}")
    acc = acc.contiguous()
    rows, cols = acc.shape
    out = extra.contiguous() if extra is not None else torch.empty((rows, cols), dtype=torch.float32)
    bias = bias.float().contiguous() if bias is not None else None      # kept alive for the call
    bias_ptr = bias.data_ptr() if bias is not None else None
    lib.dequantize_int32(acc.data_ptr(), token_scale.contiguous().data_ptr(), channel_scale.contiguous().data_ptr(),
                         out.data_ptr() if extra is not None else None, bias_ptr, out.data_ptr(), rows, cols)
    return out

