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
  * Q4_K as its own kind ("pack_q4k"): the nibbles as above, the file's 6-bit scale and min
    codes one byte each per 32 and its fp16 d and dmin per 256 (18.5 bytes per 32 vs the file's
    18): w = d*sc*q - dmin*m, ggml's values exactly.
  * Q6_K as its own kind ("pack_q6k"): low nibbles as above plus the 2 high bits packed 4 to a
    byte, the int8 scale per 16 and fp16 d per 256 (26.25 bytes per 32, the file's):
    w = d * sc * (q - 32), ggml's values exactly.
Activations are quantized to int8 per 32 inputs inside the kernel (llama.cpp's Q8 operand).
`dequantize_rows` unpacks chosen rows back to float32 (embedding lookups of a tied head).
"""
from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import Optional

import torch

from .cpu_decode_kernels import LIBRARY, Q4, Q8, ROWS, NativeHeadKernel, NativeLinear, pack_q4

Q4K, Q6K = 3, 4            # cpu_decode_step.cpp FusedLinear kinds that only fused_matmul takes
SUPER = 256                # K-quant super-block: the kernels' metadata records are per 256 inputs


@dataclass(eq=False)
class PackedGroups:
    """One weight in a native layout; `tensors` are all it keeps (the caller registers them)."""
    linear: NativeLinear
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
    linear = NativeLinear(kind=Q4, n=n, k=k, weight=nibbles.data_ptr(), scales=scales.data_ptr(),
                     lows=lows.data_ptr() if low is not None else None, bias=None)
    return PackedGroups(linear, Q4, tensors, n, k)


def pack_int8_groups(w8: torch.Tensor, scale: torch.Tensor) -> PackedGroups:
    """w8 int8 [N, K], scale float [N, K/32] (exactly fp16-representable for an exact Q8_0)."""
    n, k = w8.shape
    packed = w8.to(torch.int8).reshape(n // ROWS, ROWS, k // 32, 8, 4).permute(0, 2, 3, 1, 4).contiguous()
    scales = scale.reshape(n // ROWS, ROWS, k // 32).permute(0, 2, 1).to(torch.float16).contiguous()
    linear = NativeLinear(kind=Q8, n=n, k=k, weight=packed.data_ptr(), scales=scales.data_ptr(), lows=None, bias=None)
    return PackedGroups(linear, Q8, (packed, scales), n, k)


def _per_block(t: torch.Tensor, per_row: int) -> torch.Tensor:
    """[N, S * per_row] -> bytes [N/16, S, per_row * 16 * itemsize]: for each super-block, field
    j of the 16 rows side by side (one vector load in the kernel)."""
    n = t.shape[0]
    blocked = t.reshape(n // ROWS, ROWS, -1, per_row).permute(0, 2, 3, 1).contiguous()
    return blocked.view(torch.uint8).reshape(n // ROWS, blocked.shape[1], -1)


def _check_k_quant(q: torch.Tensor, name: str) -> tuple[int, int]:
    n, k = q.shape
    if not fits(n, k) or k % SUPER:
        raise ValueError(f"{name}: a [{n}, {k}] weight is not in blocks of {ROWS} rows x {SUPER} inputs")
    return n, k


def pack_q4k(q: torch.Tensor, sc: torch.Tensor, m: torch.Tensor, d: torch.Tensor, dmin: torch.Tensor) -> PackedGroups:
    """Q4_K's fields (quantization/gguf_blocks.py q4k_fields): q uint8 [N, K], sc/m uint8 [N, K/32],
    d/dmin float16 [N, K/256] -> nibbles as Q4 and per (row block, super-block) a 320-byte record
    d[16] | dmin[16] | sc[8][16] | m[8][16]."""
    n, k = _check_k_quant(q, "q")
    nibbles = _nibbles(q)
    record = torch.cat((_per_block(d.to(torch.float16), 1), _per_block(dmin.to(torch.float16), 1),
                        _per_block(sc.to(torch.uint8), 8), _per_block(m.to(torch.uint8), 8)), dim=-1).contiguous()
    linear = NativeLinear(kind=Q4K, n=n, k=k, weight=nibbles.data_ptr(), scales=record.data_ptr(), lows=None, bias=None)
    return PackedGroups(linear, Q4K, (nibbles, record), n, k)


def pack_q6k(q: torch.Tensor, sc: torch.Tensor, d: torch.Tensor) -> PackedGroups:
    """Q6_K's fields (gguf_blocks.q6k_fields): q uint8 [N, K] in 0..63, sc int8 [N, K/16], d
    float16 [N, K/256] -> per (row block, group of 32) 384 bytes: 4 x 64 of low nibbles as Q4, 2 x
    64 of high bit pairs (vector h, bits 2c: chunk 4h + c); per (row block, super-block) a
    288-byte record d[16] | sc[16 sub-groups][16]."""
    n, k = _check_k_quant(q, "q")
    chunks = q.to(torch.uint8).reshape(n // ROWS, ROWS, k // 32, 8, 4)        # block, row, group, chunk, byte
    low = (chunks & 0x0F).reshape(n // ROWS, ROWS, k // 32, 4, 2, 4)
    high = (chunks >> 4).reshape(n // ROWS, ROWS, k // 32, 2, 4, 4)
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8).reshape(1, 1, 1, 1, 4, 1)
    pairs = (high << shifts).sum(dim=4, dtype=torch.uint8)                    # disjoint bits: sum == or
    weight = torch.cat((low[..., 0, :] | (low[..., 1, :] << 4), pairs), dim=3).permute(0, 2, 3, 1, 4).contiguous()
    record = torch.cat((_per_block(d.to(torch.float16), 1), _per_block(sc.to(torch.int8), 16)), dim=-1).contiguous()
    linear = NativeLinear(kind=Q6K, n=n, k=k, weight=weight.data_ptr(), scales=record.data_ptr(), lows=None, bias=None)
    return PackedGroups(linear, Q6K, (weight, record), n, k)


def _nibbles(q: torch.Tensor) -> torch.Tensor:
    """q uint8 [N, K] in 0..15 -> Q4's nibble blocks [N/16, K/32, 4, 16, 4] (as pack_q4's)."""
    n, k = q.shape
    chunks = q.to(torch.uint8).reshape(n // ROWS, ROWS, k // 32, 4, 2, 4)
    return (chunks[..., 0, :] | (chunks[..., 1, :] << 4)).permute(0, 2, 3, 1, 4).contiguous()


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
    if packed.kind in (Q4K, Q6K):
        return _dequantize_k_quant(packed, block, r)
    if packed.kind == Q4:
        nib = packed.tensors[0][block, :, :, r, :]                    # [R, G, 4 (j), 4 (byte)]
        q = torch.stack((nib & 0x0F, nib >> 4), dim=3).reshape(-1, groups, 32).float()   # j, lo/hi, byte
        scale = packed.tensors[1][block, :, r].float()                # [R, G]
        low = packed.tensors[2][block, :, r].float() if len(packed.tensors) > 2 else -8 * scale
        return (q * scale.unsqueeze(-1) + low.unsqueeze(-1)).reshape(-1, packed.k)
    w8 = packed.tensors[0][block, :, :, r, :].reshape(-1, groups, 32).float()     # [R, G, 8 chunks * 4]
    return (w8 * packed.tensors[1][block, :, r].float().unsqueeze(-1)).reshape(-1, packed.k)


def _record_field(record: torch.Tensor, r: torch.Tensor, start: int, per_row: int, dtype: torch.dtype) -> torch.Tensor:
    """Rows r of one field of the per-super-block records [R, S, bytes] -> [R, S * per_row] float32."""
    item = torch.tensor([], dtype=dtype).element_size()
    field = record[..., start:start + per_row * ROWS * item].contiguous().view(dtype)
    field = field.reshape(record.shape[0], record.shape[1], per_row, ROWS)
    return field[torch.arange(record.shape[0]), :, :, r].reshape(record.shape[0], -1).float()


def _dequantize_k_quant(packed: PackedGroups, block: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
    """ggml's arithmetic in its order (bit-exact): Q4_K (d*sc)*q - dmin*m, Q6_K (d*sc)*(q - 32)."""
    groups = packed.k // 32
    weight, record = packed.tensors[0][block, :, :, r, :], packed.tensors[1][block]
    if packed.kind == Q4K:
        q = torch.stack((weight & 0x0F, weight >> 4), dim=3).reshape(-1, groups, 32).float()
        d = _record_field(record, r, 0, 1, torch.float16).repeat_interleave(SUPER // 32, dim=1)
        dmin = _record_field(record, r, 32, 1, torch.float16).repeat_interleave(SUPER // 32, dim=1)
        scale = d * _record_field(record, r, 64, 8, torch.uint8)
        low = dmin * _record_field(record, r, 192, 8, torch.uint8)
        return (q * scale.unsqueeze(-1) - low.unsqueeze(-1)).reshape(-1, packed.k)
    nib, pairs = weight[:, :, :4], weight[:, :, 4:]                       # [R, G, 4, 4], [R, G, 2, 4]
    low = torch.stack((nib & 0x0F, nib >> 4), dim=3).reshape(-1, groups, 8, 4)
    high = torch.stack([(pairs >> s) & 0x03 for s in (0, 2, 4, 6)], dim=3).reshape(-1, groups, 8, 4)
    q = (low | (high << 4)).reshape(-1, packed.k // 16, 16).float() - 32
    d = _record_field(record, r, 0, 1, torch.float16).repeat_interleave(SUPER // 16, dim=1)
    scale = d * _record_field(record, r, 32, 16, torch.int8)
    return (scale.unsqueeze(-1) * q).reshape(-1, packed.k)
