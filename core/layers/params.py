"""Parameters that load a checkpoint tensor as it is (embeddings, norms, an untied LM head)."""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn


def default_weight_loader(param: nn.Parameter, loaded: torch.Tensor, shard_id: Optional[int] = None) -> None:
    """Copy `loaded` into `param` (converting its dtype); ValueError on a shape mismatch."""
    if shard_id is not None:
        raise ValueError(f"shard {shard_id} given for a parameter that is not fused")
    if tuple(param.shape) != tuple(loaded.shape):
        raise ValueError(f"shape mismatch: checkpoint {tuple(loaded.shape)} vs model {tuple(param.shape)}")
    param.data.copy_(loaded)


def plain_parameter(*shape: int, dtype: Optional[torch.dtype]) -> nn.Parameter:
    """An uninitialized inference parameter (loading overwrites every element) with the default loader."""
    param = nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)
    param.weight_loader = default_weight_loader
    return param
