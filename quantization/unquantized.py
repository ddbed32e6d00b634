"""The default linear method (quantization=None): dense weights in the model dtype, F.linear."""
from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from .interface import ExpertsMethod, QuantizationMethod


class UnquantizedLinearMethod(QuantizationMethod):
    """Weights kept as the checkpoint holds them (after any format-level dequantization)."""
    name = "unquantized"

    def create_weights(self, layer: nn.Module, input_size: int, output_sizes: Sequence[int], bias: bool,
                       dtype: Optional[torch.dtype]) -> None:
        # Uninitialized: loading overwrites every element.
        out = sum(output_sizes)
        weight = nn.Parameter(torch.empty(out, input_size, dtype=dtype), requires_grad=False)
        weight.weight_loader = layer.weight_loader
        layer.register_parameter("weight", weight)
        if bias:
            b = nn.Parameter(torch.empty(out, dtype=dtype), requires_grad=False)
            b.weight_loader = layer.weight_loader
            layer.register_parameter("bias", b)
        else:
            layer.register_parameter("bias", None)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
        return F.linear(x, layer.weight, bias)

    def experts_method(self) -> Optional[ExpertsMethod]:
        """Dense experts for this method itself; a subclass (a method that quantizes) covers
        experts only where it says how (its own experts_method)."""
        return ExpertsMethod() if type(self) is UnquantizedLinearMethod else None
