"""CPU matmul kernels the cpu platform swaps into every Linear / LMHead after loading.

The default is plain `F.linear`. A kernel may re-lay out the weight once (`prepare`) and then
run each matmul on that form. Chosen by the platform (see `apply_linear_kernel`), never here.
"""
from __future__ import annotations

from typing import Any, Optional

import torch
from torch import nn


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


def apply_linear_kernel(model: nn.Module, kernel: LinearKernel, include_lm_head: bool = True) -> int:
    """Switch every Linear (and, unless told otherwise, the LMHead) of `model` to `kernel`;
    returns how many were switched."""
    from tokenmill.core.layers.embedding import LMHead

    reason = kernel.available()
    if reason:
        raise ValueError(f"linear kernel {kernel.name!r} cannot run here: {reason}")
    count = 0
    for module in model.modules():
        use = getattr(module, "use_kernel", None)
        if use is not None and (include_lm_head or not isinstance(module, LMHead)):
            use(kernel)
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


class Int4WeightLinear(LinearKernel):
    """Weight-only 4-bit quantization in groups of 32 along the input dimension (the layout of
    GGUF's Q4_0/Q4_1), asymmetric: w = (q - 8) * scale + zero, q in 0..15.

    Round-to-nearest from each group's min and max. On a Q4_0/Q4_1 checkpoint this recovers the
    stored grid (llama.cpp's quantizer puts the group's min at q=0 and its max at q=15), so the
    only change from the dequantized file is bf16 rounding of the scales and of the matmul input.

    Small batches are bound by reading weights: they run torch's int4 CPU kernel on the packed
    nibbles (bf16 activations), ~3.5x less time than fp32 GEMV for SmolLM2-135M's 30 layers
    (53 MB instead of 425 MB, which also fits in L3). Large batches are bound by FLOPs, where
    that kernel is slower than oneDNN's fp32 GEMM (crossover measured at ~24 rows), so they
    multiply the dequantized values in the activation dtype. The parameter is overwritten with
    the dequantized values: both paths use the same weights.
    """
    name = "int4_weights"
    group_size = 32

    def __init__(self, small_batch_rows: int = 24) -> None:
        self.small_batch_rows = small_batch_rows

    @classmethod
    def available(cls) -> Optional[str]:
        if not hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu"):
            return "this torch has no aten._weight_int4pack_mm_for_cpu"
        return None

    @classmethod
    def fits(cls, weight: torch.Tensor) -> bool:
        """The packed format wants whole groups along K and output rows in multiples of 16."""
        return weight.dim() == 2 and weight.shape[1] % cls.group_size == 0 and weight.shape[0] % 16 == 0

    @classmethod
    def quantize(cls, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """weight [N, K] -> (q int32 [N, K] in 0..15, scale_and_zero bf16 [K/G, N, 2])."""
        n, k = weight.shape
        groups = weight.detach().float().reshape(n, k // cls.group_size, cls.group_size)
        low = groups.amin(dim=-1)
        high = groups.amax(dim=-1)
        scale = ((high - low) / 15).to(torch.bfloat16).float()
        zero = (low + 8 * scale).to(torch.bfloat16).float()
        safe = torch.where(scale > 0, scale, torch.ones_like(scale))
        q = torch.round((groups - (zero - 8 * scale).unsqueeze(-1)) / safe.unsqueeze(-1)).clamp_(0, 15)
        q = torch.where((scale > 0).unsqueeze(-1), q, torch.full_like(q, 8))
        scale_and_zero = torch.stack((scale.t(), zero.t()), dim=-1).to(torch.bfloat16).contiguous()
        return q.reshape(n, k).to(torch.int32), scale_and_zero

    @classmethod
    def dequantize(cls, q: torch.Tensor, scale_and_zero: torch.Tensor) -> torch.Tensor:
        n, k = q.shape
        scale = scale_and_zero[..., 0].float().t().unsqueeze(-1)          # [N, K/G, 1]
        zero = scale_and_zero[..., 1].float().t().unsqueeze(-1)
        groups = q.reshape(n, k // cls.group_size, cls.group_size).float()
        return ((groups - 8) * scale + zero).reshape(n, k)

    def prepare(self, weight: torch.Tensor) -> Any:
        if weight.device.type != "cpu":
            raise ValueError("int4 weight-only linear runs on CPU tensors only")
        if not self.fits(weight):
            return None, None, weight
        q, scale_and_zero = self.quantize(weight)
        weight.data.copy_(self.dequantize(q, scale_and_zero).to(weight.dtype))
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
        return packed, scale_and_zero, weight

    def __call__(self, x, prepared, bias):
        packed, scale_and_zero, weight = prepared
        if packed is None or x.dim() != 2 or x.shape[0] >= self.small_batch_rows:
            return torch.nn.functional.linear(x, weight, bias)
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(x.to(torch.bfloat16), packed, self.group_size,
                                                       scale_and_zero).to(x.dtype)
        return y + bias if bias is not None else y
