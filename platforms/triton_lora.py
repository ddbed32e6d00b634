"""The batched LoRA op in Triton (punica's SGMV shrink/expand), for GPU platforms.

Same contract as the torch op in core/lora/punica.py (`add_lora(y, x, lora_a, lora_b, mapping)`):
the mapping groups the adapted rows by slot (`token_indices`, `group_starts`, `group_lens`,
`slots`, `max_len`). Two kernels, grid (groups, row blocks, column blocks):
  * shrink: s[i] = x[token_indices[i]] A[slot]^T, float32, into a [adapted rows, R] buffer;
  * expand: y[token_indices[i]] += s[i] B[slot]^T (each row is written by one program: no atomics).
Rows are gathered through token_indices inside the kernels, so the batch is never reordered, and
each program reads one slot's weights: base rows cost nothing. Runs on the CPU only under the Triton
interpreter (TRITON_INTERPRET=1), which is how the tests check it against the torch op.
"""
from __future__ import annotations

import functools
import os
from typing import Any, Optional, Sequence

import torch

BLOCK_M = 16
BLOCK_N = 32
BLOCK_K = 32


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@functools.lru_cache(maxsize=None)
def _kernels(interpret: bool):
    """Define the kernels on first use, so TRITON_INTERPRET is read when they are decorated."""
    import triton
    import triton.language as tl

    @triton.jit
    def shrink_kernel(X, A, S, TOKENS, STARTS, LENS, SLOTS, stride_xt, stride_as, stride_ak, stride_st, K, R,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        g = tl.program_id(0)
        num = tl.load(LENS + g)
        start = tl.load(STARTS + g)
        slot = tl.load(SLOTS + g)
        m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
        mmask = m < num
        tok = tl.load(TOKENS + start + m, mask=mmask, other=0)
        n = tl.program_id(2) * BLOCK_N + tl.arange(0, BLOCK_N)
        nmask = n < R
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            kmask = k < K
            x = tl.load(X + tok[:, None] * stride_xt + k[None, :], mask=mmask[:, None] & kmask[None, :], other=0.0)
            a = tl.load(A + slot * stride_as + k[:, None] * stride_ak + n[None, :],
                        mask=kmask[:, None] & nmask[None, :], other=0.0)
            acc += tl.dot(x.to(tl.float32), a.to(tl.float32), input_precision="ieee")
        tl.store(S + (start + m)[:, None] * stride_st + n[None, :], acc, mask=mmask[:, None] & nmask[None, :])

    @triton.jit
    def expand_kernel(S, B, Y, TOKENS, STARTS, LENS, SLOTS, stride_st, stride_bs, stride_br, stride_yt, N, R,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        g = tl.program_id(0)
        num = tl.load(LENS + g)
        start = tl.load(STARTS + g)
        slot = tl.load(SLOTS + g)
        m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
        mmask = m < num
        tok = tl.load(TOKENS + start + m, mask=mmask, other=0)
        n = tl.program_id(2) * BLOCK_N + tl.arange(0, BLOCK_N)
        nmask = n < N
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for r0 in range(0, R, BLOCK_K):
            r = r0 + tl.arange(0, BLOCK_K)
            rmask = r < R
            s = tl.load(S + (start + m)[:, None] * stride_st + r[None, :], mask=mmask[:, None] & rmask[None, :],
                        other=0.0)
            b = tl.load(B + slot * stride_bs + r[:, None] * stride_br + n[None, :],
                        mask=rmask[:, None] & nmask[None, :], other=0.0)
            acc += tl.dot(s, b.to(tl.float32), input_precision="ieee")
        ptrs = Y + tok[:, None] * stride_yt + n[None, :]
        mask = mmask[:, None] & nmask[None, :]
        y = tl.load(ptrs, mask=mask, other=0.0)
        tl.store(ptrs, (y.to(tl.float32) + acc).to(y.dtype), mask=mask)

    return shrink_kernel, expand_kernel


def add_lora(y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, mapping: Any,
             output_sizes: Optional[Sequence[int]] = None) -> None:
    """y[row] += x[row] A[slot]^T B[slot]^T for every adapted row of `mapping`, in place
    (lora_a = A^T [slots, in, R], lora_b = B^T [slots, R, out], contiguous; B multiplied whole,
    `output_sizes` of its diagonal blocks unused)."""
    import triton

    shrink, expand = _kernels(_interpreting())
    if x.stride(-1) != 1:
        x = x.contiguous()
    assert y.stride(-1) == 1 and lora_a.is_contiguous() and lora_b.is_contiguous()
    k_in, rank, n_out = lora_a.shape[1], lora_a.shape[2], lora_b.shape[2]
    num_groups = mapping.slots.numel()
    rows_blocks = triton.cdiv(mapping.max_len, BLOCK_M)
    tokens, starts, lens, slots = mapping.token_indices, mapping.group_starts, mapping.group_lens, mapping.slots
    shrunk = torch.empty(tokens.numel(), rank, dtype=torch.float32, device=x.device)
    shrink[(num_groups, rows_blocks, triton.cdiv(rank, BLOCK_N))](
        x, lora_a, shrunk, tokens, starts, lens, slots, x.stride(0), lora_a.stride(0), lora_a.stride(1),
        shrunk.stride(0), k_in, rank, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K)
    expand[(num_groups, rows_blocks, triton.cdiv(n_out, BLOCK_N))](
        shrunk, lora_b, y, tokens, starts, lens, slots, shrunk.stride(0), lora_b.stride(0), lora_b.stride(1),
        y.stride(0), n_out, rank, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K)
