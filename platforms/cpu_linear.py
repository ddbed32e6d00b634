"""CPU matmul kernels the cpu platform swaps into every Linear / LMHead after loading.

The default is plain `F.linear`. A kernel may re-lay out the weight once (`prepare`) and then
run each matmul on that form. Chosen by the platform (see `apply_linear_kernel`), never here.
"""
from __future__ import annotations

from typing import Any, Optional

import torch
from torch import nn

from . import cpu_kernels


class LinearKernel:
    name = "default"

    @classmethod
    def available(cls) -> Optional[str]:
        """None when usable here, else why not."""
        return None

    def prepare(self, weight: torch.Tensor) -> Any:
        return weight

    def __call__(self, x: torch.Tensor, prepared: Any, bias: Optional[torch.Tensor]) -> torch.Tensor:
        return torch.nn.functional.linear(x, prepared, bias)


class MkldnnPackedLinear(LinearKernel):
    """oneDNN with the weight pre-packed into its blocked layout (what inductor's CPU freezing
    does). Measured here: ~1.3-1.7x faster than F.linear for small-batch bf16 decode, and
    bit-identical to F.linear in bf16 (float32 differs only by accumulation order)."""
    name = "mkldnn_packed"

    def __init__(self, batch_hint: int = 1) -> None:
        self.batch_hint = batch_hint   # oneDNN picks the packed layout for this many rows

    @classmethod
    def available(cls) -> Optional[str]:
        if not torch.backends.mkldnn.is_available():
            return "torch was built without oneDNN (mkldnn)"
        if not hasattr(torch.ops.mkldnn, "_reorder_linear_weight"):
            return "this torch has no mkldnn._reorder_linear_weight"
        return None

    def prepare(self, weight: torch.Tensor) -> Any:
        if weight.device.type != "cpu":
            raise ValueError("mkldnn packed linear runs on CPU tensors only")
        return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), self.batch_hint)

    def __call__(self, x, prepared, bias):
        if x.dim() != 2:
            # The packed op wants a matrix; models pass [T, hidden], but stay general.
            shape = x.shape
            return self(x.reshape(-1, shape[-1]), prepared, bias).view(*shape[:-1], -1)
        return torch.ops.mkldnn._linear_pointwise(x, prepared, bias, "none", [], "")


def apply_linear_kernel(model: nn.Module, kernel: LinearKernel, include_linears: bool = True,
                        include_lm_head: bool = True) -> int:
    """Switch the Linears and/or the LMHead of `model` to `kernel`; returns how many were switched."""
    from tokenmill.core.layers.embedding import LMHead
    from tokenmill.core.layers.linear import Linear

    reason = kernel.available()
    if reason:
        raise ValueError(f"linear kernel {kernel.name!r} cannot run here: {reason}")
    targets = ((Linear,) if include_linears else ()) + ((LMHead,) if include_lm_head else ())
    count = 0
    for module in model.modules():
        if isinstance(module, targets):
            module.use_kernel(kernel)
            count += 1
    return count


class Bf16WeightLinear(LinearKernel):
    """bf16 weights, float32 activations. The weight is rounded to bf16 once (the parameter keeps
    those exact values in fp32). Small batches are memory-bound, so they read a packed bf16 copy:
    half the bytes. Large batches are compute-bound, and on CPUs without AMX oneDNN's fp32 GEMM
    beats its bf16 one (274 vs 154 GFLOP/s measured here), so they multiply the same values in fp32."""
    name = "bf16_weights"

    def __init__(self, small_batch_rows: int = 16) -> None:
        self.small_batch_rows = small_batch_rows

    @classmethod
    def available(cls) -> Optional[str]:
        return MkldnnPackedLinear.available()

    def prepare(self, weight: torch.Tensor) -> Any:
        rounded = weight.detach().to(torch.bfloat16)
        weight.data.copy_(rounded.to(weight.dtype))
        return torch.ops.mkldnn._reorder_linear_weight(rounded, 1), weight

    def __call__(self, x, prepared, bias):
        packed, weight = prepared
        if x.dim() == 2 and x.shape[0] < self.small_batch_rows:
            y = torch.ops.mkldnn._linear_pointwise(x.to(torch.bfloat16), packed, None, "none", [], "")
            y = y.to(x.dtype)
            return y + bias if bias is not None else y
        return torch.nn.functional.linear(x, weight, bias)


class Int8HeadLinear(LinearKernel):
    """The LM head under quantization="int4". GGUF files usually store it (or the tied embedding)
    in 8 bits, so 4 bits would visibly change it: int8 per output channel instead, times int8
    per-token activations with the outlier channels in float32 (int8_matmul_per_token). That
    reads 28 MB per step instead of 113 MB (fp32) or 57 MB (bf16): measured for SmolLM2's
    49152 x 576 head at one row, 1.4 ms vs 3.5 ms fp32 and 2.3 ms packed bf16; at 64 rows it
    is the largest single matmul of a decode step. The weight itself (shared with the
    embedding) is left as loaded."""
    name = "int8_head"

    def __init__(self, outlier_channels: int = 16) -> None:
        self.outlier_channels = outlier_channels

    @classmethod
    def available(cls) -> Optional[str]:
        return None if hasattr(torch.ops.aten, "_int_mm") else "this torch has no aten._int_mm"

    def prepare(self, weight: torch.Tensor) -> Any:
        int8_weight, channel_scale = quantize_int8_per_channel(weight.detach().float())
        # A [K, N] copy (as a transposed view) so outlier channels are contiguous rows; the
        # weight itself stays [N, K] for the embedding it is tied to.
        by_channel = weight.detach().float().t().contiguous().t()
        return weight, int8_weight, channel_scale, by_channel

    def __call__(self, x, prepared, bias):
        weight, int8_weight, channel_scale, by_channel = prepared
        if x.dim() == 2 and x.dtype == torch.float32:
            return int8_matmul_per_token(x, int8_weight, channel_scale, by_channel, self.outlier_channels, bias)
        return torch.nn.functional.linear(x, weight, bias)


class Int4WeightLinear(LinearKernel):
    """4-bit weights in groups of 32 along the input dimension (the layout of GGUF's Q4_0/Q4_1),
    asymmetric: w = scale * q + low, q in 0..15.

    Round-to-nearest from each group's min and max. On a Q4_0/Q4_1 checkpoint this recovers the
    stored grid exactly (llama.cpp's quantizer puts the group's min at q=0 and its max at q=15).

    Two execution paths over those weights, picked by the number of rows (tokens) in the batch:
    * fewer than `small_batch_rows`: bound by reading weights, which stay packed two per byte
      (53 MB for SmolLM2-135M's 30 layers instead of 425 MB in fp32, and they fit in L3):
      torch's int4 CPU kernel, bf16 activations and bf16 scale/zero point; ~3.5x less time than
      fp32 over the 30 layers. (A native float32 GEMV of ours measured faster in isolation but
      66 -> 60 tok/s slower on W2 in the engine, so it was dropped.)
    * more (decode batches and prefill): bound by multiply-adds. The 4-bit values re-expressed
      as int8 with one scale per output channel (error below 1/16 of a 4-bit step), activations
      quantized to int8 with one scale per token and their 16 largest channels kept in float32
      (int8_matmul_per_token), int8 x int8 -> int32 GEMM (VNNI): 2.5x less time than fp32 at 64
      rows, 2.7x at 512 (torch._int_mm vs F.linear, measured here). llama.cpp likewise multiplies
      its 4-bit weights by 8-bit activations. Perplexity of SmolLM2-135M on 808 tokens of
      English: 66.34 fp32, 66.84 this way.
    The parameter is overwritten with the dequantized 4-bit values (what a float32 fallback uses).
    """
    name = "int4_weights"
    group_size = 32

    def __init__(self, small_batch_rows: int = 8, outlier_channels: int = 16) -> None:
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

    def prepare(self, weight: torch.Tensor) -> Any:
        if weight.device.type != "cpu":
            raise ValueError("int4 weight-only linear runs on CPU tensors only")
        if not self.fits(weight):
            return None, None, weight, None, None
        q, scale, low = self.quantize(weight, bf16_params=True)
        values = self.dequantize(q, scale, low).to(weight.dtype)
        # Stored [K, N]: the outlier path reads whole input channels (rows of this), and F.linear
        # takes the transposed view as it is. The parameter keeps its shape, as that view.
        weight.data = values.t().contiguous().t()
        # torch's kernel computes (q - 8) * scale + zero.
        scale_and_zero = torch.stack((scale.t(), (low + 8 * scale).t()), dim=-1).to(torch.bfloat16).contiguous()
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
        int8_weight, channel_scale = quantize_int8_per_channel(values)
        return packed, scale_and_zero, weight, int8_weight, channel_scale

    def __call__(self, x, prepared, bias):
        packed, scale_and_zero, weight, int8_weight, channel_scale = prepared
        if packed is None or x.dim() != 2 or x.dtype != torch.float32:
            return torch.nn.functional.linear(x, weight, bias)
        if x.shape[0] >= self.small_batch_rows:
            return int8_matmul_per_token(x, int8_weight, channel_scale, weight, self.outlier_channels, bias)
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(x.to(torch.bfloat16), packed, self.group_size,
                                                       scale_and_zero).to(x.dtype)
        return y + bias if bias is not None else y


def quantize_int8_per_channel(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [N, K] float -> (int8 [K, N] ready for torch._int_mm, float32 scale [N])."""
    scale = weight.abs().amax(dim=1).clamp_(min=1e-12) / 127
    q = torch.round(weight / scale.unsqueeze(1)).clamp_(-127, 127).to(torch.int8)
    return q.t(), scale.float()


def int8_matmul_per_token(x: torch.Tensor, int8_weight: torch.Tensor, channel_scale: torch.Tensor,
                          weight: Optional[torch.Tensor] = None, outlier_channels: int = 0,
                          bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """x [M, K] float32 quantized to int8 with one scale per row, times int8 [K, N] with one
    scale per column, accumulated in int32 -> float32 [M, N] (+ bias).

    LLM activations carry a few input channels 10-150x larger than the rest (measured on
    SmolLM2); one per-token scale would spend most of the int8 range on them. With `weight`
    ([N, K], ideally stored [K, N]: see Int4WeightLinear.prepare) and `outlier_channels` > 0,
    the batch's largest input channels are taken out and multiplied in float32 (the LLM.int8()
    decomposition, with a fixed count per call). Measured perplexity on SmolLM2-135M: fp32 66.34,
    per-token int8 alone 69.49, with 16 outlier channels 66.87.

    The quantize and dequantize ends run as one native pass each (platforms/cpu_kernels.py)
    when that library builds here, else as torch ops with the same numerics."""
    if weight is None:
        outlier_channels = 0
    if cpu_kernels.available() is None:
        q, token_scale, channels, values = cpu_kernels.quantize_rows_int8(x, outlier_channels)
        extra = torch.matmul(values, weight.t().index_select(0, channels)) if channels.numel() else None
        return cpu_kernels.dequantize_int32(torch._int_mm(q, int8_weight), token_scale, channel_scale, extra, bias)
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
