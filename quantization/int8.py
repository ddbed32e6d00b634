"""8-bit integer weights: `--quantization int8` (a float checkpoint quantized at load) and the
execution compressed-tensors' INT8 schemes share (quantization/compressed_tensors.py).

Weights: int8, one symmetric scale per output channel (w = scale[n] * q[n, k]), kept as
int8 [N, K] plus the float32 scales — a quarter of float32, no float copy.
Activations, the W8A8 way (vLLM's and llm-compressor's default): quantized per token to int8
at run time (one scale per row, from its absolute max), multiplied int8 x int8 -> int32 by
torch._int_mm (VNNI on x86 CPUs, through oneDNN) and rescaled — the cpu_int4 method's
int8_matmul_per_token, with the cpu platform's native quantize/dequantize ends when they build.
A static per-tensor input scale (compressed-tensors' static W8A8) quantizes with that scale
instead. Weight-only (W8A16): dequantized a tile at a time and multiplied in float.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from .cpu_int4 import drop_dense_experts, experts_fit, int8_matmul_per_token, quantize_int8_per_channel
from .interface import ExpertForms, ExpertsMethod, FormT, Int8Channels, QuantKernels
from .unquantized import UnquantizedLinearMethod

TILE_ROWS = 2048


def keep_int8(layer: nn.Module, q: torch.Tensor, scale: torch.Tensor) -> None:
    """Store the layer's weight as int8 [N, K] with float32 scales [N] (dropping `weight`)."""
    if "weight" in layer._parameters:
        delattr(layer, "weight")
    layer.register_buffer("int8_weight", q.contiguous(), persistent=False)
    layer.register_buffer("int8_scale", scale.float().reshape(-1).contiguous(), persistent=False)


def int8_linear(layer: nn.Module, x: torch.Tensor, bias: Optional[torch.Tensor], dynamic_activations: bool = True,
                input_scale: Optional[torch.Tensor] = None, kernels: Optional[QuantKernels] = None) -> torch.Tensor:
    """x [..., K] times the layer's int8 weight. `dynamic_activations`: int8 per-token activations;
    `input_scale`: one static activation scale; neither: the weight dequantized to x's dtype."""
    q, scale = layer.int8_weight, layer.int8_scale
    lead, k = x.shape[:-1], x.shape[-1]
    if not dynamic_activations and input_scale is None:
        tiles = [F.linear(x, (q[i:i + TILE_ROWS].float() * scale[i:i + TILE_ROWS, None]).to(x.dtype))
                 for i in range(0, q.shape[0], TILE_ROWS)]
        y = tiles[0] if len(tiles) == 1 else torch.cat(tiles, dim=-1)
        return y + bias if bias is not None else y
    rows = x.reshape(-1, k).float()
    if input_scale is not None:
        s = input_scale.float().reshape(())
        xq = torch.round(rows / s).clamp_(-128, 127).to(torch.int8)
        y = torch._int_mm(xq, q.t()).float().mul_(scale).mul_(s)
        y = y + bias.float() if bias is not None else y
    else:
        y = int8_matmul_per_token(rows, q.t(), scale, None, 0, None if bias is None else bias.float(), kernels)
    return y.to(x.dtype).reshape(*lead, q.shape[0])


class Int8Quantization(UnquantizedLinearMethod):
    """quantization="int8": every linear layer's float weight quantized at load to int8 per
    output channel; dynamic per-token int8 activations; int8 GEMMs. The LM head stays in float
    (as with vLLM's run-time methods)."""
    name = "int8"

    @classmethod
    def available(cls) -> Optional[str]:
        return None if hasattr(torch, "_int_mm") else "this torch has no torch._int_mm"

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        q_t, scale = quantize_int8_per_channel(layer.weight.detach().float())     # q as [K, N] view
        keep_int8(layer, q_t.t(), scale)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
        return int8_linear(layer, x, bias, kernels=self.kernels)

    def weight_form(self, layer: nn.Module, form: type[FormT]) -> Optional[FormT]:
        """Int8Channels: int8 [N, K] and float32 scales [N] (w = scale[n] * q[n, k]), what a
        platform's fused step multiplies by (the cpu platform's S8)."""
        q = getattr(layer, "int8_weight", None)
        return Int8Channels(q, layer.int8_scale) if form is Int8Channels and q is not None else None

    def experts_method(self) -> Optional[ExpertsMethod]:
        """Mixture-of-experts layers: their experts in int8 per output row too (Int8Experts)."""
        return Int8Experts()


class Int8Experts(ExpertsMethod):
    """quantization="int8" on experts (cpu_int4.py's notes on experts): each expert's rows in int8
    with one scale per output row, as Int8Quantization's linear layers; no float copy kept."""
    name = "int8"
    resident = False

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        layer.int8_experts = None
        if not experts_fit(layer):
            return
        kept = {}
        for name in ("w13", "w2"):
            param = getattr(layer, name)
            num, n, k = param.shape
            q_t, scale = quantize_int8_per_channel(param.detach().float().reshape(num * n, k))
            kept[name] = Int8Channels(q_t.t().contiguous(), scale)
        layer.int8_experts = kept
        drop_dense_experts(layer)

    def forms(self, layer: nn.Module) -> Optional[ExpertForms]:
        kept = getattr(layer, "int8_experts", None)
        return None if kept is None else ExpertForms(kept["w13"], kept["w2"])

    def weights(self, layer: nn.Module, experts: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
        kept = getattr(layer, "int8_experts", None)
        if kept is None:
            return super().weights(layer, experts)
        out = []
        for name in ("w13", "w2"):
            param = getattr(layer, name)
            q, scale = kept[name].q, kept[name].scale
            q, scale = q.reshape(param.shape), scale.reshape(param.shape[:2])
            if experts is not None:
                q, scale = q[experts], scale[experts]
            out.append((q.float() * scale.unsqueeze(-1)).to(param.dtype))
        return out[0], out[1]
