"""The cpu platform's mixture-of-experts kernel ("moe" layer kernel, core/layers/moe.py's op): one
native call per layer (platforms/csrc/cpu_decode_step.cpp fused_moe) over the fused decode step's
weight layouts — bf16 pairs (dtype=bfloat16), 4-bit groups times int8 activations (Q4, the int4
method's experts), int8 per-channel weights (S8, the int8 method's experts), and GGUF blocks kept
as stored (quantization="gguf": Q4_0/Q4_1/Q8_0/Q4_K/Q6_K experts as platforms/cpu_gguf_kernels.py
packs them).

The call sorts the (token, slot) pairs by expert, gathers each expert's rows together, and runs
the gate/up matmul of every active expert, the activation, the down matmul, then each token's
weighted sum in increasing expert order (moe_reference's order). Each active expert's weights are
read once per call however many tokens picked it, and the work is shared among the threads by
(expert, 64 output rows) items, so a one-token step keeps both cores on the weight stream.

The kernel packs a layer's experts once (`prepare`, when the layer takes the kernel) from its
dense weights (bf16) or the quantized forms its experts method keeps (quantization/interface.py ExpertsMethod.forms).
Expert biases and GPT-OSS's clamped SwiGLU are taken too. Inputs it does not take (other
activations or arguments, shapes outside the 16-row / 32-input blocks, float32 weights it was not
told to round) return NotImplemented: the layer runs moe_reference.
"""
from __future__ import annotations

import ctypes
from typing import Any, NamedTuple, Optional

import torch

from tokenmill.quantization.interface import AffineGroups, ExpertForms, Int8Channels, PlatformPacked, WeightForm

from . import cpu_decode_kernels as native

ACTIVATIONS = {"silu": 0, "gelu_tanh": 1, "gelu": 2, "relu": 3, "swiglu_oai": 4}
MAX_TOP_K = 64          # fused_moe's per-token slot buffer


class NativeMoeLayer(ctypes.Structure):
    """platforms/csrc/cpu_decode_step.cpp FusedMoeLayer."""
    _fields_ = [("num_experts", ctypes.c_int64), ("hidden", ctypes.c_int64), ("inter", ctypes.c_int64),
                ("activation", ctypes.c_int64), ("w13", ctypes.POINTER(native.NativeLinear)),
                ("w2", ctypes.POINTER(native.NativeLinear)), ("b13", ctypes.c_void_p), ("b2", ctypes.c_void_p),
                ("alpha", ctypes.c_float), ("limit", ctypes.c_float)]


class PreparedMoe(NamedTuple):
    """A layer's experts packed for fused_moe: one NativeLinear per expert and matrix, pointing into
    `tensors` (kept alive here); `weight_format` "bf16", "q4" or "s8"."""
    w13: Any
    w2: Any
    tensors: tuple[torch.Tensor, ...]
    weight_format: str


def _library() -> ctypes.CDLL:
    lib = native.LIBRARY.require()
    if lib.fused_moe.restype is not ctypes.c_int64:
        lib.fused_moe.restype = ctypes.c_int64
        lib.fused_moe.argtypes = [ctypes.POINTER(NativeMoeLayer), ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64,
                                  ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
    return lib


def _per_expert(kind: int, n: int, k: int, num: int, parts: tuple[torch.Tensor, ...]) -> Any:
    """One NativeLinear per expert over stacked packed parts (each part's leading dimension runs
    over the experts' row blocks, so expert e's share is the e-th of `num` equal slices)."""
    linears = (native.NativeLinear * num)()
    for e in range(num):
        ptrs = [part.reshape(num, -1)[e].data_ptr() for part in parts] + [None] * (3 - len(parts))
        linears[e] = native.NativeLinear(kind=kind, n=n, k=k, weight=ptrs[0], scales=ptrs[1], lows=ptrs[2], bias=None)
    return linears


def _pack(weight: torch.Tensor, form: Optional[WeightForm]) -> Optional[tuple[str, Any, tuple[torch.Tensor, ...]]]:
    """One stacked matrix [E, N, K] -> (format, per-expert linears, tensors), None if it does not fit."""
    num, n, k = weight.shape
    if n % native.ROWS or k % 32:
        return None
    if isinstance(form, AffineGroups):
        if form.group_size != 32:
            return None
        parts = native.pack_q4(form.q.reshape(num * n, k), form.scale.reshape(num * n, -1),
                               form.low.reshape(num * n, -1))
        return "q4", _per_expert(native.Q4, n, k, num, parts), parts
    if isinstance(form, Int8Channels):
        parts = native.pack_s8(form.q.reshape(num * n, k), form.scale.reshape(num * n))
        return "s8", _per_expert(native.S8, n, k, num, parts), parts
    if isinstance(form, PlatformPacked):
        # GGUF blocks kept (quantization="gguf"): one PackedGroups per expert, as the platform's
        # gguf kernels packed them (any of the quantized kinds; they all read int8 activations).
        experts = list(form.parts)
        if len(experts) != num or any(p.n != n or p.k != k or p.kind == native.BF16 for p in experts):
            return None
        linears = (native.NativeLinear * num)()
        for e, packed in enumerate(experts):
            linears[e] = packed.linear
        return "gguf", linears, tuple(t for p in experts for t in p.tensors)
    if form is not None or weight.dtype != torch.bfloat16:
        return None
    packed = native.pack_bf16(weight.detach().reshape(num * n, k))
    return "bf16", _per_expert(native.BF16, n, k, num, (packed,)), (packed,)


class NativeMoe:
    """The "moe" layer kernel. `round_weights`: float32 expert weights are rounded to bf16 in place
    when packed (the platform's bf16-weight mode with float32 activations, as Bf16WeightLinear
    rounds the dense layers), so the torch path multiplies the same values."""
    name = "native_moe"

    def __init__(self, round_weights: bool = False) -> None:
        self.round_weights = round_weights

    @staticmethod
    def available(weight_format: str = "q4") -> Optional[str]:
        """None when fused_moe runs `weight_format` here ("bf16" needs AVX512-BF16), else why not."""
        lib, why = native.LIBRARY.load()
        if lib is None:
            return why
        if not hasattr(lib, "fused_moe"):
            return "the native decode library has no fused_moe"
        need, what = (2, "AVX512-BF16") if weight_format == "bf16" else (1, "AVX512-VNNI")
        return None if lib.fused_decode_caps() & need else f"this CPU has no {what}"

    def prepare(self, w13: torch.Tensor, w2: torch.Tensor, forms: Optional[ExpertForms]) -> Optional[PreparedMoe]:
        """The layer's experts packed once (after loading and the experts method's processing)."""
        form13, form2 = (forms.w13, forms.w2) if forms is not None else (None, None)
        if form13 is None and form2 is None:
            if self.round_weights and w13.dtype == torch.float32:
                for param in (w13, w2):
                    param.data.copy_(param.data.to(torch.bfloat16).float())
                w13, w2 = w13.data.to(torch.bfloat16), w2.data.to(torch.bfloat16)
            if self.available("bf16") is not None:
                return None
        elif self.available("q4") is not None:
            return None
        up, down = _pack(w13, form13), _pack(w2, form2)
        if up is None or down is None:
            return None
        return PreparedMoe(up[1], down[1], up[2] + down[2], up[0] if up[0] == down[0] else f"{up[0]}+{down[0]}")

    def __call__(self, hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                 topk_ids: torch.Tensor, activation: str = "silu", prepared: Optional[PreparedMoe] = None, *,
                 w13_bias: Optional[torch.Tensor] = None, w2_bias: Optional[torch.Tensor] = None,
                 swiglu_alpha: float = 1.702, swiglu_limit: float = 7.0, **extra: Any) -> Any:
        """moe_reference's op on the packed experts (expert biases and "swiglu_oai" included);
        NotImplemented for what it does not take."""
        if (prepared is None or activation not in ACTIVATIONS or extra
                or hidden.dim() != 2 or hidden.dtype not in (torch.float32, torch.bfloat16)
                or topk_ids.dim() != 2 or topk_ids.shape[1] > MAX_TOP_K or topk_ids.shape[0] != hidden.shape[0]):
            return NotImplemented
        tokens, size = hidden.shape
        num, inter = w13.shape[0], w2.shape[2]
        if size != w13.shape[2] or w13.shape[1] != 2 * inter:
            return NotImplemented
        b13 = w13_bias.float().contiguous() if w13_bias is not None else None      # kept alive for the call
        b2 = w2_bias.float().contiguous() if w2_bias is not None else None
        if (b13 is not None and b13.shape != (num, 2 * inter)) or (b2 is not None and b2.shape != (num, size)):
            return NotImplemented
        x = hidden.float().contiguous()
        ids = topk_ids.to(torch.int64).contiguous()
        weights = topk_weights.float().contiguous()
        out = torch.empty((tokens, size), dtype=torch.float32)
        layer = NativeMoeLayer(num_experts=num, hidden=size, inter=inter, activation=ACTIVATIONS[activation],
                               w13=prepared.w13, w2=prepared.w2, b13=b13.data_ptr() if b13 is not None else None,
                               b2=b2.data_ptr() if b2 is not None else None, alpha=swiglu_alpha, limit=swiglu_limit)
        if _library().fused_moe(ctypes.byref(layer), x.data_ptr(), tokens, ids.shape[1], ids.data_ptr(),
                                weights.data_ptr(), out.data_ptr()):
            raise ValueError(f"topk_ids: an expert id outside [0, {num})")
        return out if hidden.dtype == torch.float32 else out.to(hidden.dtype)


def moe_kernel(quantization: Optional[str], dtype: str, round_weights: bool = False) -> Optional[NativeMoe]:
    """The kernel for a model run with `quantization` and `dtype` (canonical names), where its experts
    come in a form fused_moe multiplies: int4 / int8 experts (Q4 / S8), GGUF blocks kept (the gguf
    kernels' packed experts), bf16 weights (`round_weights`:
    float32 parameters the dense layers' kernel rounds to bf16 too). None elsewhere (float32 weights
    keep moe_reference: exact parity with transformers is promised there)."""
    if quantization in ("int4", "int8", "gguf"):
        return NativeMoe() if NativeMoe.available("q4") is None else None
    if quantization is None and dtype == "bfloat16" and NativeMoe.available("bf16") is None:
        return NativeMoe(round_weights=round_weights)
    return None
