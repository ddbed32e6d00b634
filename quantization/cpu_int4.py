"""quantization="int4" (the cpu platform's run-time mode): 4-bit weight groups for every linear
layer, an int8 LM head, int8 x int8 GEMMs for batches.

Weights load dense (from any checkpoint); process_weights_after_loading quantizes them. The
native int8 quantize/dequantize ends are optional kernels the platform hands over
(`use_kernels`: "quantize_rows_int8", "dequantize_int32"); without them the same numerics run as
torch ops. Only torch ops otherwise (aten int4/int8 CPU kernels), no device API.
"""
from __future__ import annotations

from typing import Any, NamedTuple, Optional

import torch
import torch.nn.functional as F
from torch import nn

from .interface import (AffineGroups, ExpertForms, ExpertsMethod, FormT, Int8Channels, PlatformPacked,
                        QuantKernels, WeightForm)
from .unquantized import UnquantizedLinearMethod



class _Int4State(NamedTuple):
    packed: torch.Tensor              # torch's int4 pack of q
    scale_and_zero: torch.Tensor      # bf16 [K/G, N, 2]
    int8_weight: Optional[torch.Tensor]   # [K, N] for torch._int_mm; None when `batch` holds them
    channel_scale: torch.Tensor       # float32 [N]
    nibbles: torch.Tensor             # q as uint8 [N, K/2], two per byte (even k low): affine_groups
    batch: Any = None                 # the platform's packed int8 weights ("pack_s8"), or None


class _Int8HeadState(NamedTuple):
    int8_weight: Optional[torch.Tensor]
    channel_scale: Optional[torch.Tensor]
    by_channel: Optional[torch.Tensor]    # the weight stored [K, N], viewed [N, K]
    batch: Any = None                     # or the platform's packed int8 weights ("pack_s8")


class CpuInt4Quantization(UnquantizedLinearMethod):
    """4-bit weights in groups of 32 along the input dimension (the layout of GGUF's Q4_0/Q4_1),
    asymmetric: w = scale * q + low, q in 0..15.

    Round-to-nearest from each group's min and max. On a Q4_0/Q4_1 checkpoint this recovers the
    stored grid exactly (llama.cpp's quantizer puts the group's min at q=0 and its max at q=15).

    Two execution paths over those weights, picked by the number of rows (tokens) in the batch:
    * fewer than `small_batch_rows`: bound by reading weights, which stay packed two per byte
      (53 MB for SmolLM2-135M's 30 layers instead of 425 MB in fp32, and they fit in L3):
      torch's int4 CPU kernel, bf16 activations and bf16 scale/zero point; several times less
      time than fp32 over the 30 layers. (A native float32 GEMV of ours was faster in isolation
      but slower on W2 in the engine, so it was dropped.)
    * more (decode batches and prefill): bound by multiply-adds. The 4-bit values re-expressed
      as int8 with one scale per output channel (error below 1/16 of a 4-bit step), activations
      quantized to int8 with one scale per token and their 16 largest channels kept in float32
      (int8_matmul_per_token), int8 x int8 -> int32 GEMM (VNNI: four times fp32's multiply-adds
      per instruction; torch._int_mm). llama.cpp likewise multiplies
      its 4-bit weights by 8-bit activations. Perplexity of SmolLM2-135M on 808 tokens of
      English: 66.34 fp32, 66.84 this way.
    The parameter is overwritten with the dequantized 4-bit values (what a float32 fallback uses).
    Where the platform hands over "pack_s8" / "matmul_s8" (the cpu platform with AVX512-VNNI),
    batches instead run its native int8 matmul over the same int8 per-channel weights, with the
    activations quantized per 32 inputs (no outlier channels needed: a group's scale follows its
    own largest value), one call instead of quantize + GEMM + dequantize.
    """
    name = "int4"
    group_size = 32

    def __init__(self, small_batch_rows: int = 8, outlier_channels: int = 16) -> None:
        super().__init__()
        self.small_batch_rows = small_batch_rows
        self.outlier_channels = outlier_channels

    @classmethod
    def available(cls) -> Optional[str]:
        for op in ("_weight_int4pack_mm_for_cpu", "_convert_weight_to_int4pack_for_cpu", "_int_mm"):
            if not hasattr(torch.ops.aten, op):
                return f"this torch has no aten.{op}"
        return None

    @classmethod
    def fits(cls, weight: torch.Tensor) -> bool:
        """The packed format wants whole groups along K and output rows in multiples of 16."""
        return weight.dim() == 2 and weight.shape[1] % cls.group_size == 0 and weight.shape[0] % 16 == 0

    @classmethod
    def quantize(cls, weight: torch.Tensor, bf16_params: bool = False
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """weight [N, K] -> (q int32 [N, K] in 0..15, scale [N, K/G], low [N, K/G]) with
        w ~ scale * q + low. `bf16_params`: scale and the zero point (low + 8 * scale) exactly
        representable in bf16, as torch's int4 kernel stores them."""
        n, k = weight.shape
        groups = weight.detach().float().reshape(n, k // cls.group_size, cls.group_size)
        low = groups.amin(dim=-1)
        scale = (groups.amax(dim=-1) - low) / 15
        if bf16_params:
            scale = scale.to(torch.bfloat16).float()
            low = (low + 8 * scale).to(torch.bfloat16).float() - 8 * scale
        safe = torch.where(scale > 0, scale, torch.ones_like(scale))
        q = torch.round((groups - low.unsqueeze(-1)) / safe.unsqueeze(-1)).clamp_(0, 15)
        return q.reshape(n, k).to(torch.int32), scale, low

    @classmethod
    def dequantize(cls, q: torch.Tensor, scale: torch.Tensor, low: torch.Tensor) -> torch.Tensor:
        n, k = q.shape
        groups = q.reshape(n, k // cls.group_size, cls.group_size).float()
        return (groups * scale.unsqueeze(-1) + low.unsqueeze(-1)).reshape(n, k)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        weight = layer.weight
        if weight.device.type != "cpu":
            raise ValueError("int4 weight-only linear runs on CPU tensors only")
        layer.int4_state = None
        if not self.fits(weight):
            return                      # stays dense
        q, scale, low = self.quantize(weight, bf16_params=True)
        values = self.dequantize(q, scale, low).to(weight.dtype)
        # Stored [K, N]: the outlier path reads whole input channels (rows of this), and F.linear
        # takes the transposed view as it is. The parameter keeps its shape, as that view.
        weight.data = values.t().contiguous().t()
        # torch's kernel computes (q - 8) * scale + zero.
        scale_and_zero = torch.stack((scale.t(), (low + 8 * scale).t()), dim=-1).to(torch.bfloat16).contiguous()
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
        q8 = q.to(torch.uint8)
        nibbles = q8[:, 0::2] | (q8[:, 1::2] << 4)
        int8_weight, channel_scale = quantize_int8_per_channel(values)
        pack = self.kernels.pack_s8
        batch = pack(int8_weight.t(), channel_scale) if pack is not None else None
        layer.int4_state = _Int4State(packed, scale_and_zero, None if batch is not None else int8_weight,
                                      channel_scale, nibbles, batch)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
        state: Optional[_Int4State] = layer.int4_state
        if state is None or x.dim() != 2 or x.dtype != torch.float32:
            return F.linear(x, layer.weight, bias)
        if x.shape[0] >= self.small_batch_rows:
            if state.batch is not None:
                return self.kernels.matmul_s8(x, state.batch, bias)
            return int8_matmul_per_token(x, state.int8_weight, state.channel_scale, layer.weight,
                                         self.outlier_channels, bias, self.kernels)
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(x.to(torch.bfloat16), state.packed, self.group_size,
                                                       state.scale_and_zero).to(x.dtype)
        return y + bias if bias is not None else y

    def weight_form(self, layer: nn.Module, form: type[FormT]) -> Optional[FormT]:
        """AffineGroups: the 4-bit grid `apply` uses (q from the kept nibbles, scale and low from
        torch's bf16 scale / zero point, zero = low + 8 * scale). Int8Channels: the int8 weights
        batches multiply by (when not packed by the platform). PlatformPacked: the platform's
        pack_s8 parts batches multiply by. None for a layer kept dense."""
        state: Optional[_Int4State] = getattr(layer, "int4_state", None)
        if state is None:
            return None
        if form is AffineGroups:
            scale = state.scale_and_zero[..., 0].float().t().contiguous()         # [N, K/G]
            low = (state.scale_and_zero[..., 1].float().t() - 8 * scale).contiguous()
            q = torch.stack((state.nibbles & 0x0F, state.nibbles >> 4), dim=-1).reshape(state.nibbles.shape[0], -1)
            return AffineGroups(q, scale, low, self.group_size)
        if form is Int8Channels and state.int8_weight is not None:
            return Int8Channels(state.int8_weight.t(), state.channel_scale)
        if form is PlatformPacked and state.batch is not None:
            return PlatformPacked(state.batch)
        return None

    def experts_method(self) -> Optional[ExpertsMethod]:
        """Mixture-of-experts layers: their experts in 4-bit groups too (Int4Experts)."""
        return Int4Experts()

    def lm_head_method(self) -> "Int8HeadMethod":
        head = Int8HeadMethod(self.outlier_channels)
        head.use_kernels(self.kernels)
        return head


class Int8HeadMethod(UnquantizedLinearMethod):
    """The LM head under quantization="int4". GGUF files usually store it (or the tied embedding)
    in 8 bits, so 4 bits would visibly change it: int8 per output channel instead, times int8
    per-token activations with the outlier channels in float32 (int8_matmul_per_token). That
    reads 28 MB per step instead of 113 MB (fp32) or 57 MB (bf16) for SmolLM2's 49152 x 576
    head, and at one row the head is bound by those bytes; at 64 rows it is the largest single
    matmul of a decode step. The weight itself (shared with the
    embedding) is left as loaded."""
    name = "int8_head"

    def __init__(self, outlier_channels: int = 16) -> None:
        super().__init__()
        self.outlier_channels = outlier_channels

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        weight = layer.weight.detach().float()
        int8_weight, channel_scale = quantize_int8_per_channel(weight)
        pack = self.kernels.pack_s8
        batch = pack(int8_weight.t(), channel_scale) if pack is not None else None
        if batch is not None:         # the native matmul needs neither the int8 [K, N] nor a float copy
            layer.int8_head_state = _Int8HeadState(None, None, None, batch)
            return
        # A [K, N] copy (as a transposed view) so outlier channels are contiguous rows; the
        # weight itself stays [N, K] for the embedding it is tied to.
        layer.int8_head_state = _Int8HeadState(int8_weight, channel_scale, weight.t().contiguous().t())

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
        if x.dim() != 2 or x.dtype != torch.float32:
            return F.linear(x, layer.weight, bias)
        state: _Int8HeadState = layer.int8_head_state
        if state.batch is not None:
            return self.kernels.matmul_s8(x, state.batch, bias)
        return int8_matmul_per_token(x, state.int8_weight, state.channel_scale, state.by_channel,
                                     self.outlier_channels, bias, self.kernels)


def quantize_int8_per_channel(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [N, K] float -> (int8 [K, N] ready for torch._int_mm, float32 scale [N])."""
    scale = weight.abs().amax(dim=1).clamp_(min=1e-12) / 127
    q = torch.round(weight / scale.unsqueeze(1)).clamp_(-127, 127).to(torch.int8)
    return q.t(), scale.float()


def int8_matmul_per_token(x: torch.Tensor, int8_weight: torch.Tensor, channel_scale: torch.Tensor,
                          weight: Optional[torch.Tensor] = None, outlier_channels: int = 0,
                          bias: Optional[torch.Tensor] = None, kernels: Optional[QuantKernels] = None) -> torch.Tensor:
    """x [M, K] float32 quantized to int8 with one scale per row, times int8 [K, N] with one
    scale per column, accumulated in int32 -> float32 [M, N] (+ bias).

    LLM activations carry a few input channels 10-150x larger than the rest (measured on
    SmolLM2); one per-token scale would spend most of the int8 range on them. With `weight`
    ([N, K], ideally stored [K, N]: see CpuInt4Quantization.process_weights_after_loading) and
    `outlier_channels` > 0, the batch's largest input channels are taken out and multiplied in
    float32 (the LLM.int8() decomposition, with a fixed count per call). Measured perplexity on
    SmolLM2-135M: fp32 66.34, per-token int8 alone 69.49, with 16 outlier channels 66.87.

    The quantize and dequantize ends run as one native pass each when `kernels` has
    quantize_rows_int8 and dequantize_int32 (the cpu platform's; the outlier product then
    happens inside the dequantize pass), else as torch ops with the same numerics."""
    if weight is None:
        outlier_channels = 0
    kernels = kernels or QuantKernels()
    quantize_rows, dequantize = kernels.quantize_rows_int8, kernels.dequantize_int32
    if quantize_rows is not None and dequantize is not None:
        q, token_scale, channels, values = quantize_rows(x, outlier_channels)
        outliers = (values, weight.t().index_select(0, channels)) if channels.numel() else None
        return dequantize(torch._int_mm(q, int8_weight), token_scale, channel_scale, None, bias, outliers=outliers)
    extra = None
    if outlier_channels > 0:
        channels = x.abs().amax(dim=0).topk(min(outlier_channels, x.shape[1])).indices
        extra = torch.matmul(x.index_select(1, channels), weight.t().index_select(0, channels))
        x = x.index_fill(1, channels, 0.0)
    token_scale = x.abs().amax(dim=1, keepdim=True).clamp_(min=1e-12).div_(127)
    q = torch.div(x, token_scale).round_().clamp_(-127, 127).to(torch.int8)
    y = torch.mul(torch._int_mm(q, int8_weight), channel_scale).mul_(token_scale)
    if extra is not None:
        y.add_(extra)
    return y + bias if bias is not None else y


# ---- Mixture-of-experts layers ---------------------------------------------------------------
# Their stacked experts (w13 [E, 2I, H], w2 [E, H, I]) load dense like any checkpoint's; once loaded
# each matrix is quantized row by row over all its experts at once and only the quantized form is
# kept (the parameters become one-element placeholders of their shape: no float copy of the
# experts, the bulk of a MoE model): a platform's moe kernel packs it (ExpertsMethod.forms), and
# the torch op, where no kernel runs the layer, multiplies it dequantized per call (`weights`). A
# matrix outside the blocks (rows not a multiple of 16, inputs not of 32) leaves both dense, as
# such a linear layer stays dense.


def experts_fit(layer: nn.Module) -> bool:
    return all(p.shape[1] % 16 == 0 and p.shape[2] % 32 == 0 for p in (layer.w13, layer.w2))


def drop_dense_experts(layer: nn.Module) -> None:
    """Replace `w13` / `w2` by placeholders of their shape and dtype over one element of storage."""
    for name in ("w13", "w2"):
        old = getattr(layer, name)
        setattr(layer, name, nn.Parameter(torch.zeros(1, dtype=old.dtype).expand(old.shape), requires_grad=False))


class _Int4Matrix(NamedTuple):
    nibbles: torch.Tensor     # uint8 [E * N, K / 2]: input 2i in the low nibble
    scale: torch.Tensor       # float32 [E * N, K / 32], float16 values
    low: torch.Tensor


def quantize_int4_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """weight [R, K] -> (q uint8 [R, K] in 0..15, scale, low float32 [R, K / 32]) with
    w ~ scale * q + low, scale and low float16 values (what the cpu platform's Q4 layout stores,
    so its kernel and the torch path multiply the same weights)."""
    rows, k = weight.shape
    g = CpuInt4Quantization.group_size
    _, scale, low = CpuInt4Quantization.quantize(weight)
    scale, low = scale.half().float(), low.half().float()
    groups = weight.detach().float().reshape(rows, k // g, g)
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round((groups - low.unsqueeze(-1)) / safe.unsqueeze(-1)).clamp_(0, 15)
    return q.reshape(rows, k).to(torch.uint8), scale, low


class Int4Experts(ExpertsMethod):
    """quantization="int4" on experts: CpuInt4Quantization's grid (4-bit groups of 32, from each
    group's min and max), scale and low rounded to float16."""
    name = "int4"
    resident = False

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        layer.int4_experts = None
        if not experts_fit(layer):
            return
        kept = {}
        for name in ("w13", "w2"):
            param = getattr(layer, name)
            num, n, k = param.shape
            q, scale, low = quantize_int4_rows(param.detach().reshape(num * n, k))
            kept[name] = _Int4Matrix(q[:, 0::2] | (q[:, 1::2] << 4), scale, low)
        layer.int4_experts = kept
        drop_dense_experts(layer)

    def forms(self, layer: nn.Module) -> Optional[ExpertForms]:
        kept = getattr(layer, "int4_experts", None)
        if kept is None:
            return None

        def form(m: _Int4Matrix) -> WeightForm:
            q = torch.stack((m.nibbles & 0x0F, m.nibbles >> 4), dim=-1).reshape(m.nibbles.shape[0], -1)
            return AffineGroups(q, m.scale, m.low, CpuInt4Quantization.group_size)
        return ExpertForms(form(kept["w13"]), form(kept["w2"]))

    def weights(self, layer: nn.Module, experts: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
        kept = getattr(layer, "int4_experts", None)
        if kept is None:
            return super().weights(layer, experts)
        out = []
        for name in ("w13", "w2"):
            param, m = getattr(layer, name), kept[name]
            num, n, k = param.shape
            nibbles, scale, low = (t.reshape(num, n, -1) for t in (m.nibbles, m.scale, m.low))
            if experts is not None:
                nibbles, scale, low = nibbles[experts], scale[experts], low[experts]
            q = torch.stack((nibbles & 0x0F, nibbles >> 4), dim=-1).reshape(-1, k)
            values = CpuInt4Quantization.dequantize(q, scale.reshape(q.shape[0], -1), low.reshape(q.shape[0], -1))
            out.append(values.reshape(-1, n, k).to(param.dtype))
        return out[0], out[1]
