"""GPTQ checkpoints (AutoGPTQ / GPTQModel, quant_method "gptq" in config.json's
quantization_config): 4-bit weights in groups of G input channels, optionally in activation
order (`desc_act`), symmetric or with zero points.

Stored per linear layer, for a weight [N out, K in]:
  qweight int32 [K/8, N]   eight input channels per word: nibble j of row i is input 8i + j;
  qzeros  int32 [K/G, N/8] eight output channels per word, nibble j is channel 8m + j. The
                           "gptq" checkpoint_format (v1) stores zero - 1 (AutoGPTQ's
                           convention), "gptq_v2" the zero itself;
  scales  fp16  [K/G, N];
  g_idx   int32 [K]        the group of each input channel: k // G, or with desc_act the
                           quantization order's groups.
w[n, k] = scales[g_idx[k], n] * (q[k, n] - zero[g_idx[k], n]).

Act-order is resolved once at load: the input channels are sorted by group (a permutation
kept with the weight), so groups are contiguous again, and `apply` permutes the activations
the same way (one index_select per matmul). q/k/v (and gate/up) see the same inputs, so GPTQ
gives them the same g_idx; a checkpoint whose fused shards disagree is refused.
"""
from __future__ import annotations

from typing import Any, Mapping, Optional, Sequence

import torch
from torch import nn

from .int4_groups import (Int4Groups, Int4GroupsMethod, add_bias, add_param, groups_from_values, per_shard_loader,
                          shard_loader, unpack_int32)


class GPTQQuantization(Int4GroupsMethod):
    name = "gptq"
    stored_names = ("qweight", "qzeros", "scales", "g_idx")

    def __init__(self, group_size: int = 128, desc_act: bool = False, sym: bool = True, v2: bool = False) -> None:
        super().__init__()
        self.group_size, self.desc_act, self.sym, self.v2 = group_size, desc_act, sym, v2

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> "GPTQQuantization":
        bits = int(config.get("bits", 4))
        group_size = int(config.get("group_size", 128))
        checkpoint_format = str(config.get("checkpoint_format", config.get("format", "gptq"))).lower()
        if bits != 4:
            raise ValueError(f"quantization 'gptq' with {bits}-bit weights is not supported (4-bit only)")
        if group_size <= 0:
            raise ValueError(f"quantization 'gptq' group_size {group_size} (one group per channel) is not supported; "
                             "group sizes such as 32, 64 and 128 are")
        if checkpoint_format not in ("gptq", "gptq_v2"):
            raise ValueError(f"quantization 'gptq' checkpoint_format {checkpoint_format!r} is not supported "
                             "(gptq or gptq_v2)")
        if config.get("lm_head"):
            raise ValueError("quantization 'gptq' with a quantized lm_head is not supported")
        return cls(group_size, bool(config.get("desc_act", False)), bool(config.get("sym", True)),
                   checkpoint_format == "gptq_v2")

    def create_weights(self, layer: nn.Module, input_size: int, output_sizes: Sequence[int], bias: bool,
                       dtype: Optional[torch.dtype]) -> None:
        out, g = sum(output_sizes), self.group_size
        if input_size % g or input_size % 8 or any(size % 8 for size in output_sizes):
            raise ValueError(f"quantization 'gptq': a [{out}, {input_size}] layer does not split into groups of {g} "
                             "inputs and 8-channel words")
        add_param(layer, "qweight", [input_size // 8, out], torch.int32, shard_loader(output_sizes, 1, 1, "qweight"))
        add_param(layer, "qzeros", [input_size // g, out // 8], torch.int32, shard_loader(output_sizes, 1, 8, "qzeros"))
        add_param(layer, "scales", [input_size // g, out], torch.float16,
                  shard_loader(output_sizes, 1, 1, "scales", as_stored=True))
        add_param(layer, "g_idx", [len(output_sizes), input_size], torch.int32,
                  per_shard_loader(len(output_sizes), "g_idx"))
        add_bias(layer, output_sizes, bias, dtype)

    def unpack(self, layer: nn.Module) -> Int4Groups:
        q = unpack_int32(layer.qweight.data, dim=0)                          # [K, N]
        zeros = unpack_int32(layer.qzeros.data, dim=1)                       # [K/G, N]
        if not self.v2:
            zeros = (zeros + 1) & 0xF                                        # v1 stores zero - 1
        g_idx = layer.g_idx.data
        if not bool((g_idx == g_idx[0]).all()):
            raise ValueError("quantization 'gptq': the fused shards of a layer have different g_idx "
                             "(act-order permutations); this checkpoint cannot be run with fused q/k/v")
        g_idx = g_idx[0].long()
        k, num_groups = q.shape[0], zeros.shape[0]
        if bool((g_idx == torch.arange(k) // (k // num_groups)).all()):
            return groups_from_values(q.t(), zeros.t(), layer.scales.data.t())
        counts = torch.bincount(g_idx, minlength=num_groups) if bool((g_idx >= 0).all()) else None
        if counts is None or counts.numel() != num_groups or not bool((counts == k // num_groups).all()):
            raise ValueError("quantization 'gptq': g_idx does not put group_size input channels in each group")
        perm = torch.argsort(g_idx, stable=True)                             # inputs sorted by group
        return groups_from_values(q[perm].t(), zeros.t(), layer.scales.data.t(), perm)
