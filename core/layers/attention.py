"""The attention layer models call: reshapes to heads and hands off to the platform's backend."""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn


class Attention(nn.Module):
    """Paged attention over this layer's KV cache.

    The engine's model runner assigns `kv_cache` after it has allocated the pool (shape from
    `attn_backend_cls.kv_cache_shape`); until then the layer cannot run.
    """

    def __init__(self, num_heads: int, head_size: int, scale: float, num_kv_heads: int,
                 attn_backend_cls: type, sliding_window: Optional[int] = None,
                 kv_cache_dtype: str = "auto", logits_soft_cap: Optional[float] = None) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.head_size = head_size
        self.num_kv_heads = num_kv_heads
        self.scale = scale
        self.sliding_window = sliding_window
        self.impl = attn_backend_cls(num_heads, head_size, scale, num_kv_heads,
                                     sliding_window=sliding_window, logits_soft_cap=logits_soft_cap,
                                     kv_cache_dtype=kv_cache_dtype)
        self.kv_cache: Optional[torch.Tensor] = None
        self.kv_group = 0          # its layer group in a hybrid KV layout (core/kv_groups.py)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_metadata) -> torch.Tensor:
        """q [T, H*D], k/v [T, Hkv*D] -> [T, H*D]."""
        if self.kv_cache is None:
            raise RuntimeError("Attention.kv_cache is not set; the model runner must assign it before forward")
        t = q.shape[0]
        if attn_metadata.groups is not None:
            attn_metadata = attn_metadata.groups[self.kv_group]
        out = self.impl.forward(q.view(t, self.num_heads, self.head_size),
                                k.view(t, self.num_kv_heads, self.head_size),
                                v.view(t, self.num_kv_heads, self.head_size),
                                self.kv_cache, attn_metadata)
        return out.reshape(t, self.num_heads * self.head_size)
