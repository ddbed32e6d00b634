"""GGUF (llama.cpp) storage formats: float tensors and ggml block quantizations.

Weights are dequantized once at load time (numerics of `gguf.quants.dequantize`, the
reference implementation shipped with llama.cpp's Python package), then run as dense
tensors in the model's dtype: GGUFQuantization is a checkpoint-format method whose
`load_tensor` turns each stored tensor into the dense one a parameter's weight loader copies in,
whatever linear method (unquantized, int4) then runs the layers.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Union

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize as _gguf_dequantize

from .unquantized import UnquantizedLinearMethod

QType = GGMLQuantizationType

# Stored as plain values: read them without the generic numpy path.
_FLOAT_TYPES = {QType.F32: torch.float32, QType.F16: torch.float16, QType.BF16: torch.bfloat16}
# Block formats we test against gguf's reference (tests/models/test_gguf_quant.py).
_BLOCK_TYPES = (QType.Q4_0, QType.Q4_1, QType.Q5_0, QType.Q5_1, QType.Q8_0,
                QType.Q2_K, QType.Q3_K, QType.Q4_K, QType.Q5_K, QType.Q6_K)
SUPPORTED_TYPES: tuple[QType, ...] = tuple(_FLOAT_TYPES) + _BLOCK_TYPES


def qtype_name(qtype: Union[int, QType]) -> str:
    try:
        return QType(qtype).name
    except ValueError:
        return f"ggml type {int(qtype)}"


def check_supported(qtype: Union[int, QType], tensor_name: str = "") -> QType:
    """The qtype as an enum; ValueError naming the type when we cannot dequantize it."""
    try:
        q = QType(qtype)
    except ValueError:
        q = None
    if q not in SUPPORTED_TYPES:
        where = f" (tensor {tensor_name!r})" if tensor_name else ""
        raise ValueError(f"unsupported GGUF tensor type {qtype_name(qtype)}{where}; "
                         f"supported: {', '.join(t.name for t in SUPPORTED_TYPES)}")
    return q


def stored_nbytes(qtype: Union[int, QType], num_elements: int) -> int:
    """Bytes that `num_elements` values of this type occupy in a GGUF file."""
    block_elems, block_bytes = GGML_QUANT_SIZES[QType(qtype)]
    if num_elements % block_elems:
        raise ValueError(f"{num_elements} elements is not a whole number of {qtype_name(qtype)} blocks")
    return num_elements // block_elems * block_bytes


def dequantize(data: np.ndarray, qtype: Union[int, QType], shape: tuple[int, ...],
               tensor_name: str = "") -> torch.Tensor:
    """Raw bytes of one GGUF tensor (any array of uint8, or already-typed values) -> float32 [shape].

    `shape` is in torch order (outermost first), i.e. the reverse of GGUF's `ne`.
    """
    q = check_supported(qtype, tensor_name)
    raw = np.ascontiguousarray(data).reshape(-1).view(np.uint8)
    num_elements = int(np.prod(shape)) if shape else 1
    if raw.size != stored_nbytes(q, num_elements):
        raise ValueError(f"tensor {tensor_name!r}: {raw.size} bytes do not hold {num_elements} "
                         f"{q.name} values")
    if q in _FLOAT_TYPES:
        # torch reads bf16 natively (numpy has no bf16), and this skips a float32 numpy copy.
        values = torch.from_numpy(raw.copy()).view(_FLOAT_TYPES[q])
        return values.to(torch.float32).reshape(shape)
    if q in _TORCH_DEQUANTIZE:
        return _TORCH_DEQUANTIZE[q](torch.from_numpy(raw.copy())).reshape(shape)
    # One row holding every block: gguf.quants loops in Python over groups of 16 rows, so
    # handing it the tensor's natural rows (or single blocks) costs seconds per model.
    out = _gguf_dequantize(raw.reshape(1, -1), q)      # float32 [1, num_elements]
    return torch.from_numpy(out).reshape(shape)


# The commonest block formats in torch ops (multi-threaded; gguf.quants' numpy, single-threaded,
# was a large part of start-up). Same arithmetic as gguf.quants, in the same order, so the values
# are bit-identical (tests/models/test_gguf_quant.py compares them).
def _blocks(raw: torch.Tensor, block_bytes: int) -> torch.Tensor:
    return raw.reshape(-1, block_bytes)


def _fp16(blocks: torch.Tensor, start: int) -> torch.Tensor:
    return blocks[:, start:start + 2].contiguous().view(torch.float16).to(torch.float32)


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """16 bytes a block -> its 32 values: the low nibbles are elements 0..15, the high ones 16..31."""
    return torch.cat((qs & 0x0F, qs >> 4), dim=1).to(torch.float32)


def _q4_0(raw: torch.Tensor) -> torch.Tensor:
    b = _blocks(raw, 18)
    return (_fp16(b, 0) * (_nibbles(b[:, 2:]) - 8)).reshape(-1)


def _q4_1(raw: torch.Tensor) -> torch.Tensor:
    b = _blocks(raw, 20)
    return (_fp16(b, 0) * _nibbles(b[:, 4:]) + _fp16(b, 2)).reshape(-1)


def _q8_0(raw: torch.Tensor) -> torch.Tensor:
    b = _blocks(raw, 34)
    return (_fp16(b, 0) * b[:, 2:].contiguous().view(torch.int8).to(torch.float32)).reshape(-1)


_TORCH_DEQUANTIZE = {QType.Q4_0: _q4_0, QType.Q4_1: _q4_1, QType.Q8_0: _q8_0}


@dataclass(frozen=True, eq=False)
class GGUFTensor:
    """One tensor as a GGUF file stores it, not yet dequantized."""
    name: str
    data: np.ndarray              # the stored bytes (a view into the file's memory map)
    qtype: int                    # ggml type id
    shape: tuple[int, ...]        # torch order (outermost first)


class GGUFQuantization(UnquantizedLinearMethod):
    """GGUF tensors, dequantized to dense float32 at load time; layers then run dense."""
    name = "gguf"

    def load_tensor(self, stored: GGUFTensor) -> torch.Tensor:
        return dequantize(stored.data, stored.qtype, stored.shape, tensor_name=stored.name)
