"""RMSNorm and LayerNorm with the HF numerics. RMSNorm normalizes in float32, casts back, then
scales in the model dtype; with `offset` (Gemma's `(1 + w)`) it scales in float32 and rounds once,
as Gemma's own norm does. LayerNorm (Cohere, StarCoder2) runs in float32 and rounds once.

`F.rms_norm` on a half-precision input accumulates in float32 and rounds once, which is
bit-identical to HF's explicit `x.float() ... .to(dtype)` (tests/models/test_models.py checks it)
while saving two full-size copies per norm.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from .params import plain_parameter


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6, dtype: Optional[torch.dtype] = None,
                 offset: float = 0.0) -> None:
        super().__init__()
        self.eps = eps
        self.hidden_size = hidden_size
        self.offset = offset
        self.weight = plain_parameter(hidden_size, dtype=dtype)
        self._kernel = None

    def use_kernel(self, kernel) -> None:
        """Run through `kernel(x, residual, weight, eps)` (a platform's fused op, applied by
        core/layers/kernels.py); it may return NotImplemented to fall back. None: torch."""
        self._kernel = kernel

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        if self.offset:
            normed = F.rms_norm(x.float(), (self.hidden_size,), eps=self.eps)
            return (normed * (self.offset + self.weight.float())).to(x.dtype)
        # The weight is applied after rounding to the input dtype, exactly where HF applies it.
        return F.rms_norm(x, (self.hidden_size,), eps=self.eps) * self.weight

    def _kernel_forward(self, x: torch.Tensor, residual: Optional[torch.Tensor]):
        """The platform's kernel over rows of hidden_size (a per-head q/k norm's [T, heads, D] view
        made contiguous rows first: one copy instead of the torch path's passes)."""
        shape = x.shape
        if x.dim() != 2 and residual is None:
            x = x.reshape(-1, self.hidden_size)
        args = (x, residual, self.weight, self.eps)
        out = self._kernel(*args, offset=self.offset) if self.offset else self._kernel(*args)
        if out is NotImplemented or residual is not None:
            return out
        return out.view(shape)

    def forward(self, x: torch.Tensor, residual: Optional[torch.Tensor] = None):
        """Without `residual`: norm(x). With it: (norm(x + residual), x + residual) — the
        pre-norm decoder's residual add folded into the next norm."""
        if self._kernel is not None:
            out = self._kernel_forward(x, residual)
            if out is not NotImplemented:
                return out
        if residual is None:
            return self._norm(x)
        residual = x + residual
        return self._norm(residual), residual


class LayerNorm(nn.Module):
    """Mean-centred LayerNorm, with or without a bias, in float32; the same (x, residual) contract
    as RMSNorm."""

    def __init__(self, hidden_size: int, eps: float = 1e-5, dtype: Optional[torch.dtype] = None,
                 bias: bool = True) -> None:
        super().__init__()
        self.eps = eps
        self.hidden_size = hidden_size
        self.weight = plain_parameter(hidden_size, dtype=dtype)
        self.bias = plain_parameter(hidden_size, dtype=dtype) if bias else None

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        bias = self.bias.float() if self.bias is not None else None
        return F.layer_norm(x.float(), (self.hidden_size,), self.weight.float(), bias, self.eps).to(x.dtype)

    def forward(self, x: torch.Tensor, residual: Optional[torch.Tensor] = None):
        if residual is None:
            return self._norm(x)
        residual = x + residual
        return self._norm(residual), residual
