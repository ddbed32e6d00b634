"""FP8 (float8_e4m3fn) weights: `--quantization fp8` (a float checkpoint quantized at load), FP8
checkpoints (quant_method "fp8": vLLM's / transformers' serialization) and the execution
compressed-tensors' FP8 schemes share (quantization/compressed_tensors.py).

Weights stay float8_e4m3fn [N, K] with one float32 scale per output channel (a per-tensor or
per-shard scale is broadcast to its channels): w = scale[n] * w8[n, k].
Execution on CPU: no fp8 GEMM here, so a tile of output rows at a time is upcast to the
activation dtype and multiplied (W8A16 semantics, the same numbers as the dequantized weight).
With FP8 activations (compressed-tensors W8A8: dynamic per-token, or a static per-tensor
input_scale) the activations are first rounded to float8_e4m3fn with their scale, so the
product is the one an FP8 GEMM computes, accumulated in float32.
"""
from __future__ import annotations

from typing import Any, Mapping, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from .cpu_int4 import drop_dense_experts
from .int4_groups import add_bias, add_param, per_shard_loader, shard_loader
from .interface import ExpertsMethod
from .unquantized import UnquantizedLinearMethod

FP8 = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8).max)         # 448
TILE_ROWS = 2048


def quantize_fp8_per_channel(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [N, K] float -> (float8_e4m3fn [N, K], float32 scale [N]), each row's max at 448."""
    w = weight.detach().float()
    scale = w.abs().amax(dim=1).clamp_(min=1e-12) / FP8_MAX
    return (w / scale[:, None]).clamp_(-FP8_MAX, FP8_MAX).to(FP8), scale


def keep_fp8(layer: nn.Module, w8: torch.Tensor, scale: torch.Tensor) -> None:
    """Store the layer's weight as float8 [N, K] with float32 scales [N] (dropping `weight`)."""
    if "weight" in layer._parameters:
        delattr(layer, "weight")
    layer.register_buffer("fp8_weight", w8.contiguous(), persistent=False)
    layer.register_buffer("fp8_scale", scale.float().reshape(-1).contiguous(), persistent=False)


def fp8_round_activations(x: torch.Tensor, input_scale: Optional[torch.Tensor]) -> torch.Tensor:
    """x rounded to float8_e4m3fn with a per-token scale (input_scale None) or the static one,
    back in float32."""
    rows = x.float()
    scale = (rows.abs().amax(dim=-1, keepdim=True).clamp_(min=1e-12) / FP8_MAX if input_scale is None
             else input_scale.float().reshape(()))
    return (rows / scale).clamp_(-FP8_MAX, FP8_MAX).to(FP8).float() * scale


def fp8_linear(layer: nn.Module, x: torch.Tensor, bias: Optional[torch.Tensor], fp8_activations: bool = False,
               input_scale: Optional[torch.Tensor] = None) -> torch.Tensor:
    w8, scale = layer.fp8_weight, layer.fp8_scale
    out_dtype = x.dtype
    if fp8_activations:
        x = fp8_round_activations(x, input_scale)
    compute = torch.float32 if fp8_activations else x.dtype
    tiles = [F.linear(x, (w8[i:i + TILE_ROWS].float() * scale[i:i + TILE_ROWS, None]).to(compute))
             for i in range(0, w8.shape[0], TILE_ROWS)]
    y = tiles[0] if len(tiles) == 1 else torch.cat(tiles, dim=-1)
    y = y.to(out_dtype)
    return y + bias if bias is not None else y


class Fp8Quantization(UnquantizedLinearMethod):
    """quantization="fp8". On an unquantized checkpoint: every linear layer's weight quantized at
    load to float8_e4m3fn per output channel (vLLM's dynamic fp8 mode; the LM head stays in
    float). On an FP8 checkpoint (config.json quant_method "fp8"): its float8 `weight` with a
    per-tensor `weight_scale` (vLLM's serialization) is loaded as stored; block-wise
    `weight_scale_inv` checkpoints are refused."""
    name = "fp8"

    def __init__(self, serialized: bool = False, static_activations: bool = False) -> None:
        super().__init__()
        self.serialized = serialized
        self.static_activations = static_activations

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> "Fp8Quantization":
        if config.get("weight_block_size"):
            raise ValueError(f"quantization 'fp8' with block-wise scales (weight_block_size "
                             f"{config['weight_block_size']}) is not supported; per-tensor scales are")
        scheme = str(config.get("activation_scheme", "dynamic"))
        if scheme not in ("dynamic", "static"):
            raise ValueError(f"quantization 'fp8' activation_scheme {scheme!r} is not supported (dynamic or static)")
        return cls(serialized=True, static_activations=scheme == "static")

    def create_weights(self, layer: nn.Module, input_size: int, output_sizes: Sequence[int], bias: bool,
                       dtype: Optional[torch.dtype]) -> None:
        if not self.serialized:
            super().create_weights(layer, input_size, output_sizes, bias, dtype)
            return
        n = len(output_sizes)
        add_param(layer, "weight", [sum(output_sizes), input_size], FP8, shard_loader(output_sizes, 0, 1, "weight"))
        add_param(layer, "weight_scale", [n], torch.float32, per_shard_loader(n, "weight_scale"))
        if self.static_activations:
            add_param(layer, "input_scale", [n], torch.float32, per_shard_loader(n, "input_scale"))
        add_bias(layer, output_sizes, bias, dtype)
        layer.fp8_output_sizes = list(output_sizes)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        if not self.serialized:
            keep_fp8(layer, *quantize_fp8_per_channel(layer.weight))
            return
        sizes = torch.tensor(layer.fp8_output_sizes)
        scale = layer.weight_scale.data.repeat_interleave(sizes)
        keep_fp8(layer, layer.weight.data, scale)
        delattr(layer, "weight_scale")
        if self.static_activations:
            # One activation scale for the fused matmul: the shards' largest (vLLM does the same).
            layer.register_buffer("fp8_input_scale", layer.input_scale.data.max().reshape(1), persistent=False)
            delattr(layer, "input_scale")

    def experts_method(self) -> Optional[ExpertsMethod]:
        """--quantization fp8 on a float checkpoint: the experts too (Fp8Experts). An FP8
        checkpoint's stored experts are not read yet (its MoE layers refuse the method)."""
        return None if self.serialized else Fp8Experts()

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
        # Serialized with static activation scales: FP8 activations as the checkpoint was calibrated;
        # otherwise W8A16 (the CPU has no FP8 GEMM to gain from rounding activations).
        if self.serialized and self.static_activations:
            return fp8_linear(layer, x, bias, True, layer.fp8_input_scale)
        return fp8_linear(layer, x, bias)


class Fp8Experts(ExpertsMethod):
    """Run-time fp8 on a mixture-of-experts layer's experts (cpu_int4.py's notes on experts): each
    expert's rows float8_e4m3fn with one float32 scale per output row, as the fp8 linear layers keep
    theirs; no float copy kept. No platform kernel multiplies fp8 experts here: the torch op takes
    them dequantized per call (W8A16, as the fp8 linear layers)."""
    name = "fp8"
    resident = False

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        kept = {}
        for name in ("w13", "w2"):
            param = getattr(layer, name)
            num, n, k = param.shape
            kept[name] = quantize_fp8_per_channel(param.detach().reshape(num * n, k))
        layer.fp8_experts = kept
        drop_dense_experts(layer)

    def weights(self, layer: nn.Module, experts: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
        kept = getattr(layer, "fp8_experts", None)
        if kept is None:
            return super().weights(layer, experts)
        out = []
        for name in ("w13", "w2"):
            param = getattr(layer, name)
            q, scale = kept[name]
            q, scale = q.reshape(param.shape), scale.reshape(param.shape[:2])
            if experts is not None:
                q, scale = q[experts], scale[experts]
            out.append((q.float() * scale.unsqueeze(-1)).to(param.dtype))
        return out[0], out[1]
