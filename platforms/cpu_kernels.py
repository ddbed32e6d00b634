"""The cpu platform's native kernels (platforms/csrc/cpu_kernels.cpp): the fused per-layer ops
(platforms/cpu_layer_kernels.py) and the int8 GEMM prologue/epilogue the platform hands to the
int4 quantization method (Platform.quantization_kernels). Built on first use by native_build.py;
`available()` says why not when they cannot run here.
"""
from __future__ import annotations

import ctypes
from typing import Optional

import torch

from .native_build import NativeLibrary, source

ABI_VERSION = 10


def _declare(lib: ctypes.CDLL) -> None:
    p, i64, f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
    lib.rms_norm_f32.argtypes = [p, p, p, f32, f32, p, p, i64, i64]
    lib.rope_f32.argtypes = [p, i64, p, p, p, i64, i64, i64, i64, i64]
    lib.silu_mul_f32.argtypes = [p, p, i64, i64]
    lib.rms_norm_bf16.argtypes = [p, p, p, f32, f32, p, p, i64, i64]
    lib.rope_bf16.argtypes = [p, i64, p, p, p, i64, i64, i64, i64, i64]
    lib.silu_mul_bf16.argtypes = [p, p, i64, i64]
    lib.gelu_tanh_mul_f32.argtypes = [p, p, i64, i64]
    lib.gelu_tanh_mul_bf16.argtypes = [p, p, i64, i64]
    lib.quantize_rows_int8.argtypes = [p, i64, i64, i64, p, p, p, p]
    lib.dequantize_int32.argtypes = [p, p, p, p, p, p, i64, i64, p, p, i64]
    for fn in (lib.rms_norm_f32, lib.rope_f32, lib.silu_mul_f32, lib.rms_norm_bf16, lib.rope_bf16, lib.silu_mul_bf16,
               lib.gelu_tanh_mul_f32, lib.gelu_tanh_mul_bf16, lib.quantize_rows_int8, lib.dequantize_int32):
        fn.restype = None


LIBRARY = NativeLibrary(source("cpu_kernels.cpp"), ABI_VERSION, _declare)


def available() -> Optional[str]:
    """None when the kernels load here, else why not."""
    return LIBRARY.available()


def library() -> ctypes.CDLL:
    """The loaded library; RuntimeError when `available()` is not None."""
    return LIBRARY.require()


def quantize_rows_int8(x: torch.Tensor, num_outliers: int
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [M, K] float32 -> (q int8 [M, K] with the outlier channels zeroed, token scale [M, 1],
    outlier channels int64 [n], their values float32 [M, n]); n = min(num_outliers, K)."""
    lib = library()
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
                     extra: Optional[torch.Tensor] = None, bias: Optional[torch.Tensor] = None,
                     outliers: Optional[tuple[torch.Tensor, torch.Tensor]] = None) -> torch.Tensor:
    """acc [M, N] int32 * token_scale [M] * channel_scale [N] (+ extra [M, N]) (+ bias [N])
    (+ values [M, J] @ weight_rows [J, N] for `outliers` = (values, weight_rows)), float32, in
    one pass."""
    lib = library()
    acc = acc.contiguous()
    rows, cols = acc.shape
    out = extra.contiguous() if extra is not None else torch.empty((rows, cols), dtype=torch.float32)
    bias = bias.float().contiguous() if bias is not None else None      # kept alive for the call
    bias_ptr = bias.data_ptr() if bias is not None else None
    values = weight_rows = None
    if outliers is not None and outliers[0].numel():
        values = outliers[0].float().contiguous()
        weight_rows = outliers[1].float().contiguous()
        if values.shape != (rows, weight_rows.shape[0]) or weight_rows.shape[1] != cols:
            raise ValueError(f"dequantize_int32: outliers {tuple(values.shape)} x {tuple(weight_rows.shape)} "
                             f"do not match acc {tuple(acc.shape)}")
    lib.dequantize_int32(acc.data_ptr(), token_scale.contiguous().data_ptr(), channel_scale.contiguous().data_ptr(),
                         out.data_ptr() if extra is not None else None, bias_ptr, out.data_ptr(), rows, cols,
                         values.data_ptr() if values is not None else None,
                         weight_rows.data_ptr() if weight_rows is not None else None,
                         values.shape[1] if values is not None else 0)
    return out
