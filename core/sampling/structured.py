"""Grammar token masks for the sampler: constrained and free rows share one batch.

Each constrained row's matcher fills its row of one packed int32 bitmask (plugins/parsers.py);
the disallowed tokens of those rows get -inf before any other processing, so greedy and random
sampling (and the reported logprobs, as in vLLM v1) only ever see what the grammar allows.
"""
from __future__ import annotations

from typing import Any, Sequence

import torch

_SHIFTS = torch.arange(32, dtype=torch.int32)


def apply_grammar_masks(logits: torch.Tensor, rows: Sequence[Any]) -> torch.Tensor:
    """`logits` [rows, vocab] with the disallowed tokens of constrained rows at -inf (a new tensor
    when any row is constrained, `logits` itself otherwise)."""
    constrained = [i for i, row in enumerate(rows) if getattr(row, "grammar", None) is not None]
    if not constrained:
        return logits
    vocab = logits.shape[1]
    words = -(-vocab // 32)
    bitmask = torch.full((len(constrained), words), -1, dtype=torch.int32)
    for j, i in enumerate(constrained):
        rows[i].grammar.fill_bitmask(bitmask, j)
    allowed = ((bitmask.unsqueeze(-1) >> _SHIFTS) & 1).bool().view(len(constrained), -1)[:, :vocab]
    # A row the grammar leaves nothing for (cannot happen with a terminated-means-finished
    # scheduler) keeps its logits rather than sampling from all -inf.
    allowed[~allowed.any(dim=-1)] = True
    logits = logits.clone()
    idx = torch.tensor(constrained)
    sub = logits[idx]
    sub.masked_fill_(~allowed.to(sub.device), float("-inf"))
    logits[idx] = sub
    return logits
