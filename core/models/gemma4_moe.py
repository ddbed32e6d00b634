"""Gemma 4's RMSNorm and its mixture-of-experts block (`enable_moe_block`), in plain torch with
transformers' numerics (core/models/gemma4.py builds the network from them).

The MoE block sits beside each layer's dense MLP: a router over the stream before the FFN picks
`top_k_experts` of `num_experts` per token (softmax in float32, the picked weights renormalized and
scaled per expert), and each expert is a gated MLP stored as one [experts, 2 * size, hidden]
gate/up tensor and one [experts, hidden, size] down tensor, as the checkpoint holds them.
"""
from __future__ import annotations

from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import nn

from ..layers.linear import Linear
from ..layers.moe import moe_reference
from ..layers.params import plain_parameter


class Gemma4RMSNorm(nn.Module):
    """x * (mean(x^2) + eps)^-1/2 * w in float32, rounded once (w as is, not Gemma 3's 1 + w);
    `with_scale` False: no weight (the values' norm, the router's)."""

    def __init__(self, size: int, eps: float, dtype: Optional[torch.dtype], with_scale: bool = True) -> None:
        super().__init__()
        self.eps = eps
        self.weight = plain_parameter(size, dtype=dtype) if with_scale else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        out = xf * torch.pow(xf.pow(2).mean(-1, keepdim=True) + self.eps, -0.5)
        if self.weight is not None:
            out = out * self.weight.float()
        return out.type_as(x)


class Gemma4Router(nn.Module):
    """hidden [T, H] -> (weights [T, k] float32, expert ids [T, k])."""

    def __init__(self, config: Any, dtype: torch.dtype) -> None:
        super().__init__()
        hidden, experts = config.hidden_size, config.num_experts
        self.top_k = int(config.top_k_experts)
        self.root_size = hidden ** -0.5
        self.norm = Gemma4RMSNorm(hidden, config.rms_norm_eps, dtype, with_scale=False)
        self.proj = Linear(hidden, experts, dtype=dtype)
        self.scale = plain_parameter(hidden, dtype=dtype)
        self.per_expert_scale = plain_parameter(experts, dtype=dtype)

    def forward(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        scores = self.proj(self.norm(hidden) * self.scale * self.root_size)
        probs = F.softmax(scores, dim=-1, dtype=torch.float32)
        weights, ids = torch.topk(probs, k=self.top_k, dim=-1)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights * self.per_expert_scale[ids], ids


class Gemma4Experts(nn.Module):
    """The experts as the checkpoint stores them (experts.gate_up_proj [E, 2 * size, H],
    experts.down_proj [E, H, size]), run by the shared mixture-of-experts op (core/layers/moe.py)."""

    def __init__(self, config: Any, kind: str, dtype: torch.dtype) -> None:
        super().__init__()
        self.num_experts, size, hidden = config.num_experts, config.moe_intermediate_size, config.hidden_size
        self.gate_up_proj = plain_parameter(self.num_experts, 2 * size, hidden, dtype=dtype)
        self.down_proj = plain_parameter(self.num_experts, hidden, size, dtype=dtype)
        self.activation = kind

    def forward(self, hidden: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """Each token's experts' outputs, weighted and summed in expert order (transformers' order)."""
        return moe_reference(hidden, self.gate_up_proj, self.down_proj, weights, ids, self.activation)
