"""A linear layer's adapter slots: what `Linear.lora` holds (core/layers/linear.py calls it).

Each slot holds one resident adapter's weights, zero-padded to max_lora_rank and stored transposed
(the right-hand operands of x A^T B^T, contiguous for the batched matmuls): A^T [slots, in, shards * R]
and B^T [slots, shards * R, out], block-diagonal for a fused layer so that shard i (q, k, v / gate, up)
sees only its own rank slice. The step's LoRAMapping is read from the
shared `LoRAContext` the model runner sets once per step.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch

from .punica import LoRAMapping

# add_lora(y, x, lora_a, lora_b, mapping, output_sizes): output_sizes are the shard widths of B's
# diagonal blocks, which an op may use to skip the zero blocks (core/lora/punica.py).
AddLoRA = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, LoRAMapping, list[int]], None]


class LoRAContext:
    """The one per-step mapping every LoRA layer of a model reads (None: no adapted row this step)."""

    def __init__(self) -> None:
        self.mapping: Optional[LoRAMapping] = None


class LoRALayer:
    def __init__(self, output_sizes: list[int], input_size: int, num_slots: int, max_rank: int,
                 context: LoRAContext, add_lora: AddLoRA, dtype: torch.dtype, device: torch.device) -> None:
        self.output_sizes = list(output_sizes)
        self.max_rank = max_rank
        width = len(output_sizes) * max_rank
        self.lora_a = torch.zeros(num_slots, input_size, width, dtype=dtype, device=device)        # A^T
        self.lora_b = torch.zeros(num_slots, width, sum(output_sizes), dtype=dtype, device=device)  # B^T
        self.context = context
        self.add_lora = add_lora

    def set_slot(self, slot: int, shards: Optional[list]) -> None:
        """Put one adapter's (A, B) per shard (None: shard not adapted) in `slot`; None clears it."""
        self.lora_a[slot].zero_()
        self.lora_b[slot].zero_()
        if shards is None:
            return
        offset = 0
        for i, (size, pair) in enumerate(zip(self.output_sizes, shards)):
            if pair is not None:
                a, b = pair
                r, lo = a.shape[0], i * self.max_rank
                self.lora_a[slot, :, lo:lo + r].copy_(a.t())
                self.lora_b[slot, lo:lo + r, offset:offset + size].copy_(b.t())
            offset += size

    def __call__(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        mapping = self.context.mapping
        if mapping is not None:
            self.add_lora(y, x, self.lora_a, self.lora_b, mapping, self.output_sizes)
        return y
