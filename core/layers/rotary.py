"""Rotary position embedding (HF "rotate half" layout) with a precomputed cos/sin table.

Rope parameters come from the HF config in either spelling: transformers 5 keeps them in
`config.rope_parameters` (rope_theta, rope_type, scaling factors); older configs use
`rope_theta` + `rope_scaling`. Non-default inverse frequencies are computed by transformers'
own ROPE_INIT_FUNCTIONS so they match HF bit for bit.
"""
from __future__ import annotations

from typing import Any, Optional, Union

import torch
from torch import nn



def rope_parameters(config: Any, layer_type: Optional[str] = None) -> dict:
    """The rope settings of an HF config as one dict with at least rope_theta and rope_type; for
    configs that keep them per layer type (Gemma 3's sliding vs full layers), `layer_type`'s (full
    attention's when not given)."""
    params = getattr(config, "rope_parameters", None)
    if is_per_layer_type(params):
        params = params.get(layer_type or "full_attention") or next(iter(params.values()))
    if not params:
        params = dict(getattr(config, "rope_scaling", None) or {})
        params.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
    params = dict(params)
    params["rope_type"] = params.get("rope_type", params.get("type", "default")) or "default"
    params.setdefault("partial_rotary_factor", getattr(config, "partial_rotary_factor", None) or 1.0)
    return params


def is_per_layer_type(params: Any) -> bool:
    return isinstance(params, dict) and bool(params) and all(isinstance(v, dict) for v in params.values())


class RotaryEmbedding(nn.Module):
    """Rotates the leading `rotary_dim` dims of each head (all of them by default; Phi-3 and GLM
    rotate a part and pass the rest), as halves (`interleaved` False: Llama's rotate_half) or as
    adjacent pairs (True: GLM's and Cohere's GPT-J layout). `inv_freq` is [rotary_dim / 2], or
    [positions, rotary_dim / 2] where the frequencies depend on the position (dynamic NTK, longrope);
    `attention_scaling` a number or [positions, 1] (PhiMoE's mscale per position)."""

    def __init__(self, head_size: int, max_position: int, inv_freq: torch.Tensor,
                 attention_scaling: Union[float, torch.Tensor] = 1.0, dtype: Optional[torch.dtype] = None,
                 rotary_dim: Optional[int] = None, interleaved: bool = False) -> None:
        super().__init__()
        self.head_size = head_size
        self.rotary_dim = rotary_dim or head_size
        self.half = self.rotary_dim // 2
        self.interleaved = interleaved
        positions = torch.arange(max_position, dtype=torch.float32)
        inv_freq = inv_freq.to(device=positions.device, dtype=torch.float32)
        if inv_freq.dim() == 1:
            freqs = torch.outer(positions, inv_freq)          # [P, D/2], float32 as in HF
        else:
            freqs = positions[:, None] * inv_freq[:max_position]
        # cos | sin side by side, so one gather per step fetches both; stored in the model dtype
        # because HF casts cos/sin to the activations' dtype before rotating.
        cache = torch.cat((freqs.cos() * attention_scaling, freqs.sin() * attention_scaling), dim=-1)
        self.register_buffer("cos_sin_cache", cache.to(dtype or torch.float32), persistent=False)
        # Every layer of one forward rotates at the same positions (one table shared by all
        # layers): look cos/sin up once per positions tensor, not once per layer.
        self._last_positions: Optional[torch.Tensor] = None
        self._last_cos_sin: Optional[tuple[torch.Tensor, torch.Tensor]] = None
        self._kernel = None

    @property
    def whole_head(self) -> bool:
        """Rotate-half over every dim: the layout platform kernels and decode programs take."""
        return self.rotary_dim == self.head_size and not self.interleaved

    def use_kernel(self, kernel) -> None:
        """Run through `kernel(positions, x, cos_sin_cache)` (a platform's fused op), given
        `rotary_dim=` and `interleaved=` where the rotation is not rotate-half over whole heads; it
        may return NotImplemented. None: torch."""
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
            out = self._kernel(positions, x, self.cos_sin_cache) if self.whole_head else \
                self._kernel(positions, x, self.cos_sin_cache, rotary_dim=self.rotary_dim, interleaved=self.interleaved)
            if out is not NotImplemented:
                return out
        cos, sin = self._cos_sin(positions)
        rot, rest = x[..., :self.rotary_dim], x[..., self.rotary_dim:]
        if self.interleaved:
            # Pairs (x[2i], x[2i+1]) rotate by angle i: GLM's rotate_half over repeat_interleaved cos/sin.
            x1, x2 = rot[..., 0::2], rot[..., 1::2]
            out = torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)
        else:
            x1, x2 = rot[..., :self.half], rot[..., self.half:]
            # (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin): the HF rotate_half form, same rounding.
            out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
        return out if rest.shape[-1] == 0 else torch.cat((out, rest), dim=-1)


def _default_inv_freq(base: float, dim: int) -> torch.Tensor:
    return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float() / dim))


def get_rope(config: Any, head_size: int, max_position: int, dtype: Optional[torch.dtype],
             layer_type: Optional[str] = None, interleaved: bool = False) -> RotaryEmbedding:
    """The rotary embedding HF would build for `config` (for `layer_type`'s rope parameters where the
    config keeps them per layer type). Every rope type transformers implements: default, linear,
    llama3, yarn, longrope and dynamic. The last two change their frequencies with the sequence
    length; here a position p rotates with the frequencies HF uses when p is the newest token
    (longrope's long factors from its original length on, dynamic NTK's base for p + 1 tokens),
    which is HF's decode exactly and its prefill of a prompt that stays under the original length."""
    params = rope_parameters(config, layer_type)
    rope_type = params["rope_type"]
    rotary_dim = int(head_size * float(params["partial_rotary_factor"]))
    per_type = layer_type if is_per_layer_type(getattr(config, "rope_parameters", None)) else None
    base = float(params["rope_theta"])
    scaling: Union[float, torch.Tensor] = 1.0
    if rope_type == "default":
        inv_freq = _default_inv_freq(base, rotary_dim)
    elif rope_type == "dynamic":
        original = int(config.max_position_embeddings)
        factor = float(params["factor"])
        max_position = max(max_position, int(original * factor))
        lengths = torch.arange(1, max_position + 1, dtype=torch.float64).clamp(min=original)
        bases = base * ((factor * lengths / original) - (factor - 1)) ** (rotary_dim / (rotary_dim - 2))
        exponents = torch.arange(0, rotary_dim, 2, dtype=torch.int64).double() / rotary_dim
        inv_freq = (1.0 / (bases[:, None] ** exponents)).float()
    else:
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
        if rope_type not in ROPE_INIT_FUNCTIONS:
            raise ValueError(f"unknown rope type {rope_type!r}")
        kwargs = {"layer_type": per_type} if per_type else {}
        inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, torch.device("cpu"), **kwargs)
        if rope_type == "longrope" and "short_mscale" in params:
            # PhiMoE: transformers 5 rotates with the short factors throughout and scales cos/sin by
            # short_mscale, or long_mscale once the sequence passes the original length.
            original = int(params["original_max_position_embeddings"])
            rows = torch.arange(max_position)[:, None] >= original
            scaling = torch.where(rows, float(params["long_mscale"]), float(params["short_mscale"]))
        elif rope_type == "longrope":
            original = int(params["original_max_position_embeddings"])
            long_freq, _ = ROPE_INIT_FUNCTIONS[rope_type](config, torch.device("cpu"), seq_len=original + 1, **kwargs)
            rows = torch.arange(max_position)[:, None] >= original
            inv_freq = torch.where(rows, long_freq[None, :], inv_freq[None, :])
    factors = getattr(config, "rope_freq_factors", None)
    if factors is not None:
        # GGUF llama3 files carry their scaling as per-frequency divisors (llama.cpp's rope_freqs).
        inv_freq = inv_freq / torch.tensor(factors, dtype=torch.float32)
    return RotaryEmbedding(head_size, max_position, inv_freq, scaling if isinstance(scaling, torch.Tensor)
                           else float(scaling), dtype, rotary_dim, interleaved)
