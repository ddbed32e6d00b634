"""Dense linear layers, including the fused ones (qkv, gate_up) that load from several HF tensors."""
from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn


class Linear(nn.Module):
    """y = x W^T (+ b). Parameters start uninitialized: every one is overwritten at load.

    `output_sizes` splits the output dimension into shards that the checkpoint stores as
    separate tensors (q/k/v, gate/up); `load_shard` fills one of them. One fused matmul per
    layer instead of three keeps small-batch decode from being dominated by op overhead.
    """

    def __init__(self, input_size: int, output_sizes: Sequence[int] | int, bias: bool = False,
                 dtype: Optional[torch.dtype] = None) -> None:
        super().__init__()
        self.output_sizes = [output_sizes] if isinstance(output_sizes, int) else list(output_sizes)
        self.input_size = input_size
        self.output_size = sum(self.output_sizes)
        self.weight = nn.Parameter(torch.empty(self.output_size, input_size, dtype=dtype), requires_grad=False)
        self.bias = (nn.Parameter(torch.empty(self.output_size, dtype=dtype), requires_grad=False)
                     if bias else None)
        self._loaded: set[tuple[str, int]] = set()
        self._kernel = None            # None: F.linear on `weight`
        self._prepared = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._kernel is None:
            return F.linear(x, self.weight, self.bias)
        return self._kernel(x, self._prepared, self.bias)

    def use_kernel(self, kernel) -> None:
        """Run matmuls through `kernel` (e.g. platforms/cpu_linear.py) on a re-laid-out copy
        of the current weight; call after loading. None goes back to F.linear."""
        self._kernel = kernel
        self._prepared = None if kernel is None else kernel.prepare(self.weight)

    def load_shard(self, param_name: str, shard: int, tensor: torch.Tensor) -> None:
        """Copy `tensor` into output shard `shard` of `weight` or `bias`."""
        param = self.weight if param_name == "weight" else self.bias
        if param is None:
            raise ValueError(f"checkpoint has a {param_name} this layer was built without")
        start = sum(self.output_sizes[:shard])
        size = self.output_sizes[shard]
        target = param.data.narrow(0, start, size)
        if tuple(target.shape) != tuple(tensor.shape):
            raise ValueError(f"shape mismatch for shard {shard} of {param_name}: "
                             f"checkpoint {tuple(tensor.shape)} vs model {tuple(target.shape)}")
        target.copy_(tensor)
        self._loaded.add((param_name, shard))

    def missing_shards(self) -> list[str]:
        names = ["weight"] + (["bias"] if self.bias is not None else [])
        return [f"{n}[{i}]" for n in names for i in range(len(self.output_sizes)) if (n, i) not in self._loaded]
