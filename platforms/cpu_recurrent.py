"""The cpu platform's Gated DeltaNet decode kernel ("gated_delta_rule" layer kernel,
core/layers/gated_deltanet.py's op): the recurrent form for a whole decode batch in one native call
(platforms/csrc/cpu_recurrent.cpp), AVX-512 float32 with OpenMP over the (sequence, value head)
pairs, instead of `_prepare` + `_recurrent`'s ~15 small torch ops per token over [B, Hv, Dk, Dv].

The call takes q, k un-repeated (GQA: value head h reads key head h // (Hv / Hk)) and the layer's
strided views as they come (heads contiguous within a token's row), normalizes q and k itself, and
updates the float32 state it is handed in place, returning it as the final state (the layer hands
the decode path a gathered copy of its slots' states and writes it back by slot). It agrees with
gated_delta_rule_reference to float32 rounding (summation order), not bit for bit.

What it does not take returns NotImplemented and the layer runs the torch reference: the chunked
form (prefill chunks), dtypes other than float32 / bf16 activations with a float32 g, a state that
is not a contiguous float32 [B, Hv, Dk, Dv], v_dim not a multiple of 16, k_dim over the kernel's
stack buffer, inputs whose heads are not contiguous.
"""
from __future__ import annotations

import ctypes
from typing import Any, Optional

import torch

from .native_build import NativeLibrary, source

ABI_VERSION = 1
ACTIVATION_DTYPES = (torch.float32, torch.bfloat16)


def _declare(lib: ctypes.CDLL) -> None:
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    lib.gated_delta_max_key_dim.restype = i64
    lib.gated_delta_max_key_dim.argtypes = []
    lib.gated_delta_recurrent.restype = None
    lib.gated_delta_recurrent.argtypes = [p, p, p, p, p, p, p, i64, i64, i64, i64, i64, i64, i64,
                                          ctypes.POINTER(i64)]


LIBRARY = NativeLibrary(source("cpu_recurrent.cpp"), ABI_VERSION, _declare)


def available() -> Optional[str]:
    """None when the kernel loads here, else why not (e.g. "this CPU has no AVX512F")."""
    return LIBRARY.available()


def _heads_contiguous(x: torch.Tensor) -> bool:
    """[B, n, heads, dim] (or [B, n, heads]) whose last dims are one contiguous row per token."""
    if x.dim() == 3:
        return x.stride(2) == 1 or x.shape[2] == 1
    return (x.stride(3) == 1 or x.shape[3] == 1) and (x.stride(2) == x.shape[3] or x.shape[2] == 1)


class NativeGatedDeltaRule:
    """gated_delta_rule(q, k, v, g, beta, state, chunked) -> (out [B, n, Hv, Dv] in v's dtype, the
    state after the last token, which is `state` itself, updated in place)."""
    name = "native_gated_delta_rule"

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                 state: torch.Tensor, chunked: bool) -> Any:
        if chunked or not self._takes(q, k, v, g, beta, state):
            return NotImplemented
        lib = LIBRARY.require()
        b, n, hk, dk = q.shape
        hv, dv = v.shape[2], v.shape[3]
        if dk > lib.gated_delta_max_key_dim():
            return NotImplemented
        out = torch.empty((b, n, hv, dv), dtype=v.dtype)
        strides = (ctypes.c_int64 * 10)(q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
                                        g.stride(0), g.stride(1), beta.stride(0), beta.stride(1))
        lib.gated_delta_recurrent(q.data_ptr(), k.data_ptr(), v.data_ptr(), g.data_ptr(), beta.data_ptr(),
                                  state.data_ptr(), out.data_ptr(), int(v.dtype == torch.bfloat16), b, n, hk, hv,
                                  dk, dv, strides)
        return out, state

    @staticmethod
    def _takes(q, k, v, g, beta, state) -> bool:
        if q.dim() != 4 or k.shape != q.shape or v.dim() != 4 or g.dim() != 3 or beta.shape != g.shape:
            return False
        b, n, hk, dk = q.shape
        _, _, hv, dv = v.shape
        return (v.dtype in ACTIVATION_DTYPES and q.dtype == k.dtype == beta.dtype == v.dtype
                and g.dtype == torch.float32 and state.dtype == torch.float32
                and v.shape[:2] == (b, n) and g.shape == (b, n, hv) and hk > 0 and hv % hk == 0
                and dv % 16 == 0 and dv > 0 and dk > 0 and b > 0 and n > 0
                and state.shape == (b, hv, dk, dv) and state.is_contiguous()
                and all(x.device.type == "cpu" for x in (q, k, v, g, beta, state))
                and all(_heads_contiguous(x) for x in (q, k, v, g, beta)))


def gated_delta_rule_kernel() -> Optional[NativeGatedDeltaRule]:
    """The kernel where its library builds here, else None (the layers keep the torch reference)."""
    return NativeGatedDeltaRule() if available() is None else None
