"""CPU matmul kernels for dense weights, which the cpu platform offers the core by name
(`CpuPlatform.layer_kernels`: "linear", "lm_head") and the core swaps into its layers after
loading (core/layers/kernels.py).

The default is plain `F.linear`. A kernel may re-lay out the weight once (`prepare`) and then
run each matmul on that form. (Quantized weights are quantization methods: quantization/.)
"""
from __future__ import annotations

from typing import Any, Optional

import torch


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
    does): faster than F.linear for small-batch bf16 decode, which re-packs the weight every call,
    and bit-identical to F.linear in bf16 (float32 differs only by accumulation order)."""
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


class Bf16WeightLinear(LinearKernel):
    """bf16 weights, float32 activations. The weight is rounded to bf16 once (the parameter keeps
    those exact values in fp32). Small batches are memory-bound, so they read a packed bf16 copy:
    half the bytes. Large batches are compute-bound, and on CPUs without AMX oneDNN's fp32 GEMM
    can beat its bf16 one (bf16_gemm_is_faster), so they multiply the same values in fp32."""
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
