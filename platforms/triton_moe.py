"""The mixture-of-experts op in Triton, for GPU platforms ("moe" layer kernel; core/layers/moe.py
moe_reference is the contract, expert biases and GPT-OSS's "swiglu_oai" activation included).

The (token, slot) pairs are sorted by expert on the device (a stable argsort; per-expert counts by
scatter-add, starts by cumsum: no host synchronisation, so the op can be captured in a CUDA graph
for a fixed number of tokens). Two kernels, grid (experts, row blocks, column blocks), every
program reading one expert's weights for up to BLOCK_M of its rows (programs past an expert's rows
return at once; an expert no token picked costs nothing but those programs):
  * gate/up: a[row] = act(x[token] W_gate^T + b_gate) * (x[token] W_up^T + b_up), float32 sums,
    rows gathered through the sorted order, written in sorted order (no atomics);
  * down: y[row] = weight[pair] * (a[row] W_down^T + b_down), back into the pair's own row.
Each token's k rows are then summed in torch. Runs on the CPU only under the Triton interpreter
(TRITON_INTERPRET=1), which is how the tests check it against the torch op.
"""
from __future__ import annotations

import functools
import os
from typing import Any, Optional

import torch

BLOCK_M = 16
BLOCK_N = 32
BLOCK_K = 32
ACTIVATIONS = {"silu": 0, "gelu_tanh": 1, "gelu": 2, "relu": 3, "swiglu_oai": 4}


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@functools.lru_cache(maxsize=None)
def _kernels(interpret: bool):
    """Define the kernels on first use, so TRITON_INTERPRET is read when they are decorated."""
    import triton
    import triton.language as tl

    @triton.jit
    def gate_up_kernel(X, W13, B13, A, ORDER, STARTS, COUNTS, stride_xt, stride_we, stride_wn, stride_be,
                       stride_at, H, INTER, TOP_K, alpha, limit, HAS_BIAS: tl.constexpr, ACT: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        e = tl.program_id(0)
        num = tl.load(COUNTS + e)
        if tl.program_id(1) * BLOCK_M >= num:
            return
        start = tl.load(STARTS + e)
        m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
        mmask = m < num
        tok = tl.load(ORDER + start + m, mask=mmask, other=0) // TOP_K
        n = tl.program_id(2) * BLOCK_N + tl.arange(0, BLOCK_N)
        nmask = n < INTER
        gate = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        w_base = W13 + e * stride_we
        for k0 in range(0, H, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            kmask = k < H
            x = tl.load(X + tok[:, None] * stride_xt + k[None, :], mask=mmask[:, None] & kmask[None, :], other=0.0)
            wmask = kmask[:, None] & nmask[None, :]
            wg = tl.load(w_base + n[None, :] * stride_wn + k[:, None], mask=wmask, other=0.0)
            wu = tl.load(w_base + (n[None, :] + INTER) * stride_wn + k[:, None], mask=wmask, other=0.0)
            gate += tl.dot(x.to(tl.float32), wg.to(tl.float32), input_precision="ieee")
            up += tl.dot(x.to(tl.float32), wu.to(tl.float32), input_precision="ieee")
        if HAS_BIAS:
            gate += tl.load(B13 + e * stride_be + n, mask=nmask, other=0.0).to(tl.float32)[None, :]
            up += tl.load(B13 + e * stride_be + INTER + n, mask=nmask, other=0.0).to(tl.float32)[None, :]
        if ACT == 0:
            a = gate / (1.0 + tl.exp(-gate)) * up
        elif ACT == 1:      # 0.5 * (1 + tanh(z)) = sigmoid(2z)
            z = 0.7978845608028654 * (gate + 0.044715 * gate * gate * gate)
            a = gate / (1.0 + tl.exp(-2.0 * z)) * up
        elif ACT == 2:
            a = 0.5 * gate * (1.0 + tl.erf(gate * 0.7071067811865476)) * up
        elif ACT == 3:
            a = tl.maximum(gate, 0.0) * up
        else:               # GPT-OSS: gate clamped above, up to +-limit, (up + 1) * gate * sigmoid(alpha * gate)
            g = tl.minimum(gate, limit)
            u = tl.minimum(tl.maximum(up, -limit), limit)
            a = (u + 1.0) * (g / (1.0 + tl.exp(-alpha * g)))
        rows = start + m
        tl.store(A + rows[:, None] * stride_at + n[None, :], a, mask=mmask[:, None] & nmask[None, :])

    @triton.jit
    def down_kernel(A, W2, B2, WEIGHTS, Y, ORDER, STARTS, COUNTS, stride_at, stride_we, stride_wn, stride_be,
                    stride_yp, H, INTER, HAS_BIAS: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        e = tl.program_id(0)
        num = tl.load(COUNTS + e)
        if tl.program_id(1) * BLOCK_M >= num:
            return
        start = tl.load(STARTS + e)
        m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
        mmask = m < num
        pair = tl.load(ORDER + start + m, mask=mmask, other=0)
        rows = start + m
        n = tl.program_id(2) * BLOCK_N + tl.arange(0, BLOCK_N)
        nmask = n < H
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        w_base = W2 + e * stride_we
        for k0 in range(0, INTER, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            kmask = k < INTER
            a = tl.load(A + rows[:, None] * stride_at + k[None, :], mask=mmask[:, None] & kmask[None, :], other=0.0)
            w = tl.load(w_base + n[None, :] * stride_wn + k[:, None], mask=kmask[:, None] & nmask[None, :], other=0.0)
            acc += tl.dot(a, w.to(tl.float32), input_precision="ieee")
        if HAS_BIAS:
            acc += tl.load(B2 + e * stride_be + n, mask=nmask, other=0.0).to(tl.float32)[None, :]
        weight = tl.load(WEIGHTS + pair, mask=mmask, other=0.0).to(tl.float32)
        tl.store(Y + pair[:, None] * stride_yp + n[None, :], acc * weight[:, None],
                 mask=mmask[:, None] & nmask[None, :])

    return gate_up_kernel, down_kernel


def fused_moe(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor, activation: str = "silu", *, w13_bias: Optional[torch.Tensor] = None,
              w2_bias: Optional[torch.Tensor] = None, swiglu_alpha: float = 1.702, swiglu_limit: float = 7.0,
              **extra: Any) -> Any:
    """moe_reference's op (float32 sums, the result in hidden's dtype); NotImplemented for what it
    does not take (CPU tensors outside the interpreter, unknown arguments, other activations)."""
    import triton

    if ((hidden.device.type == "cpu" and not _interpreting()) or extra or activation not in ACTIVATIONS
            or hidden.dim() != 2 or w13.dim() != 3):
        return NotImplemented
    tokens, size = hidden.shape
    num_experts, inter = w13.shape[0], w2.shape[2]
    top_k = topk_ids.shape[1]
    out = torch.zeros_like(hidden)
    if tokens == 0:
        return out
    gate_up, down = _kernels(_interpreting())
    x = hidden.contiguous()
    w13, w2 = w13.contiguous(), w2.contiguous()
    flat = topk_ids.reshape(-1)
    order = torch.argsort(flat, stable=True)             # pairs (t * k + j) by expert
    counts = torch.zeros(num_experts, dtype=torch.int64, device=hidden.device)
    counts.scatter_add_(0, flat.long(), torch.ones_like(flat, dtype=torch.int64))
    starts = torch.cumsum(counts, 0) - counts
    pairs = tokens * top_k
    act = torch.empty((pairs, inter), dtype=torch.float32, device=hidden.device)
    routed = torch.empty((pairs, size), dtype=torch.float32, device=hidden.device)
    weights = topk_weights.reshape(-1).contiguous()
    # Either bias may be absent (at tensor parallelism only rank 0 adds the down bias); an absent one
    # is passed as any tensor, never read.
    b13 = w13_bias.contiguous() if w13_bias is not None else act
    b2 = w2_bias.contiguous() if w2_bias is not None else act
    row_blocks = triton.cdiv(tokens, BLOCK_M)           # an expert has at most one pair per token
    gate_up[(num_experts, row_blocks, triton.cdiv(inter, BLOCK_N))](
        x, w13, b13, act, order, starts, counts, x.stride(0), w13.stride(0), w13.stride(1),
        b13.stride(0) if w13_bias is not None else 0, act.stride(0), size, inter, top_k, float(swiglu_alpha),
        float(swiglu_limit), HAS_BIAS=w13_bias is not None, ACT=ACTIVATIONS[activation],
        BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K)
    down[(num_experts, row_blocks, triton.cdiv(size, BLOCK_N))](
        act, w2, b2, weights, routed, order, starts, counts, act.stride(0), w2.stride(0), w2.stride(1),
        b2.stride(0) if w2_bias is not None else 0, routed.stride(0), size, inter, HAS_BIAS=w2_bias is not None,
        BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K)
    return routed.view(tokens, top_k, size).sum(dim=1).to(hidden.dtype)
