"""Token embedding and the LM head (which may share the embedding's weight)."""
from __future__ import annotations

from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.quantization.interface import QuantizationMethod

from .params import plain_parameter


class VocabEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int, dtype: Optional[torch.dtype] = None) -> None:
        super().__init__()
        self.weight = plain_parameter(vocab_size, hidden_size, dtype=dtype)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(input_ids, self.weight)


class LMHead(nn.Module):
    """hidden [N, H] -> logits [N, V] in float32. The matmul runs in the model dtype (as in HF),
    only the result is widened, so sampling sees the same numbers HF would produce.

    The weight is the embedding's (tied) or a plain one; `quant_method` (the model's method's
    `lm_head_method()`) only post-processes it and runs the matmul, never replaces it, since a
    tied embedding still reads it."""

    def __init__(self, vocab_size: int, hidden_size: int, dtype: Optional[torch.dtype] = None,
                 tied_to: Optional[VocabEmbedding] = None, quant_method: Optional[QuantizationMethod] = None) -> None:
        super().__init__()
        self.tied = tied_to is not None
        self.weight = tied_to.weight if tied_to is not None else plain_parameter(vocab_size, hidden_size, dtype=dtype)
        self.quant_method = quant_method
        self._kernel: Any = None       # a platform's dense-matmul kernel (core/layers/kernels.py)
        self._prepared: Any = None

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        if self._kernel is not None:
            out = self._kernel(hidden, self._prepared, None)
            if out is not NotImplemented:      # a kernel may leave some inputs to the method
                return out.float()
        if self.quant_method is not None:
            return self.quant_method.apply(self, hidden, None).float()
        return F.linear(hidden, self.weight).float()

    def use_kernel(self, kernel: Any) -> None:
        """See Linear.use_kernel. The embedding keeps using the plain (possibly shared) weight."""
        self._kernel = kernel
        self._prepared = None if kernel is None else kernel.prepare(self.weight)
