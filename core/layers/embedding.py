"""Token embedding and the LM head (which may share the embedding's weight)."""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn


class VocabEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int, dtype: Optional[torch.dtype] = None) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(vocab_size, hidden_size, dtype=dtype), requires_grad=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(input_ids, self.weight)


class LMHead(nn.Module):
    """hidden [N, H] -> logits [N, V] in float32. The matmul runs in the model dtype (as in HF),
    only the result is widened, so sampling sees the same numbers HF would produce."""

    def __init__(self, vocab_size: int, hidden_size: int, dtype: Optional[torch.dtype] = None,
                 tied_to: Optional[VocabEmbedding] = None) -> None:
        super().__init__()
        self.tied = tied_to is not None
        if tied_to is not None:
            self.weight = tied_to.weight
        else:
            self.weight = nn.Parameter(torch.empty(vocab_size, hidden_size, dtype=dtype), requires_grad=False)
        self._kernel = None
        self._prepared = None

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        if self._kernel is None:
            return F.linear(hidden, self.weight).float()
        return self._kernel(hidden, self._prepared, None).float()

    def use_kernel(self, kernel) -> None:
        """See Linear.use_kernel. The embedding keeps using the plain (possibly shared) weight."""
        self._kernel = kernel
        self._prepared = None if kernel is None else kernel.prepare(self.weight)
