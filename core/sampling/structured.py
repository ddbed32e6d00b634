"""Grammar token masks for the sampler: constrained and free rows share one batch.

Each constrained row's matcher fills its row of one packed int32 bitmask (plugins/parsers.py);
the disallowed tokens of those rows get -inf before any other processing, so greedy and random
sampling (and the reported logprobs, as in vLLM v1) only ever see what the grammar allows.
"""
from __future__ import annotations

import sys
from typing import Any, Sequence

import torch
import torch.nn.functional as F

# Byte value -> the additive mask of its 8 tokens (0 allowed, -inf not): one embedding lookup per
# byte of the packed bitmask unpacks it in one gather instead of 32 shifts a word (little-endian:
# byte b of word w holds tokens 32w + 8b .. 32w + 8b + 7).
_BYTE_MASK = torch.where(((torch.arange(256).unsqueeze(1) >> torch.arange(8)) & 1).bool(), 0.0, float("-inf"))
assert sys.byteorder == "little", "the packed bitmask is read byte by byte"


@torch.inference_mode()   # the logits are the forward pass's (inference) tensors, masked in place
def apply_grammar_masks(logits: torch.Tensor, rows: Sequence[Any]) -> torch.Tensor:
    """`logits` [rows, vocab] with the disallowed tokens of constrained rows at -inf (in place:
    the logits are this step's own; returned for convenience)."""
    constrained = [i for i, row in enumerate(rows) if getattr(row, "grammar", None) is not None]
    if not constrained:
        return logits
    vocab = logits.shape[1]
    words = -(-vocab // 32)
    bitmask = torch.full((len(constrained), words), -1, dtype=torch.int32)
    for j, i in enumerate(constrained):
        rows[i].grammar.fill_bitmask(bitmask, j)
    # A row the grammar leaves nothing for (cannot happen with a terminated-means-finished
    # scheduler) keeps its logits rather than sampling from all -inf.
    empty = ~(bitmask != 0).any(dim=1)
    if bool(empty.any()):
        bitmask[empty] = -1
    table = _BYTE_MASK.to(device=logits.device, dtype=logits.dtype)
    additive = F.embedding(bitmask.view(torch.uint8).long().to(logits.device), table)
    additive = additive.view(len(constrained), -1)[:, :vocab]
    if len(constrained) == logits.shape[0]:
        logits.add_(additive)
    else:
        idx = torch.tensor(constrained, device=logits.device)
        logits.index_add_(0, idx, additive)
    return logits
