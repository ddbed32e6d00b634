"""The cpu platform's batched LoRA op: the native shrink + expand of platforms/csrc/cpu_lora.cpp.

Same contract as the torch op in core/lora/punica.py (`add_lora(y, x, lora_a, lora_b, mapping)`),
which on this CPU spends most of its time in the per-op overhead of a gather, two small bmm and an
index_add on every adapted linear: here each call is one native pass over the mapping's groups
(slot by slot, so each adapter's A and B stay in cache), float32 accumulation, rows gathered and
scattered in place. `output_sizes` (a fused layer's shard widths, core/lora/layers.py) lets the
expand skip the zero blocks of a block-diagonal B; None treats B as dense.
"""
from __future__ import annotations

import ctypes
import functools
from typing import Any, Optional, Sequence

import torch

from .native_build import NativeLibrary, source

ABI_VERSION = 1
_SUPPORTED = (torch.float32, torch.bfloat16)


def _declare(lib: ctypes.CDLL) -> None:
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    lib.lora_add.argtypes = [p, i64, p, i64, p, p, i64, p, p, p, p, i64, i64, i64, i64, p, i64]
    lib.lora_add.restype = None


LIBRARY = NativeLibrary(source("cpu_lora.cpp"), ABI_VERSION, _declare)


@functools.lru_cache(maxsize=None)
def _shard_sizes(sizes: tuple[int, ...]) -> torch.Tensor:
    return torch.tensor(sizes, dtype=torch.int64)


def available() -> Optional[str]:
    """None when the native op runs here (builds it on first use), else why not."""
    return LIBRARY.available()


def add_lora(y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, mapping: Any,
             output_sizes: Optional[Sequence[int]] = None) -> None:
    """y[row] += x[row] A[slot]^T B[slot]^T for every adapted row of `mapping`, in place
    (lora_a = A^T [slots, in, R], lora_b = B^T [slots, R, out]; float32 or bfloat16, all alike)."""
    dtype = y.dtype
    if dtype not in _SUPPORTED or x.dtype != dtype or lora_a.dtype != dtype or lora_b.dtype != dtype:
        raise ValueError(f"add_lora: y, x, lora_a and lora_b must all be float32 or all bfloat16, got "
                         f"{y.dtype}, {x.dtype}, {lora_a.dtype}, {lora_b.dtype}")
    k_in, width, n_out = lora_a.shape[1], lora_a.shape[2], lora_b.shape[2]
    if x.shape[-1] != k_in or y.shape[-1] != n_out or lora_b.shape[1] != width:
        raise ValueError(f"add_lora: shapes x {tuple(x.shape)}, y {tuple(y.shape)}, lora_a {tuple(lora_a.shape)}, "
                         f"lora_b {tuple(lora_b.shape)} do not chain")
    sizes = tuple(output_sizes) if output_sizes is not None else (n_out,)
    if sum(sizes) != n_out or width % len(sizes):
        raise ValueError(f"add_lora: output_sizes {list(sizes)} must sum to {n_out} and divide rank width {width}")
    if x.stride(-1) != 1:
        x = x.contiguous()
    out = y if y.stride(-1) == 1 else y.contiguous()
    lora_a, lora_b = lora_a.contiguous(), lora_b.contiguous()
    tokens, starts, lens, slots = mapping.token_indices, mapping.group_starts, mapping.group_lens, mapping.slots
    if (tokens.dtype, slots.dtype, starts.dtype, lens.dtype) != (torch.int64, torch.int64, torch.int32, torch.int32):
        raise ValueError("add_lora: mapping needs int64 token_indices/slots and int32 group_starts/group_lens "
                         "(core/lora/punica.py build_mapping)")
    shards = _shard_sizes(sizes)
    LIBRARY.require().lora_add(
        out.data_ptr(), out.stride(0), x.data_ptr(), x.stride(0), lora_a.data_ptr(), lora_b.data_ptr(),
        int(dtype == torch.bfloat16), tokens.data_ptr(), starts.data_ptr(), lens.data_ptr(), slots.data_ptr(),
        slots.numel(), k_in, width, n_out, shards.data_ptr(), len(sizes))
    if out is not y:
        y.copy_(out)
