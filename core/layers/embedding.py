"""Token embedding and the LM head (which may share the embedding's weight)."""
from __future__ import annotations

from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.quantization.interface import QuantizationMethod

from ..distributed import all_gather_last_dim, all_reduce, tp_rank, tp_size
from .params import default_weight_loader, plain_parameter


class VocabShard:
    """The vocabulary rows one tensor-parallel rank holds: [start, start + rows) of a vocabulary
    padded to a multiple of tp (the padding rows are zero and their logits are cut off)."""

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size, self.rank, self.size = vocab_size, tp_rank(), tp_size()
        self.rows = -(-vocab_size // self.size)
        self.start = self.rank * self.rows

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: Optional[int] = None) -> None:
        if self.size == 1:
            return default_weight_loader(param, loaded, shard_id)
        if shard_id is not None or loaded.shape[0] != self.vocab_size or loaded.shape[1:] != param.shape[1:]:
            raise ValueError(f"shape mismatch: checkpoint {tuple(loaded.shape)} vs a vocabulary of {self.vocab_size}")
        part = loaded.narrow(0, self.start, max(0, min(self.rows, self.vocab_size - self.start)))
        param.data.zero_()
        param.data[:part.shape[0]].copy_(part)


    weight_loader.narrows_lazily = True       # reads only this rank's rows of a lazy checkpoint slice


class VocabEmbedding(nn.Module):
    """At tensor parallelism each rank holds a slice of the vocabulary: ids outside it look up
    zeros, and the sum over ranks (all-reduce) is the embedding."""

    def __init__(self, vocab_size: int, hidden_size: int, dtype: Optional[torch.dtype] = None) -> None:
        super().__init__()
        self.shard = VocabShard(vocab_size)
        self.weight = plain_parameter(self.shard.rows, hidden_size, dtype=dtype)
        self.weight.weight_loader = self.shard.weight_loader

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.shard.size == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.shard.start
        outside = (local < 0) | (local >= self.shard.rows)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        return all_reduce(out.masked_fill_(outside.unsqueeze(-1), 0))


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
        # Vocabulary-parallel: each rank computes its slice of the logits, gathered in forward.
        self.shard = tied_to.shard if tied_to is not None else VocabShard(vocab_size)
        if tied_to is not None:
            self.weight = tied_to.weight
        else:
            self.weight = plain_parameter(self.shard.rows, hidden_size, dtype=dtype)
            self.weight.weight_loader = self.shard.weight_loader
        self.quant_method = quant_method
        self._kernel: Any = None       # a platform's dense-matmul kernel (core/layers/kernels.py)
        self._prepared: Any = None

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self._local_logits(hidden)
        if self.shard.size == 1:
            return logits
        return all_gather_last_dim(logits)[..., :self.shard.vocab_size]

    def _local_logits(self, hidden: torch.Tensor) -> torch.Tensor:
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
