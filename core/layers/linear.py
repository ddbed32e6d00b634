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

from ..distributed import all_reduce, tp_rank, tp_size


class Linear(nn.Module):
    """y = x W^T (+ b).

    `output_sizes` splits the output dimension into shards that the checkpoint stores as
    separate tensors (q/k/v, gate/up); the weight loader fills one of them per call. One fused
    matmul per layer instead of three keeps small-batch decode from being dominated by op overhead.
    """

    def __init__(self, input_size: int, output_sizes: Sequence[int] | int, bias: bool = False,
                 dtype: Optional[torch.dtype] = None, quant_method: Optional[QuantizationMethod] = None,
                 parallel: Optional[str] = None, shard_slices: Optional[Sequence[tuple[int, int]]] = None) -> None:
        """Sizes are the checkpoint's (whole model). `parallel`: None (replicated), "column" (each
        tensor-parallel rank holds 1/tp of every output shard) or "row" (1/tp of the input; the
        partial products are all-reduced, the bias added once). `shard_slices`: for "column", the
        (checkpoint row offset, rows) of each output shard this rank holds, where an even split
        does not apply (KV heads replicated over ranks); default: rank r holds the r-th 1/tp."""
        super().__init__()
        full_sizes = [output_sizes] if isinstance(output_sizes, int) else list(output_sizes)
        if parallel not in (None, "column", "row"):
            raise ValueError(f"parallel must be None, 'column' or 'row', got {parallel!r}")
        self.parallel = parallel
        self.checkpoint_sizes = full_sizes          # the output shards as a checkpoint stores them
        self.tp_rank, self.tp_size = (tp_rank(), tp_size()) if parallel else (0, 1)
        # (checkpoint offset, rows) of each output shard held here: the loader narrows to it.
        if parallel == "column" and shard_slices is not None:
            self.shard_slices = [tuple(s) for s in shard_slices]
        elif parallel == "column":
            self.shard_slices = [(self.tp_rank * (n // self.tp_size), n // self.tp_size) for n in full_sizes]
        else:
            self.shard_slices = [(0, n) for n in full_sizes]
        self.output_sizes = [rows for _, rows in self.shard_slices]
        self.input_size = input_size // self.tp_size if parallel == "row" else input_size
        self.output_size = sum(self.output_sizes)
        self.quant_method = quant_method or UnquantizedLinearMethod()
        self.quant_method.create_weights(self, self.input_size, self.output_sizes, bias, dtype)
        self._kernel: Any = None       # a platform's dense-matmul kernel (core/layers/kernels.py)
        self._prepared: Any = None
        self.lora: Any = None          # adapter slots (core/lora/layers.py): adds each row's LoRA delta

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: Optional[int] = None) -> None:
        """Copy `loaded` into `param` whole (shard_id None) or into output shard `shard_id`; at
        tensor parallelism, this rank's slice of it (narrowed before anything is copied)."""
        target = param.data
        if shard_id is not None:
            if not 0 <= shard_id < len(self.output_sizes):
                raise ValueError(f"shard {shard_id} of a layer with {len(self.output_sizes)} output shards")
            target = target.narrow(0, sum(self.output_sizes[:shard_id]), self.output_sizes[shard_id])
        if self.tp_size > 1:
            loaded = self._rank_slice(loaded, 0 if shard_id is None else shard_id)
        elif hasattr(loaded, "materialize"):        # a lazy checkpoint slice (loaders/hf.py), read whole
            loaded = loaded.materialize()
        if tuple(target.shape) != tuple(loaded.shape):
            where = "" if shard_id is None else f" (shard {shard_id})"
            raise ValueError(f"shape mismatch{where}: checkpoint {tuple(loaded.shape)} vs model {tuple(target.shape)}")
        target.copy_(loaded)

    weight_loader.narrows_lazily = True       # reads only this rank's part of a lazy checkpoint slice

    @property
    def prepared(self) -> Any:
        """The platform kernel's re-laid-out weight (None without a kernel): what another of the
        platform's paths may read instead of packing the weight again."""
        return self._prepared

    def use_kernel(self, kernel: Any) -> None:
        """Run matmuls through a platform's dense kernel on a re-laid-out copy of the loaded
        weight (e.g. platforms/cpu_linear.py; platforms offer one only without `quantization=`,
        since it bypasses the method). None goes back to the quantization method."""
        self._kernel = kernel
        self._prepared = None if kernel is None else kernel.prepare(self.weight)

    def _rank_slice(self, loaded: torch.Tensor, shard_id: int) -> torch.Tensor:
        """This rank's part of a checkpoint tensor: output rows (column) or input columns (row;
        a row-parallel bias is whole, added by rank 0 only)."""
        if self.parallel == "column":
            offset, rows = self.shard_slices[shard_id]
            if offset + rows > loaded.shape[0]:
                raise ValueError(f"checkpoint shard {tuple(loaded.shape)} has no rows {offset}..{offset + rows}")
            return loaded.narrow(0, offset, rows)
        if loaded.dim() == 1:
            return loaded.materialize() if hasattr(loaded, "materialize") else loaded
        width = self.input_size
        return loaded.narrow(1, self.tp_rank * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.parallel == "row" and self.tp_size > 1:
            bias = self.bias if self.tp_rank == 0 else None      # added once, before the sum
            return all_reduce(self._matmul(x, bias))
        y = self._matmul(x, self.bias)
        return y if self.lora is None else self.lora(x, y)

    def _matmul(self, x: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
        if self._kernel is not None:
            y = self._kernel(x, self._prepared, bias)
            if y is not NotImplemented:        # a kernel may leave some inputs to the method
                return y
        return self.quant_method.apply(self, x, bias)
