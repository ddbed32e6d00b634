"""Pooling hidden states into one vector per sequence: CLS (first token), MEAN, LAST token; then
Matryoshka truncation and L2 normalization (in that order, as sentence-transformers' truncate_dim
with normalization and vLLM do).

A prompt may be computed over several steps (chunked prefill), so pooling is folded in per chunk:
each chunk adds to a running float32 partial kept on the sequence (`pooling_partial`: the CLS row,
the running sum for MEAN) and the vector is made when the chunk holding the last prompt token has
run. A chunk starting at position 0 resets the partial, so a preempted sequence's recompute
cannot count its first chunks twice.
"""
from __future__ import annotations

from typing import Any, Optional

import torch
import torch.nn.functional as F

# One chunk of a pooling sequence in a step: (sequence, its first position, first row in hidden, rows).
PoolingChunk = tuple[Any, int, int, int]


class Pooler:
    def __init__(self, pooling_type: str, normalize: bool) -> None:
        if pooling_type not in ("CLS", "MEAN", "LAST"):
            raise ValueError(f"pooling_type must be CLS, MEAN or LAST, got {pooling_type!r}")
        self.pooling_type = pooling_type
        self.normalize = normalize

    def __call__(self, hidden: torch.Tensor, chunks: list[PoolingChunk]) -> list[tuple[Any, list[float]]]:
        """Fold this step's chunks in; (sequence, vector) for each sequence whose prompt is now done."""
        done = []
        for seq, start, first, count in chunks:
            end = start + count
            finished = end == seq.num_prompt_tokens
            kind = self.pooling_type
            if kind == "CLS":
                if start == 0:
                    seq.pooling_partial = hidden[first].float()
            elif kind == "MEAN":
                total = hidden[first:first + count].float().sum(0)
                seq.pooling_partial = total if start == 0 else seq.pooling_partial + total
            elif finished:      # LAST: only the chunk holding the last prompt token matters
                seq.pooling_partial = hidden[first + count - 1].float()
            if not finished:
                continue
            vector = seq.pooling_partial
            if kind == "MEAN":
                vector = vector / seq.num_prompt_tokens
            seq.pooling_partial = None
            done.append((seq, self.finish(vector, seq.pooling.dimensions, seq.pooling.normalize)))
        return done

    def finish(self, vector: torch.Tensor, dimensions: Optional[int], normalize: Optional[bool]) -> list[float]:
        if dimensions is not None:
            vector = vector[:dimensions]
        if self.normalize if normalize is None else normalize:
            vector = F.normalize(vector, p=2, dim=-1)
        return vector.tolist()
