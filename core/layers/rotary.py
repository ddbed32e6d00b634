"""Rotary position embedding (HF "rotate half" layout) with a precomputed cos/sin table.

Rope parameters come from the HF config in either spelling: transformers 5 keeps them in
`config.rope_parameters` (rope_theta, rope_type, scaling factors); older configs use
`rope_theta` + `rope_scaling`. Non-default inverse frequencies are computed by transformers'
own ROPE_INIT_FUNCTIONS so they match HF bit for bit.
"""
from __future__ import annotations

from typing import Any, Optional

import torch
from torch import nn

# Rope types whose frequencies depend on the current sequence length; a fixed table can't do them.
_DYNAMIC_ROPE_TYPES = ("dynamic", "longrope")


def rope_parameters(config: Any) -> dict:
    """The rope settings of an HF config as one dict with at least rope_theta and rope_type."""
    params = getattr(config, "rope_parameters", None)
    if isinstance(params, dict) and params and all(isinstance(v, dict) for v in params.values()):
        # Per-layer-type rope (e.g. sliding vs full attention): our models use one.
        params = params.get("full_attention") or next(iter(params.values()))
    if not params:
        params = dict(getattr(config, "rope_scaling", None) or {})
        params.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
    params = dict(params)
    params["rope_type"] = params.get("rope_type", params.get("type", "default")) or "default"
    return params


class RotaryEmbedding(nn.Module):
    def __init__(self, head_size: int, max_position: int, inv_freq: torch.Tensor,
                 attention_scaling: float = 1.0, dtype: Optional[torch.dtype] = None) -> None:
        super().__init__()
        self.head_size = head_size
        self.half = head_size // 2
        positions = torch.arange(max_position, dtype=torch.float32)
        freqs = torch.outer(positions, inv_freq.to(device=positions.device, dtype=torch.float32))          # [P, D/2], float32 as in HF
        # cos | sin side by side, so one gather per step fetches both; stored in the model dtype
        # because HF casts cos/sin to the activations' dtype before rotating.
        cache = torch.cat((freqs.cos() * attention_scaling, freqs.sin() * attention_scaling), dim=-1)
        self.register_buffer("cos_sin_cache", cache.to(dtype or torch.float32), persistent=False)
        # Every layer of one forward rotates at the same positions (one table shared by all
        # layers): look cos/sin up once per positions tensor, not once per layer.
        self._last_positions: Optional[torch.Tensor] = None
        self._last_cos_sin: Optional[tuple[torch.Tensor, torch.Tensor]] = None
        self._kernel = None

    def use_kernel(self, kernel) -> None:
        """Run through `kernel(positions, x, cos_sin_cache)` (a platform's fused op); it may
        return NotImplemented. None: torch."""
        self._kernel = kernel

    def new_forward(self) -> None:
        """Forget the memoized lookup: a captured graph may refill the same positions buffer."""
        self._last_positions = self._last_cos_sin = None

    def _cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if positions is not self._last_positions or self._last_cos_sin is None:
            cos, sin = self.cos_sin_cache.index_select(0, positions).unsqueeze(1).chunk(2, dim=-1)
            self._last_positions, self._last_cos_sin = positions, (cos, sin)
        return self._last_cos_sin

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """x [T, n_heads, D] (any heads: pass q and k stacked to rotate both at once) -> rotated copy."""
        if self._kernel is not None:
            out = self._kernel(positions, x, self.cos_sin_cache)
            if out is not NotImplemented:
                return out
        cos, sin = self._cos_sin(positions)
        x1, x2 = x[..., :self.half], x[..., self.half:]
        # (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin): the HF rotate_half form, same rounding.
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def get_rope(config: Any, head_size: int, max_position: int, dtype: Optional[torch.dtype]) -> RotaryEmbedding:
    params = rope_parameters(config)
    rope_type = params["rope_type"]
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError("partial rotary embeddings are not supported")
    if rope_type == "default":
        base = float(params["rope_theta"])
        inv_freq = 1.0 / (base ** (torch.arange(0, head_size, 2, dtype=torch.int64, device="cpu").float() / head_size))
        scaling = 1.0
    elif rope_type in _DYNAMIC_ROPE_TYPES:
        raise ValueError(f"rope type {rope_type!r} is not supported (its frequencies change with sequence length)")
    else:
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
        if rope_type not in ROPE_INIT_FUNCTIONS:
            raise ValueError(f"unknown rope type {rope_type!r}")
        inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, torch.device("cpu"))
    factors = getattr(config, "rope_freq_factors", None)
    if factors is not None:
        # GGUF llama3 files carry their scaling as per-frequency divisors (llama.cpp's rope_freqs).
        inv_freq = inv_freq / torch.tensor(factors, dtype=torch.float32)
    return RotaryEmbedding(head_size, max_position, inv_freq, float(scaling), dtype)
