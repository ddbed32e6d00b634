"""Gated activations over a fused [gate | up] projection."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class SiluAndMul(nn.Module):
    """x = [gate | up] along the last dim -> silu(gate) * up."""

    def __init__(self) -> None:
        super().__init__()
        self._kernel = None

    def use_kernel(self, kernel) -> None:
        """Run through `kernel(x)` (a platform's fused op); it may return NotImplemented. None: torch."""
        self._kernel = kernel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._kernel is not None:
            out = self._kernel(x)
            if out is not NotImplemented:
                return out
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up
