"""compressed-tensors checkpoints (llm-compressor's output, quant_method "compressed-tensors" in
config.json's quantization_config).

config_groups name a scheme per group of target modules; one scheme for every linear layer is
what llm-compressor's presets write, and what is run here (the `ignore` list, typically
lm_head, stays in float: core/loaders/quant_config.py swaps ignored layers back to float).
Schemes run:
  W8A8 INT8    format int-quantized: `weight` int8 [N, K], `weight_scale` [N, 1] (channel) or
               one per tensor; activations int8 per token at run time (dynamic) or with a static
               `input_scale`; or none (W8A16) — quantization/int8.py's execution.
  FP8          format float-quantized: `weight` float8_e4m3fn, `weight_scale` per channel or per
               tensor; activations FP8 per token (dynamic), static `input_scale`, or none
               (W8A16) — quantization/fp8.py's execution.
  W4A16        format pack-quantized: `weight_packed` int32 [N, K/8] (eight values per word,
               value + 8 in nibble j for input 8i + j), `weight_scale` [N, K/G], `weight_shape`,
               and for asymmetric weights `weight_zero_point` packed eight output channels per
               int32 [N/8, K/G] — the shared 4-bit grid (quantization/int4_groups.py).
A per-tensor scale of a fused q/k/v or gate/up layer is kept per shard and broadcast to its
output channels. Anything else (2-/8-bit packs, block or group-wise INT8/FP8, act-order
g_idx, NVFP4/MXFP4, asymmetric activations) is refused with a ValueError naming quantization.
"""
from __future__ import annotations

import re
from typing import Any, Mapping, Optional, Sequence

import torch
from torch import nn

from .fp8 import FP8, fp8_linear, keep_fp8
from .int4_groups import (Int4Groups, Int4GroupsMethod, add_bias, add_param, groups_from_values, per_shard_loader,
                          shard_loader, unpack_int32)
from .interface import FormT
from .int8 import int8_linear, keep_int8


def _scheme(config: Mapping[str, Any]) -> tuple[str, dict, Optional[dict]]:
    """(format, weights args, input activation args) of the one scheme the config applies to
    linear layers."""
    groups = list((config.get("config_groups") or {}).values())
    if not groups:
        raise ValueError("quantization 'compressed-tensors': quantization_config has no config_groups")
    schemes = {repr((g.get("format"), g.get("weights"), g.get("input_activations"))) for g in groups}
    if len(schemes) > 1:
        raise ValueError("quantization 'compressed-tensors' with different schemes for different layers "
                         f"({len(groups)} config_groups) is not supported; one scheme for every linear layer is")
    group = groups[0]
    fmt = group.get("format") or config.get("format") or ""
    if group.get("output_activations"):
        raise ValueError("quantization 'compressed-tensors' with quantized output activations is not supported")
    return str(fmt), dict(group.get("weights") or {}), group.get("input_activations")


def _refuse(what: str) -> ValueError:
    return ValueError(f"quantization 'compressed-tensors': {what} is not supported; supported schemes: "
                      "W8A8/W8A16 INT8 (int-quantized, per-channel or per-tensor), FP8 W8A8/W8A16 "
                      "(float-quantized, per-channel or per-tensor), W4A16 (pack-quantized, group or channel)")


class CompressedTensorsQuantization(Int4GroupsMethod):
    name = "compressed-tensors"

    def __init__(self, kind: str = "w4a16", weights: Optional[dict] = None, activations: Optional[dict] = None,
                 ignore: Sequence[str] = ()) -> None:
        super().__init__()
        self.kind = kind                           # "int8", "fp8" or "w4a16"
        self.weights = weights or {}
        self.activations = activations             # None: weight-only
        self.ignore = list(ignore)
        self.channel = self.weights.get("strategy") == "channel"
        self.group_size = int(self.weights.get("group_size") or 0)
        self.symmetric = bool(self.weights.get("symmetric", True))
        self.static_input = bool(activations) and not activations.get("dynamic", False)
        self.stored_names = ("weight_packed", "weight_scale", "weight_zero_point", "weight_shape", "weight",
                             "input_scale")

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> "CompressedTensorsQuantization":
        if config.get("sparsity_config"):
            raise _refuse(f"a sparse checkpoint (sparsity_config {config['sparsity_config'].get('format')!r})")
        fmt, weights, acts = _scheme(config)
        wtype, bits, strategy = weights.get("type", "int"), int(weights.get("num_bits", 0)), weights.get("strategy")
        if weights.get("actorder") not in (None, "weight", "static"):
            raise _refuse(f"actorder {weights.get('actorder')!r} (g_idx)")
        if acts is not None:
            if acts.get("type", "int") != wtype or int(acts.get("num_bits", 0)) != 8 or bits != 8:
                raise _refuse(f"activations {acts.get('type')}{acts.get('num_bits')} with weights {wtype}{bits}")
            if not acts.get("symmetric", True):
                raise _refuse("asymmetric activations")
            if acts.get("dynamic", False) not in (True, False) or (
                    acts.get("strategy") != ("token" if acts.get("dynamic") else "tensor")):
                raise _refuse(f"activation strategy {acts.get('strategy')!r} (dynamic={acts.get('dynamic')})")
        if fmt == "int-quantized" and wtype == "int" and bits == 8 and strategy in ("channel", "tensor"):
            if not weights.get("symmetric", True):
                raise _refuse("asymmetric INT8 weights")
            kind = "int8"
        elif fmt in ("float-quantized", "naive-quantized") and wtype == "float" and bits == 8 \
                and strategy in ("channel", "tensor"):
            kind = "fp8"
        elif fmt == "pack-quantized" and wtype == "int" and bits == 4 and strategy in ("group", "channel") \
                and acts is None:
            kind = "w4a16"
        else:
            raise _refuse(f"format {fmt!r} with {wtype} {bits}-bit {strategy} weights")
        return cls(kind, weights, acts, config.get("ignore") or ())

    def ignores(self, module_name: str) -> bool:
        """Whether the config's `ignore` list names this checkpoint module (exact, or "re:" regex)."""
        for entry in self.ignore:
            if entry.startswith("re:") and re.match(entry[3:], module_name):
                return True
            if module_name == entry or module_name.endswith("." + entry):
                return True
        return False

    def create_weights(self, layer: nn.Module, input_size: int, output_sizes: Sequence[int], bias: bool,
                       dtype: Optional[torch.dtype]) -> None:
        out, n = sum(output_sizes), len(output_sizes)
        layer.ct_output_sizes = list(output_sizes)
        scale_loader = (per_shard_loader(n, "weight_scale", as_stored=True) if self.weights.get("strategy") == "tensor"
                        else shard_loader(output_sizes, 0, 1, "weight_scale", as_stored=True))
        if self.kind == "w4a16":
            g = input_size if self.channel else self.group_size
            if g <= 0 or input_size % g or input_size % 8 or (not self.symmetric and any(s % 8 for s in output_sizes)):
                raise ValueError(f"quantization 'compressed-tensors': a [{out}, {input_size}] layer does not split "
                                 f"into groups of {g} inputs")
            add_param(layer, "weight_packed", [out, input_size // 8], torch.int32,
                      shard_loader(output_sizes, 0, 1, "weight_packed"))
            add_param(layer, "weight_scale", [out, input_size // g], torch.float32, scale_loader)
            add_param(layer, "weight_shape", [n, 2], torch.int64, per_shard_loader(n, "weight_shape"))
            if not self.symmetric:
                add_param(layer, "weight_zero_point", [out // 8, input_size // g], torch.int32,
                          shard_loader(output_sizes, 0, 8, "weight_zero_point"))
        else:
            add_param(layer, "weight", [out, input_size], torch.int8 if self.kind == "int8" else FP8,
                      shard_loader(output_sizes, 0, 1, "weight"))
            add_param(layer, "weight_scale", [n] if self.weights.get("strategy") == "tensor" else [out, 1],
                      torch.float32, scale_loader)
            if self.static_input:
                add_param(layer, "input_scale", [n], torch.float32, per_shard_loader(n, "input_scale"))
        add_bias(layer, output_sizes, bias, dtype)

    def unpack(self, layer: nn.Module) -> Int4Groups:
        k = layer.weight_packed.shape[1] * 8
        expected = torch.tensor([[size, k] for size in layer.ct_output_sizes])
        if not torch.equal(layer.weight_shape.data.cpu(), expected):
            raise ValueError(f"quantization 'compressed-tensors': weight_shape {layer.weight_shape.data.tolist()} "
                             f"does not match the layer's {expected.tolist()}")
        q = unpack_int32(layer.weight_packed.data, dim=1)                    # value + 8, [N, K]
        scales = layer.weight_scale.data
        if self.symmetric:
            zeros = torch.full(scales.shape, 8, dtype=torch.uint8)
        else:   # stored signed, packed like the weights (value + 8)
            zeros = unpack_int32(layer.weight_zero_point.data, dim=0)
        return groups_from_values(q, zeros, scales)

    def _channel_scale(self, layer: nn.Module) -> torch.Tensor:
        scale = layer.weight_scale.data.float().reshape(-1)
        if self.weights.get("strategy") == "tensor":
            scale = scale.repeat_interleave(torch.tensor(layer.ct_output_sizes))
        return scale

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        if self.kind == "w4a16":
            super().process_weights_after_loading(layer)
            return
        scale = self._channel_scale(layer)
        (keep_int8 if self.kind == "int8" else keep_fp8)(layer, layer.weight.data, scale)
        if self.static_input:
            # One activation scale for the fused matmul: the shards' largest (vLLM does the same).
            layer.register_buffer("ct_input_scale", layer.input_scale.data.max().reshape(1), persistent=False)
        for name in ("weight_scale", "input_scale"):
            if name in layer._parameters:
                delattr(layer, name)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
        input_scale = getattr(layer, "ct_input_scale", None)
        if self.kind == "int8":
            return int8_linear(layer, x, bias,
                               dynamic_activations=self.activations is not None and not self.static_input,
                               input_scale=input_scale, kernels=self.kernels)
        if self.kind == "fp8":
            return fp8_linear(layer, x, bias, fp8_activations=self.activations is not None, input_scale=input_scale)
        return super().apply(layer, x, bias)

    def weight_form(self, layer: nn.Module, form: type[FormT]) -> Optional[FormT]:
        return super().weight_form(layer, form) if self.kind == "w4a16" else None
