"""AWQ checkpoints (AutoAWQ's "gemm" layout, quant_method "awq" in config.json's
quantization_config): 4-bit weights with a zero point per group of G input channels.

Stored per linear layer, for a weight [N out, K in] (AutoAWQ's WQLinear_GEMM):
  qweight int32 [K, N/8]   eight output channels per word, in AWQ's interleaved order: nibble j
                           (bits 4j..4j+3) holds output channel 8m + AWQ_ORDER[j];
  qzeros  int32 [K/G, N/8] the zero points, packed the same way;
  scales  fp16  [K/G, N] (kept in the dtype the file stores).
w[n, k] = scales[k/G, n] * (q[k, n] - zero[k/G, n]). Unpacked once into the shared 4-bit grid
(quantization/int4_groups.py); the fused q/k/v and gate/up layers take each shard's packed
columns at its output offset / 8.
"""
from __future__ import annotations

from typing import Any, Mapping, Optional, Sequence

import torch
from torch import nn

from .int4_groups import (Int4Groups, Int4GroupsMethod, add_bias, add_param, groups_from_values, shard_loader,
                          unpack_int32)

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


class AWQQuantization(Int4GroupsMethod):
    name = "awq"
    stored_names = ("qweight", "qzeros", "scales")

    def __init__(self, group_size: int = 128, zero_point: bool = True) -> None:
        super().__init__()
        self.group_size = group_size
        self.zero_point = zero_point

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> "AWQQuantization":
        bits = int(config.get("bits", config.get("w_bit", 4)))
        version = str(config.get("version", "gemm")).lower()
        group_size = int(config.get("group_size", config.get("q_group_size", 128)))
        if bits != 4:
            raise ValueError(f"quantization 'awq' with {bits}-bit weights is not supported (4-bit only)")
        if version != "gemm":
            raise ValueError(f"quantization 'awq' version {version!r} is not supported (the 'gemm' layout only)")
        if group_size <= 0:
            raise ValueError(f"quantization 'awq' group_size {group_size} is not supported (per-group scales only)")
        if not config.get("zero_point", True):
            raise ValueError("quantization 'awq' without zero points is not supported (AutoAWQ writes them)")
        method = cls(group_size)
        method.not_converted = tuple(config.get("modules_to_not_convert") or ())
        return method

    def create_weights(self, layer: nn.Module, input_size: int, output_sizes: Sequence[int], bias: bool,
                       dtype: Optional[torch.dtype]) -> None:
        out, g = sum(output_sizes), self.group_size
        if input_size % g or any(size % 8 for size in output_sizes):
            raise ValueError(f"quantization 'awq': a [{out}, {input_size}] layer does not split into groups of {g} "
                             "inputs and 8-channel words")
        add_param(layer, "qweight", [input_size, out // 8], torch.int32, shard_loader(output_sizes, 1, 8, "qweight"))
        add_param(layer, "qzeros", [input_size // g, out // 8], torch.int32, shard_loader(output_sizes, 1, 8, "qzeros"))
        add_param(layer, "scales", [input_size // g, out], torch.float16,
                  shard_loader(output_sizes, 1, 1, "scales", as_stored=True))
        add_bias(layer, output_sizes, bias, dtype)

    def unpack(self, layer: nn.Module) -> Int4Groups:
        q = unpack_int32(layer.qweight.data, dim=1, order=AWQ_ORDER)          # [K, N]
        zeros = unpack_int32(layer.qzeros.data, dim=1, order=AWQ_ORDER)      # [K/G, N]
        return groups_from_values(q.t(), zeros.t(), layer.scales.data.t())
