"""Hybrid KV: layers grouped by attention type so sliding-window layers hold only their window.

A model whose layers mix sliding-window and full attention (Gemma 2/3, Cohere 2, OLMo 3, EXAONE 4)
splits its attention layers into groups of equal size G, each group of one type (vLLM's hybrid
allocator). The pool has one set of block ids; a block holds `block_size` tokens of G layers, one
KV tensor per position in a group (group g's j-th layer uses tensor j). Each sequence keeps one
block table per group: a full-attention group's table grows with the sequence, a sliding group's
releases the blocks that every later token's window has left (their entries point at the null
block, which is never written and stays zero). A 32k-token request on Gemma 3 (window 1024, five
sliding layers to each global one) thus holds about 1/5 of the blocks it would with every layer
global; `KVLayout.describe` says how many, in the start-up log.

A model with one attention type is one group of all its layers: the tables, the pool and every
number are what they were without groups.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

NULL_BLOCK = 0          # the hybrid pool's never-written block, where out-of-window entries point


@dataclass(frozen=True)
class KVGroup:
    window: Optional[int]          # the sliding window of its layers; None: full attention
    layers: tuple[int, ...]        # indices into the model's attention layers


@dataclass(frozen=True)
class KVLayout:
    groups: tuple[KVGroup, ...]
    group_size: int                # G: layers per group, i.e. KV tensors in the pool

    @property
    def hybrid(self) -> bool:
        return len(self.groups) > 1

    def tensor_of_layer(self) -> dict[int, int]:
        """Attention layer index -> which of the G pool tensors it reads and writes."""
        return {layer: j for group in self.groups for j, layer in enumerate(group.layers)}

    def group_of_layer(self) -> dict[int, int]:
        return {layer: g for g, group in enumerate(self.groups) for layer in group.layers}

    def blocks_for(self, num_tokens: int, block_size: int, chunk: int = 0) -> int:
        """Blocks one sequence of `num_tokens` holds at most: every block in full groups, the
        window (plus a prefill chunk in flight and a partial block at each end) in sliding ones."""
        full = math.ceil(num_tokens / block_size)
        total = 0
        for group in self.groups:
            if group.window is None or not self.hybrid:
                total += full
            else:
                total += min(full, math.ceil((group.window + max(chunk, 1)) / block_size) + 1)
        return total

    def describe(self, num_blocks: int, block_size: int, bytes_per_block: int, num_tokens: int) -> str:
        """The block arithmetic of the start-up log."""
        if not self.hybrid:
            return ""
        full = sum(1 for g in self.groups if g.window is None)
        windows = sorted({g.window for g in self.groups if g.window is not None})
        needed = self.blocks_for(num_tokens, block_size)
        return (f"hybrid KV: {full} full-attention and {len(self.groups) - full} sliding-window "
                f"(window {', '.join(map(str, windows))}) groups of {self.group_size} layers; a block holds "
                f"{block_size} tokens of {self.group_size} layers ({bytes_per_block} bytes), {num_blocks} blocks; "
                f"a {num_tokens}-token sequence holds {needed} blocks, {self.kv_fraction(num_tokens, block_size):.2f} "
                f"of the KV it would hold with every layer global")

    def kv_fraction(self, num_tokens: int, block_size: int) -> float:
        """KV bytes one `num_tokens` sequence holds here over what it would with every layer global."""
        num_layers = sum(len(g.layers) for g in self.groups)
        held = self.blocks_for(num_tokens, block_size) * self.group_size
        return held / (num_layers * math.ceil(num_tokens / block_size))


def kv_layout(windows: list[Optional[int]], hybrid: bool = True) -> KVLayout:
    """Group attention layers with these per-layer windows. One group of all layers unless they
    mix types (and `hybrid`); else G = the fewest layers of any type, each type split into groups
    of G (the last one short)."""
    everything = KVLayout((KVGroup(windows[0] if len(set(windows)) == 1 else None, tuple(range(len(windows)))),),
                          len(windows))
    if not hybrid or len(set(windows)) <= 1:
        return everything
    by_type: dict[Optional[int], list[int]] = {}
    for i, window in enumerate(windows):
        by_type.setdefault(window, []).append(i)
    size = min(len(layers) for layers in by_type.values())
    groups = []
    for window in sorted(by_type, key=lambda w: (w is not None, w or 0)):     # full attention first
        layers = by_type[window]
        groups += [KVGroup(window, tuple(layers[i:i + size])) for i in range(0, len(layers), size)]
    return KVLayout(tuple(groups), size)


@dataclass(frozen=True)
class MLAKVSpec:
    """The KV cache of a multi-head latent attention layer (DeepSeek V2/V3): per token one row of the
    compressed latent (kv_lora_rank) and the rope key (qk_rope_head_dim), shared by every head,
    where an uncompressed cache would hold each head's key (nope + rope dims) and value."""
    kv_lora_rank: int
    qk_rope_head_dim: int
    num_heads: int
    qk_nope_head_dim: int
    v_head_dim: int

    @property
    def width(self) -> int:
        return self.kv_lora_rank + self.qk_rope_head_dim

    def cache_shape(self, num_blocks: int, block_size: int) -> tuple[int, ...]:
        return (num_blocks, block_size, self.width)

    def uncompressed_width(self) -> int:
        return self.num_heads * (self.qk_nope_head_dim + self.qk_rope_head_dim + self.v_head_dim)

    def describe(self, element_size: int, num_layers: int) -> str:
        """The start-up log's line: bytes per token against an uncompressed cache."""
        ours, full = self.width * element_size * num_layers, self.uncompressed_width() * element_size * num_layers
        return (f"MLA KV cache: {ours} bytes per token ({num_layers} layers x ({self.kv_lora_rank} latent + "
                f"{self.qk_rope_head_dim} rope) x {element_size} bytes); an uncompressed cache would need {full} "
                f"({self.num_heads} heads x ({self.qk_nope_head_dim} + {self.qk_rope_head_dim} + {self.v_head_dim})), "
                f"{full / ours:.1f}x more")
