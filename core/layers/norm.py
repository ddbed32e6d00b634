"""RMSNorm with the HF numerics: normalize in float32, cast back, then scale in the model dtype."""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6, dtype: Optional[torch.dtype] = None) -> None:
        super().__init__()
        self.eps = eps
        self.hidden_size = hidden_size
        self.weight = nn.Parameter(torch.empty(hidden_size, dtype=dtype), requires_grad=False)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        # F.rms_norm without a weight is one fused kernel; the weight is applied after the cast,
        # in the input dtype, exactly where HF applies it.
        return F.rms_norm(x.float(), (self.hidden_size,), eps=self.eps).to(x.dtype) * self.weight

    def forward(self, x: torch.Tensor, residual: Optional[torch.Tensor] = None):
        """Without `residual`: norm(x). With it: (norm(x + residual), x + residual) — the
        pre-norm decoder's residual add folded into the next norm."""
        if residual is None:
            return self._norm(x)
        residual = x + residual
        return self._norm(residual), residual
