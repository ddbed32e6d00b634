"""Kimi Delta Attention (Kimi Linear): a gated delta rule whose decay is per key channel.

Per token: q, k, v projections (each through its causal depthwise conv of width `kernel` and SiLU),
the write strength beta = sigmoid(b_proj x) per head and the decay
g = -exp(A_log) * softplus(f_b(f_a(x)) + dt_bias) per head *and key dimension* (Gated DeltaNet,
core/layers/gated_deltanet.py, has one decay per head). Per head a state S [k_dim, v_dim] (float32):
S = diag(exp(g)) S, then S += k (beta (v - k^T S)), read as o = q^T S (q, k L2-normalized, q scaled by
1/sqrt(k_dim)); then an RMSNorm of o times sigmoid(g_b(g_a(x))) and the output projection.

The state per sequence lives in the state cache (core/state_cache.py): `state["conv"]` [slots, 3 *
heads * head_dim, kernel - 1] and `state["ssm"]` [slots, heads, head_dim, head_dim]. Prefill chunks
run the chunked form (transformers' `chunk_kimi_delta_attention`: per 64-token chunk the triangular
system of the delta rule with the pairwise per-channel decays, then the chunk's contribution to the
state) from the sequence's cached state; decodes run the recurrent form for all of them at once. The
rule is the op `kimi_delta_rule(q, k, v, g, beta, state, chunked)` a platform may supply
(LayerKernels, returning NotImplemented for what it does not take); `kimi_delta_rule_reference` is
the torch one.
"""
from __future__ import annotations

from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.quantization.interface import QuantizationMethod

from ..state_cache import RecurrentStateSpec
from .linear import Linear
from .params import plain_parameter
from .short_conv import DepthwiseConv, decode_slots, recurrent_batch

CHUNK = 64


def _l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """FLA's form (divide by sqrt(sum + eps)), as transformers' Kimi Linear writes it."""
    return x / torch.sqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def _chunked(q, k, v, g, beta, state: torch.Tensor, chunk: int = CHUNK) -> tuple[torch.Tensor, torch.Tensor]:
    """[B, H, n, D] float32 inputs, g [B, H, n, Dk] -> (out [B, H, n, Dv], final state). The pairwise
    decays [chunk, chunk, Dk] are built one chunk at a time, so memory stays bounded by the chunk."""
    n = k.shape[2]
    pad = (chunk - n % chunk) % chunk
    q, k, v, g = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v, g))
    beta = F.pad(beta, (0, pad))
    b, h, total, dk = k.shape
    out = torch.empty(b, h, total, v.shape[-1], dtype=torch.float32, device=v.device)
    strict_upper = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).triu(1)
    s = state
    for lo in range(0, total, chunk):
        hi = lo + chunk
        q_c, k_c, v_c = q[:, :, lo:hi], k[:, :, lo:hi], v[:, :, lo:hi]
        beta_c = beta[:, :, lo:hi].unsqueeze(-1)
        cum = g[:, :, lo:hi].cumsum(dim=2)                                         # [B, H, C, Dk]
        # exp(cum_i - cum_j) per channel for j <= i (0 above the diagonal): [B, H, C, C, Dk]
        decay = (cum.unsqueeze(3) - cum.unsqueeze(2)).masked_fill(strict_upper[..., None], float("-inf")).exp()
        k_beta = k_c * beta_c
        system = (k_beta.unsqueeze(3) * k_c.unsqueeze(2) * decay).sum(-1)         # unit lower triangular solve
        intra = (q_c.unsqueeze(3) * k_c.unsqueeze(2) * decay).sum(-1)
        new_values = torch.linalg.solve_triangular(system, v_c * beta_c, upper=False, unitriangular=True)
        k_cumdecay = torch.linalg.solve_triangular(system, k_beta * cum.exp(), upper=False, unitriangular=True)
        v_new = new_values - k_cumdecay @ s
        out[:, :, lo:hi] = (q_c * cum.exp()) @ s + intra @ v_new
        last = cum[:, :, -1:]                                                      # [B, H, 1, Dk]
        s = s * last.transpose(-1, -2).exp() + (k_c * (last - cum).exp()).transpose(-1, -2) @ v_new
    return out[:, :, :n], s


def _recurrent(q, k, v, g, beta, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    out = torch.empty_like(v)
    s = state
    for i in range(k.shape[2]):
        s = s * g[:, :, i].exp().unsqueeze(-1)
        kv_mem = (s * k[:, :, i].unsqueeze(-1)).sum(dim=-2)
        delta = (v[:, :, i] - kv_mem) * beta[:, :, i].unsqueeze(-1)
        s = s + k[:, :, i].unsqueeze(-1) * delta.unsqueeze(-2)
        out[:, :, i] = (s * q[:, :, i].unsqueeze(-1)).sum(dim=-2)
    return out, s


def kimi_delta_rule_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                              beta: torch.Tensor, state: torch.Tensor, chunked: bool
                              ) -> tuple[torch.Tensor, torch.Tensor]:
    """q, k [B, n, H, Dk] (before L2 normalization), v [B, n, H, Dv], g (log decay per key channel)
    [B, n, H, Dk], beta [B, n, H], state [B, H, Dk, Dv] float32 (the state before the first token) ->
    (out [B, n, H, Dv] in v's dtype, the state after the last token). `chunked`: the chunked form
    (prefill), else token by token (decode); the same function, rounded differently."""
    dtype = v.dtype
    q, k, v, g, beta = (x.transpose(1, 2).to(torch.float32, memory_format=torch.contiguous_format)
                        for x in (q, k, v, g, beta))
    q, k = _l2norm(q), _l2norm(k)
    q = q * q.shape[-1] ** -0.5
    initial = state.to(torch.float32)
    out, final = (_chunked(q, k, v, g, beta, initial) if chunked else _recurrent(q, k, v, g, beta, initial))
    return out.transpose(1, 2).contiguous().to(dtype), final


class SigmoidGatedRMSNorm(nn.Module):
    """RMSNorm of each head's output in float32 (weight applied in float32 too) times sigmoid(gate)."""

    def __init__(self, size: int, eps: float, dtype: Optional[torch.dtype]) -> None:
        super().__init__()
        self.eps = eps
        self.weight = plain_parameter(size, dtype=dtype)

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        normed = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps) * self.weight.float()
        return (normed * gate.float().sigmoid()).to(x.dtype)


class KimiDeltaAttention(nn.Module):
    """One KDA layer over a flat batch (the token mixer in its layer's attention slot)."""

    def __init__(self, config: Any, dtype: torch.dtype, quant_method: QuantizationMethod) -> None:
        super().__init__()
        hidden = config.hidden_size
        self.heads, self.head_dim = int(config.linear_num_heads), int(config.linear_head_dim)
        self.qkv_dim = self.heads * self.head_dim
        self.kernel = int(config.linear_conv_kernel_dim)
        linear: dict[str, Any] = dict(dtype=dtype, quant_method=quant_method)
        self.q_proj = Linear(hidden, self.qkv_dim, **linear)
        self.k_proj = Linear(hidden, self.qkv_dim, **linear)
        self.v_proj = Linear(hidden, self.qkv_dim, **linear)
        # One conv per projection (the checkpoint's q_conv1d / k_conv1d / v_conv1d), one state over [q | k | v].
        self.q_conv1d, self.k_conv1d, self.v_conv1d = (DepthwiseConv(self.qkv_dim, self.kernel, False, dtype)
                                                       for _ in range(3))
        self.f_a_proj = Linear(hidden, self.head_dim, **linear)
        self.f_b_proj = Linear(self.head_dim, self.qkv_dim, **linear)
        self.dt_bias = plain_parameter(self.qkv_dim, dtype=torch.float32)      # float32 in checkpoints
        self.A_log = plain_parameter(1, 1, self.heads, 1, dtype=dtype)
        self.b_proj = Linear(hidden, self.heads, **linear)
        self.g_a_proj = Linear(hidden, self.head_dim, **linear)
        self.g_b_proj = Linear(self.head_dim, self.qkv_dim, **linear)
        self.o_norm = SigmoidGatedRMSNorm(self.head_dim, float(config.rms_norm_eps), dtype)
        self.o_proj = Linear(self.qkv_dim, hidden, **linear)
        self.state_spec = RecurrentStateSpec.conv_and_recurrent(
            "kda", 3 * self.qkv_dim, self.kernel, dtype, (self.heads, self.head_dim, self.head_dim))
        self.state: dict[str, torch.Tensor] = {}      # the state cache's slot tensors (core/state_cache.py)
        self.attn = None          # no paged attention: the model lists only its attention layers' `attn`
        self._kernel: Any = None

    def use_kernel(self, kernel: Any) -> None:
        """A platform's `kimi_delta_rule` op (core/layers/kernels.py); may return NotImplemented."""
        self._kernel = kernel

    def delta_rule(self, q, k, v, g, beta, state, chunked: bool) -> tuple[torch.Tensor, torch.Tensor]:
        if self._kernel is not None:
            out = self._kernel(q, k, v, g, beta, state, chunked)
            if out is not NotImplemented:
                return out
        return kimi_delta_rule_reference(q, k, v, g, beta, state, chunked)

    def forget_gate(self, x: torch.Tensor) -> torch.Tensor:
        """The per-channel log decay [T, H, Dk]: -exp(A_log[h]) * softplus(f_b(f_a(x)) + dt_bias), in float32."""
        g = (self.f_b_proj(self.f_a_proj(x)).float() + self.dt_bias.float()).view(-1, self.heads, self.head_dim)
        softplus = torch.where(g > 20.0, g, torch.log(1.0 + torch.exp(g)))       # transformers' form
        return -self.A_log.float().view(self.heads, 1).exp() * softplus

    def _convs(self) -> tuple[tuple[DepthwiseConv, slice], ...]:
        d = self.qkv_dim
        return ((self.q_conv1d, slice(0, d)), (self.k_conv1d, slice(d, 2 * d)), (self.v_conv1d, slice(2 * d, 3 * d)))

    def _conv_prefill(self, qkv: torch.Tensor, conv_state: torch.Tensor, fresh: bool) -> torch.Tensor:
        return F.silu(torch.cat([conv.prefill(qkv[:, part], conv_state[part], fresh) for conv, part in self._convs()],
                                dim=-1))

    def _conv_decode(self, qkv: torch.Tensor, states: torch.Tensor, slots: torch.Tensor, fresh: list[int]
                     ) -> torch.Tensor:
        return F.silu(torch.cat([conv.decode(qkv[:, part], states[:, part], slots, fresh)
                                 for conv, part in self._convs()], dim=-1))

    def _heads(self, mixed: torch.Tensor, batch: int) -> tuple[torch.Tensor, ...]:
        return tuple(x.reshape(batch, -1, self.heads, self.head_dim) for x in mixed.split(self.qkv_dim, dim=-1))

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, attn_metadata: Any) -> torch.Tensor:
        batch = recurrent_batch(attn_metadata, self)
        qkv = torch.cat((self.q_proj(hidden), self.k_proj(hidden), self.v_proj(hidden)), dim=-1)
        g = self.forget_gate(hidden)                                  # [T, H, Dk] float32
        beta = self.b_proj(hidden).sigmoid()                          # [T, H]
        out = torch.empty(hidden.shape[0], self.heads, self.head_dim, dtype=hidden.dtype, device=hidden.device)
        nd, qsl = batch.decode_rows, attn_metadata.query_start_loc_cpu
        conv_states, ssm_states = self.state["conv"], self.state["ssm"]
        if nd:
            slots, fresh = decode_slots(batch, nd)
            mixed = self._conv_decode(qkv[:nd], conv_states, slots, fresh)
            ssm = ssm_states[slots]
            if fresh:
                ssm[fresh] = 0
            q, k, v = self._heads(mixed, nd)
            o, final = self.delta_rule(q, k, v, g[:nd].unsqueeze(1), beta[:nd].unsqueeze(1), ssm, chunked=False)
            ssm_states.index_copy_(0, slots, final)
            out[:nd] = o[:, 0]
        for e in range(nd, len(batch.slots)):
            lo, hi = qsl[e], qsl[e + 1]
            slot, fresh_seq = batch.slots[e], batch.starts[e] == 0
            mixed = self._conv_prefill(qkv[lo:hi], conv_states[slot], fresh_seq)
            ssm = ssm_states[slot]
            initial = torch.zeros_like(ssm) if fresh_seq else ssm
            q, k, v = self._heads(mixed, 1)
            o, final = self.delta_rule(q, k, v, g[lo:hi].unsqueeze(0), beta[lo:hi].unsqueeze(0), initial.unsqueeze(0),
                                       chunked=True)
            ssm.copy_(final[0])
            out[lo:hi] = o[0]
        gate = self.g_b_proj(self.g_a_proj(hidden)).view(-1, self.heads, self.head_dim)
        return self.o_proj(self.o_norm(out, gate).reshape(hidden.shape[0], self.qkv_dim))
