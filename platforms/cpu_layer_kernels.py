"""Native CPU kernels for the small per-layer ops (RMSNorm with its residual add, rotary
embedding, SiLU- and GELU-tanh-and-multiply), which the cpu platform offers the core by name
(`CpuPlatform.layer_kernels`: "rms_norm", "rotary", "silu_and_mul", "gelu_tanh_and_mul") and the core swaps into its
layers (core/layers/kernels.py).

Why: after the matmuls, a one-token decode step spends its time dispatching ~45 small torch ops
per layer; each of these replaces 3-8 of them with one call (platforms/csrc/cpu_kernels.cpp).
Float32 results agree with the torch path to rounding, not bit for bit (summation order, exp),
so they are used only where exact parity with transformers is not promised (quantization="int4",
and bf16 activations under dtype=bfloat16).
A kernel returns NotImplemented for inputs it does not cover (other dtypes, strides), and the
layer then runs its torch code.
"""
from __future__ import annotations

from typing import Any, Optional

import torch

from . import cpu_kernels
from .interface import LayerKernels


# bf16: float32 math rounded where torch's bf16 ops round (norm, then weight; each rotary
# product and sum; silu, then the product), so they match the torch path to within its float32
# reductions and exp.
KERNEL_DTYPES = (torch.float32, torch.bfloat16)


def _lib():
    return cpu_kernels.library()


class NativeRMSNorm:
    name = "native_rms_norm"

    def __call__(self, x: torch.Tensor, residual: Optional[torch.Tensor], weight: torch.Tensor,
                 eps: float, offset: float = 0.0) -> Any:
        if (x.dtype not in KERNEL_DTYPES or weight.dtype != x.dtype or x.dim() != 2 or not x.is_contiguous()
                or not weight.is_contiguous()
                or (residual is not None and (residual.dtype != x.dtype or not residual.is_contiguous()
                                              or residual.shape != x.shape))):
            return NotImplemented
        rows, cols = x.shape
        out = torch.empty_like(x)
        new_residual = torch.empty_like(x) if residual is not None else None
        norm = _lib().rms_norm_f32 if x.dtype == torch.float32 else _lib().rms_norm_bf16
        norm(x.data_ptr(), residual.data_ptr() if residual is not None else None,
             weight.data_ptr(), float(eps), float(offset), out.data_ptr(),
             new_residual.data_ptr() if new_residual is not None else None, rows, cols)
        return out if residual is None else (out, new_residual)


class NativeRotary:
    name = "native_rope"

    def __call__(self, positions: torch.Tensor, x: torch.Tensor, cos_sin_cache: torch.Tensor,
                 rotary_dim: Optional[int] = None, interleaved: bool = False) -> Any:
        """x [T, heads, D] with heads contiguous inside each token's row (a view into the fused
        qkv output is fine) -> rotated contiguous copy; the leading `rotary_dim` dims of each head
        rotate (rotate-half halves, or adjacent pairs where `interleaved`), the rest are copied."""
        rotary_dim = rotary_dim or x.shape[-1]
        if (x.dtype not in KERNEL_DTYPES or cos_sin_cache.dtype != x.dtype or x.dim() != 3
                or x.stride(2) != 1 or x.stride(1) != x.shape[2] or not cos_sin_cache.is_contiguous()
                or cos_sin_cache.shape[-1] != rotary_dim or rotary_dim % 2 or rotary_dim > x.shape[2]
                or positions.dtype != torch.long or not positions.is_contiguous()):
            return NotImplemented
        tokens, heads, head_size = x.shape
        out = torch.empty((tokens, heads, head_size), dtype=x.dtype)
        rope = _lib().rope_f32 if x.dtype == torch.float32 else _lib().rope_bf16
        rope(x.data_ptr(), x.stride(0), cos_sin_cache.data_ptr(), positions.data_ptr(),
             out.data_ptr(), tokens, heads, head_size, rotary_dim, int(interleaved))
        return out


class NativeGatedMul:
    """x [rows, 2 * inter] = [gate | up] -> act(gate) * up, act SiLU or GELU-tanh (GeGLU)."""

    def __init__(self, activation: str) -> None:
        self.name = f"native_{activation}_mul"
        self._entries = (f"{activation}_mul_f32", f"{activation}_mul_bf16")

    def __call__(self, x: torch.Tensor) -> Any:
        if x.dtype not in KERNEL_DTYPES or x.dim() != 2 or not x.is_contiguous():
            return NotImplemented
        rows, width = x.shape
        out = torch.empty((rows, width // 2), dtype=x.dtype)
        entry = getattr(_lib(), self._entries[x.dtype == torch.bfloat16])
        entry(x.data_ptr(), out.data_ptr(), rows, width // 2)
        return out


def native_layer_kernels() -> LayerKernels:
    """The elementwise kernels; the caller checks `cpu_kernels.available()` first."""
    return LayerKernels(rms_norm=NativeRMSNorm(), rotary=NativeRotary(), silu_and_mul=NativeGatedMul("silu"),
                        gelu_tanh_and_mul=NativeGatedMul("gelu_tanh"))
