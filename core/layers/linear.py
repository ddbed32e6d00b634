"""Linear layers, including the fused ones (qkv, gate_up) that load from several HF tensors.

How the weights are stored, post-processed and multiplied is the layer's quantization method
(quantization/interface.py); the layer owns only the geometry and how a checkpoint tensor lands
in its parameters (`weight_loader`).
"""
from __future__ import annotations

from typing import Any, Optional, Sequence

import torch
from torch import nn

from tokenmill.quantization.interface import QuantizationMethod
from tokenmill.quantization.unquantized import UnquantizedLinearMethod


class Linear(nn.Module):
    """y = x W^T (+ b).

    `output_sizes` splits the output dimension into shards that the checkpoint stores as
    separate tensors (q/k/v, gate/up); the weight loader fills one of them per call. One fused
    matmul per layer instead of three keeps small-batch decode from being dominated by op overhead.
    """

    def __init__(self, input_size: int, output_sizes: Sequence[int] | int, bias: bool = False,
                 dtype: Optional[torch.dtype] = None, quant_method: Optional[QuantizationMethod] = None) -> None:
        super().__init__()
        self.output_sizes = [output_sizes] if isinstance(output_sizes, int) else list(output_sizes)
        self.input_size = input_size
        self.output_size = sum(self.output_sizes)
        self.quant_method = quant_method or UnquantizedLinearMethod()
        self.quant_method.create_weights(self, input_size, self.output_sizes, bias, dtype)
        self._kernel: Any = None       # a platform's dense-matmul kernel (core/layers/kernels.py)
        self._prepared: Any = None

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: Optional[int] = None) -> None:
        """Copy `loaded` into `param` whole (shard_id None) or into output shard `shard_id`."""
        target = param.data
        if shard_id is not None:
            if not 0 <= shard_id < len(self.output_sizes):
                raise ValueError(f"shard {shard_id} of a layer with {len(self.output_sizes)} output shards")
            target = target.narrow(0, sum(self.output_sizes[:shard_id]), self.output_sizes[shard_id])
        if tuple(target.shape) != tuple(loaded.shape):
            where = "" if shard_id is None else f" (shard {shard_id})"
            raise ValueError(f"shape mismatch{where}: checkpoint {tuple(loaded.shape)} vs model {tuple(target.shape)}")
        target.copy_(loaded)

    def use_kernel(self, kernel: Any) -> None:
        """Run matmuls through a platform's dense kernel on a re-laid-out copy of the loaded
        weight (e.g. platforms/cpu_linear.py; platforms offer one only without `quantization=`,
        since it bypasses the method). None goes back to the quantization method."""
        self._kernel = kernel
        self._prepared = None if kernel is None else kernel.prepare(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._kernel is not None:
            return self._kernel(x, self._prepared, self.bias)
        return self.quant_method.apply(self, x, self.bias)
