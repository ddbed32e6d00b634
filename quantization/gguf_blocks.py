"""GGUF block formats decoded into the grids a kernel multiplies, without a round trip through float.

Written from ggml's block definitions (ggml-common.h; the same arithmetic as gguf.quants'
dequantizers, which the tests compare against):
  * Q4_0: 32 weights, fp16 d, 16 bytes of nibbles: w = d * (q - 8)   -> scale d, low -8d
  * Q4_1: 32 weights, fp16 d and m:             w = d * q + m       -> scale d, low m
  * Q4_K: 256 weights, fp16 d and dmin, 12 bytes of 6-bit (sc, m) for 8 sub-blocks of 32, 128
    bytes of nibbles (sub-block 2i in the low nibbles of chunk i, 2i + 1 in the high ones):
    w = d * sc * q - dmin * m                                        -> scale d*sc, low -dmin*m
  * Q8_0: 32 weights, fp16 d, 32 int8:          w = d * q
  * Q6_K: 256 weights in 16 groups of 16 with int8 scales, fp16 d, 128 bytes of low nibbles and
    64 of high bit pairs: w = d * sc * (q - 32), q in 0..63.
A platform with K-quant kernels takes Q4_K and Q6_K as their own fields (`q4k_fields`,
`q6k_fields`: the file's codes, nothing rounded); otherwise Q4_K is read as 4-bit affine groups
(`affine4_groups`) and Q6_K re-expressed as int8 groups of 32 (`int8_groups`: no exact 8-bit-per-32
form; max error half a step of 1/127 of the group's largest value, an eighth of a Q6_K step).
"""
from __future__ import annotations

from typing import Optional

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from .gguf import dequantize

QType = GGMLQuantizationType
AFFINE4 = (QType.Q4_0, QType.Q4_1, QType.Q4_K)      # 4-bit affine groups of 32
INT8 = (QType.Q8_0, QType.Q6_K)                      # 8-bit symmetric groups of 32
FLOAT = (QType.F32, QType.F16, QType.BF16)
FLOAT_DTYPES = {QType.F32: torch.float32, QType.F16: torch.float16, QType.BF16: torch.bfloat16}


def row_bytes(qtype: int, k: int) -> int:
    block_elems, block_bytes = GGML_QUANT_SIZES[QType(qtype)]
    return k // block_elems * block_bytes


def as_rows(data: np.ndarray, n: int) -> torch.Tensor:
    """A tensor's stored bytes (a view into the file's memory map) -> an owned uint8 [N, row bytes]."""
    return torch.from_numpy(np.array(np.asarray(data).reshape(-1).view(np.uint8).reshape(n, -1)))


def _fp16(b: torch.Tensor, start: int) -> torch.Tensor:
    return b[..., start:start + 2].contiguous().view(torch.float16).float().squeeze(-1)


def affine4_groups(qtype: int, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    """uint8 [N, row bytes] -> (q uint8 [N, K] in 0..15, scale float32 [N, K/32], low float32
    [N, K/32] or None for Q4_0, where low = -8 * scale)."""
    n = rows.shape[0]
    q_type = QType(qtype)
    if q_type in (QType.Q4_0, QType.Q4_1):
        head = 2 if q_type == QType.Q4_0 else 4
        b = rows.reshape(n, -1, head + 16)
        qs = b[..., head:]
        q = torch.cat((qs & 0x0F, qs >> 4), dim=-1).reshape(n, -1)
        scale = _fp16(b, 0)
        return q, scale, None if q_type == QType.Q4_0 else _fp16(b, 2)
    if q_type == QType.Q4_K:
        b = rows.reshape(n, -1, 144)
        d, dmin = _fp16(b, 0), _fp16(b, 2)                            # [N, S]
        sc, m = (c.float() for c in _scale_min_k4(b[..., 4:16]))    # [N, S, 8]
        qs = b[..., 16:].reshape(n, -1, 4, 1, 32)                    # chunk i, 32 bytes
        q = torch.cat((qs & 0x0F, qs >> 4), dim=3).reshape(n, -1)   # sub-blocks 2i (low), 2i+1 (high)
        scale = (d.unsqueeze(-1) * sc).reshape(n, -1)
        low = -(dmin.unsqueeze(-1) * m).reshape(n, -1)
        return q, scale, low
    raise ValueError(f"{q_type.name} is not a 4-bit affine format")


def _scale_min_k4(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K/Q5_K's 12 bytes -> 8 six-bit scales and 8 six-bit mins (uint8), ggml's get_scale_min_k4."""
    d, m, md = packed[..., 0:4], packed[..., 4:8], packed[..., 8:12]
    sc = torch.cat((d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)), dim=-1)
    mins = torch.cat((m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)), dim=-1)
    return sc, mins


def _fp16_raw(b: torch.Tensor, start: int) -> torch.Tensor:
    return b[..., start:start + 2].contiguous().view(torch.float16).squeeze(-1)


def q4k_fields(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q4_K uint8 [N, row bytes] -> (q uint8 [N, K] in 0..15, sc uint8 [N, K/32], m uint8 [N, K/32]
    (6-bit codes), d float16 [N, K/256], dmin float16 [N, K/256]): w = d*sc*q - dmin*m."""
    n = rows.shape[0]
    b = rows.reshape(n, -1, 144)
    sc, m = _scale_min_k4(b[..., 4:16])                              # [N, S, 8]
    qs = b[..., 16:].reshape(n, -1, 4, 1, 32)                        # chunk i, 32 bytes
    q = torch.cat((qs & 0x0F, qs >> 4), dim=3).reshape(n, -1)       # sub-blocks 2i (low), 2i+1 (high)
    return q, sc.reshape(n, -1), m.reshape(n, -1), _fp16_raw(b, 0), _fp16_raw(b, 2)


def q6k_fields(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q6_K uint8 [N, row bytes] -> (q uint8 [N, K] in 0..63, sc int8 [N, K/16], d float16
    [N, K/256]): w = d * sc * (q - 32). Within a super-block's half h (128 values), value r has
    its low nibble in byte h*64 + r%64 (shifted by 4 * (r//64)) and its high pair in byte
    h*32 + r%32 (shifted by 2 * (r//32)), as ggml's dequantize_row_q6_K."""
    n = rows.shape[0]
    b = rows.reshape(n, -1, 210)
    supers = b.shape[1]
    low_shift = torch.tensor([0, 4], dtype=torch.uint8).reshape(1, 1, 1, 2, 1)
    high_shift = torch.tensor([0, 2, 4, 6], dtype=torch.uint8).reshape(1, 1, 1, 4, 1)
    ql = (b[..., :128].reshape(n, supers, 2, 1, 64) >> low_shift) & 0x0F
    qh = (b[..., 128:192].reshape(n, supers, 2, 1, 32) >> high_shift) & 0x03
    q = ql.reshape(n, -1) | (qh.reshape(n, -1) << 4)
    sc = b[..., 192:208].contiguous().view(torch.int8).reshape(n, -1)
    return q, sc, _fp16_raw(b, 208)


def int8_groups(qtype: int, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """uint8 [N, row bytes] -> (w8 int8 [N, K], scale float32 [N, K/32]) with w = scale * w8."""
    n = rows.shape[0]
    q_type = QType(qtype)
    if q_type == QType.Q8_0:
        b = rows.reshape(n, -1, 34)
        return b[..., 2:].contiguous().view(torch.int8).reshape(n, -1), _fp16(b, 0)
    if q_type == QType.Q6_K:
        k = rows.shape[1] // 210 * 256
        groups = dequantize(rows.numpy(), q_type, (n, k)).reshape(n, k // 32, 32)
        scale = (groups.abs().amax(dim=-1) / 127).to(torch.float16).float()
        w8 = torch.round(groups / torch.where(scale > 0, scale, torch.ones_like(scale)).unsqueeze(-1))
        return w8.clamp_(-127, 127).to(torch.int8).reshape(n, k), scale
    raise ValueError(f"{q_type.name} is not an 8-bit format here")


def dequantize_rows(qtype: int, rows: torch.Tensor, k: int) -> torch.Tensor:
    """uint8 [R, row bytes] (or the float values of a float tensor) -> float32 [R, K]."""
    if rows.dtype != torch.uint8:
        return rows.float()
    return dequantize(rows.numpy(), qtype, (rows.shape[0], k))
