"""The cpu platform's kernels for GGUF weights kept quantized (quantization="gguf",
quantization/gguf_linear.py takes them through `Platform.quantization_kernels("gguf")`).

The stored blocks are repacked once at load into the layouts of the fused decode step's native
matmul (platforms/csrc/cpu_decode_step.cpp `fused_matmul`, any number of tokens), as llama.cpp
repacks Q4_0 for AVX-512:
  * 4-bit affine groups of 32 (GGUF Q4_0, Q4_1, Q4_K): w = scale * q + low, q in 0..15, nibbles
    blocked 16 rows at a time, scale and low fp16. Q4_0 (low = -8 * scale) keeps no lows array,
    so its packed form is exactly the file's 18 bytes per 32 weights.
  * 8-bit symmetric groups of 32 (GGUF Q8_0, and Q6_K re-expressed in 8 bits): w = scale * w8,
    fp16 scales, no stored correction sums (the kernel sums w8 itself): 34 bytes per 32, as the file.
Activations are quantized to int8 per 32 inputs inside the kernel (llama.cpp's Q8 operand).
`dequantize_rows` unpacks chosen rows back to float32 (embedding lookups of a tied head).
"""
from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import Optional

import torch

from .cpu_fused_decode import LIBRARY, Q4, Q8, ROWS, NativeHeadKernel, _Linear, pack_q4


@dataclass(eq=False)
class PackedGroups:
    """One weight in a native layout; `tensors` are all it keeps (the caller registers them)."""
    linear: _Linear
    kind: int
    tensors: tuple[torch.Tensor, ...]
    n: int
    k: int


def available() -> Optional[str]:
    """None when the VNNI matmul builds and runs here, else why not."""
    return NativeHeadKernel.available("q8")


def fits(n: int, k: int) -> bool:
    return n % ROWS == 0 and k % 32 == 0


def pack_affine4(q: torch.Tensor, scale: torch.Tensor, low: Optional[torch.Tensor]) -> PackedGroups:
    """q uint8 [N, K] in 0..15, scale/low float [N, K/32] (low None: -8 * scale, Q4_0)."""
    n, k = q.shape
    nibbles, scales, lows = pack_q4(q, scale, low if low is not None else torch.zeros_like(scale))
    tensors = (nibbles, scales) if low is None else (nibbles, scales, lows)
    linear = _Linear(kind=Q4, n=n, k=k, weight=nibbles.data_ptr(), scales=scales.data_ptr(),
                     lows=lows.data_ptr() if low is not None else None, bias=None)
    return PackedGroups(linear, Q4, tensors, n, k)


def pack_int8_groups(w8: torch.Tensor, scale: torch.Tensor) -> PackedGroups:
    """w8 int8 [N, K], scale float [N, K/32] (exactly fp16-representable for an exact Q8_0)."""
    n, k = w8.shape
    packed = w8.to(torch.int8).reshape(n // ROWS, ROWS, k // 32, 8, 4).permute(0, 2, 3, 1, 4).contiguous()
    scales = scale.reshape(n // ROWS, ROWS, k // 32).permute(0, 2, 1).to(torch.float16).contiguous()
    linear = _Linear(kind=Q8, n=n, k=k, weight=packed.data_ptr(), scales=scales.data_ptr(), lows=None, bias=None)
    return PackedGroups(linear, Q8, (packed, scales), n, k)


def matmul(packed: PackedGroups, x: torch.Tensor) -> torch.Tensor:
    """x [M, K] -> float32 [M, N]."""
    x = x.float().contiguous()
    y = torch.empty((x.shape[0], packed.n), dtype=torch.float32)
    if x.shape[0]:
        LIBRARY.require().fused_matmul(ctypes.byref(packed.linear), x.data_ptr(), x.shape[0], y.data_ptr())
    return y


def dequantize_rows(packed: PackedGroups, rows: torch.Tensor) -> torch.Tensor:
    """The float32 values of weight rows `rows` (int64 [R]) -> [R, K]."""
    block, r = rows.div(ROWS, rounding_mode="floor"), rows.remainder(ROWS)
    groups = packed.k // 32
    if packed.kind == Q4:
        nib = packed.tensors[0][block, :, :, r, :]                    # [R, G, 4 (j), 4 (byte)]
        q = torch.stack((nib & 0x0F, nib >> 4), dim=3).reshape(-1, groups, 32).float()   # j, lo/hi, byte
        scale = packed.tensors[1][block, :, r].float()                # [R, G]
        low = packed.tensors[2][block, :, r].float() if len(packed.tensors) > 2 else -8 * scale
        return (q * scale.unsqueeze(-1) + low.unsqueeze(-1)).reshape(-1, packed.k)
    w8 = packed.tensors[0][block, :, :, r, :].reshape(-1, groups, 32).float()     # [R, G, 8 chunks * 4]
    return (w8 * packed.tensors[1][block, :, r].float().unsqueeze(-1)).reshape(-1, packed.k)
