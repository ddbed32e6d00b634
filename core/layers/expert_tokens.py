"""Tokens routed to each expert of each mixture-of-experts layer (the `tokenmill:moe_expert_tokens`
metric): cumulative counts [layers, experts] on the model's device, so load imbalance is visible.

Cheap by construction: during the forward each FusedMoE only copies its router's top-k ids into its
row of one preallocated buffer (`note`); after the step's forward the runner adds them up with one
bincount over every layer at once (`collect`, the step's real token count only). Noting into a fixed
buffer rather than counting in the layer keeps it right under CUDA graphs: a replay rewrites the
buffer (padded rows included) and only the step's real rows are counted afterwards; warm-up and
profiling forwards are never collected. Only layers that noted during the step's forward are counted
(or, after a graph replay, where no Python runs, every layer, each recorded at capture): a layer a
platform program runs without calling the module leaves no stale rows behind, only no count.
"""
from __future__ import annotations

import re
from typing import Any, Optional

import torch
from torch import nn

_LAYER_INDEX = re.compile(r"(?:^|\.)layers\.(\d+)(?:\.|$)")


class ExpertTokenCounter:
    """`counts` [num_layers, num_experts] int64: row = the decoder layer's index in the whole model
    (rows of dense layers, and of other pipeline stages' layers, stay 0)."""

    def __init__(self, layers: list[tuple[int, Any]], num_layers: int, num_experts: int, top_k: int,
                 max_tokens: int, device: torch.device) -> None:
        self.num_layers, self.num_experts = num_layers, num_experts
        self.counts = torch.zeros(num_layers, num_experts, dtype=torch.long, device=device)
        self.layer_ids = [index for index, _ in layers]
        # ids + layer index * E per (noted layer, token, slot): one bincount gives every layer's counts.
        self._noted = torch.zeros(len(layers), max(1, max_tokens), top_k, dtype=torch.long, device=device)
        self._offsets = torch.tensor(self.layer_ids, dtype=torch.long, device=device).mul_(num_experts)
        self._fresh = [False] * len(layers)       # noted since the last collect
        for slot, (_, layer) in enumerate(layers):
            layer.token_counter, layer.counter_slot = self, slot

    @classmethod
    def attach(cls, model: nn.Module, max_tokens: int, device: torch.device) -> Optional["ExpertTokenCounter"]:
        """A counter over `model`'s FusedMoE layers (None when it has none)."""
        from .moe import FusedMoE
        layers: list[tuple[int, Any]] = []
        num_layers = 0
        for name, module in model.named_modules():
            match = _LAYER_INDEX.search(name)
            if match is not None:
                num_layers = max(num_layers, int(match.group(1)) + 1)
                if isinstance(module, FusedMoE):
                    layers.append((int(match.group(1)), module))
        if not layers:
            return None
        experts = {layer.num_experts for _, layer in layers}
        top_k = {layer.top_k for _, layer in layers}
        if len(experts) != 1 or len(top_k) != 1:
            return None          # layers of different shapes: not a layout this counter keeps
        return cls(layers, num_layers, experts.pop(), top_k.pop(), max_tokens, device)

    def note(self, slot: int, ids: torch.Tensor) -> None:
        """A layer's router picked `ids` [T, k] (in its forward)."""
        t = ids.shape[0]
        if t > self._noted.shape[1]:        # a forward past the step budget (eager): room for it
            grown = self._noted.new_zeros(self._noted.shape[0], t, self._noted.shape[2])
            self._noted = grown
        self._noted[slot, :t].copy_(ids)
        self._fresh[slot] = True

    def rows(self, slot: int) -> torch.Tensor:
        """A layer's rows of the buffer ([max tokens, top_k] int64, contiguous), for a platform program
        that routes in the layer's place and writes its ids there itself (then `mark`)."""
        return self._noted[slot]

    def mark(self, slot: int) -> None:
        """A platform program wrote the layer's ids into `rows(slot)` during the step's forward."""
        self._fresh[slot] = True

    def collect(self, num_tokens: int, replayed: bool = False) -> None:
        """Add the last forward's first `num_tokens` rows of each layer that ran in it (after the step's
        forward; `replayed`: it was a captured graph's replay, which ran every layer's copy)."""
        fresh, self._fresh = self._fresh, [False] * len(self._fresh)
        if num_tokens <= 0 or not (replayed or any(fresh)):
            return
        noted, offsets = self._noted[:, :num_tokens], self._offsets
        if not (replayed or all(fresh)):
            which = torch.tensor([i for i, f in enumerate(fresh) if f], device=noted.device)
            noted, offsets = noted.index_select(0, which), offsets.index_select(0, which)
        rows = noted + offsets[:, None, None]
        self.counts.view(-1).add_(torch.bincount(rows.reshape(-1), minlength=self.counts.numel()))

    def reset(self) -> None:
        self.counts.zero_()


def counts_by_layer(counts: Optional[torch.Tensor]) -> dict[str, list[int]]:
    """{layer index: tokens per expert} for the layers that saw tokens (the stats' form)."""
    if counts is None:
        return {}
    rows = counts.cpu()
    used = rows.sum(dim=1).nonzero().flatten().tolist()
    return {str(layer): rows[layer].tolist() for layer in used}
