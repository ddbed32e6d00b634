"""Gated DeltaNet (Qwen3-Next, Qwen3.5): a linear-attention token mixer with a fixed-size state.

Per token: projections to q, k, v (through a causal depthwise conv of width `kernel` and SiLU), the
output gate z, the write strength beta = sigmoid(b) and the decay g = -exp(A_log) * softplus(a +
dt_bias); per value head a state S [k_dim, v_dim] (float32) updated by the gated delta rule
S = exp(g) S + k (beta (v - k^T exp(g) S)) and read as o = q^T S (q, k L2-normalized, q scaled by
1/sqrt(k_dim)); then an RMSNorm of o gated by SiLU(z) and the output projection.

The state per sequence lives in the state cache (core/state_cache.py): `state["conv"]` [slots,
conv_dim, kernel - 1] (the conv's last inputs) and `state["ssm"]` [slots, heads, k_dim, v_dim]. A
step's prefill chunks run the chunked form (transformers' `torch_chunk_gated_delta_rule`: a UT
transform per 64-token chunk, then a scan over chunks) from the sequence's cached state; its
decodes run the recurrent form for all of them at once. The delta rule is the op
`gated_delta_rule(q, k, v, g, beta, state, chunked)` a platform may supply (LayerKernels, returning
NotImplemented for what it does not take); `gated_delta_rule_reference` is the torch one.
"""
from __future__ import annotations

from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.quantization.interface import QuantizationMethod

from ..state_cache import RecurrentBatch, RecurrentStateSpec
from .linear import Linear
from .short_conv import DepthwiseConv, decode_slots
from .params import plain_parameter

CHUNK = 64


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def _prepare(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """[B, n, H*, D] inputs -> float32 [B, Hv, n, D] with q/k repeated over the value heads they
    serve, L2-normalized, q scaled: what both forms start from (transformers' order of operations)."""
    hk, hv = k.shape[2], v.shape[2]
    if hk != hv:
        q, k = q.repeat_interleave(hv // hk, dim=2), k.repeat_interleave(hv // hk, dim=2)
    q, k, v, beta, g = (x.transpose(1, 2).to(torch.float32, memory_format=torch.contiguous_format)
                        for x in (q, k, v, beta, g))
    q, k = l2norm(q), l2norm(k)
    return q * q.shape[-1] ** -0.5, k, v, g, beta


def _chunked(q, k, v, g, beta, state: torch.Tensor, chunk: int = CHUNK) -> tuple[torch.Tensor, torch.Tensor]:
    b, h, n, dk = k.shape
    pad = (chunk - n % chunk) % chunk
    q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
    beta, g = F.pad(beta, (0, pad)), F.pad(g, (0, pad))
    v_beta, k_beta = v * beta.unsqueeze(-1), k * beta.unsqueeze(-1)
    q, k, k_beta, v_beta = (x.reshape(b, h, -1, chunk, x.shape[-1]) for x in (q, k, k_beta, v_beta))
    g = g.reshape(b, h, -1, chunk)
    upper = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).triu(1)
    cum = g.cumsum(dim=3)
    pairwise = (cum.unsqueeze(4) - cum.unsqueeze(3)).masked_fill(upper, float("-inf")).exp()
    system = (k_beta @ k.transpose(-1, -2)) * pairwise
    intra = (q @ k.transpose(-1, -2)) * pairwise
    decayed_k_beta = k_beta * cum.exp().unsqueeze(-1)
    new_values = torch.linalg.solve_triangular(system, v_beta, upper=False, unitriangular=True)
    k_cumdecay = torch.linalg.solve_triangular(system, decayed_k_beta, upper=False, unitriangular=True)
    out = torch.zeros_like(new_values)
    q = q * cum.exp().unsqueeze(-1)
    k = k * (cum[..., -1:] - cum).exp().unsqueeze(-1)
    chunk_decay = cum[..., -1].exp()[..., None, None]
    s = state
    for i in range(q.shape[2]):
        v_new = new_values[:, :, i] - k_cumdecay[:, :, i] @ s
        out[:, :, i] = q[:, :, i] @ s + intra[:, :, i] @ v_new
        s = s * chunk_decay[:, :, i] + k[:, :, i].transpose(-1, -2) @ v_new
    return out.reshape(b, h, -1, v.shape[-1])[:, :, :n], s


def _recurrent(q, k, v, g, beta, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    out = torch.zeros_like(v)
    s = state
    for i in range(k.shape[2]):
        s = s * g[:, :, i].exp()[..., None, None]
        kv_mem = (s * k[:, :, i].unsqueeze(-1)).sum(dim=-2)
        delta = (v[:, :, i] - kv_mem) * beta[:, :, i].unsqueeze(-1)
        s = s + k[:, :, i].unsqueeze(-1) * delta.unsqueeze(-2)
        out[:, :, i] = (s * q[:, :, i].unsqueeze(-1)).sum(dim=-2)
    return out, s


def gated_delta_rule_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                               beta: torch.Tensor, state: torch.Tensor, chunked: bool
                               ) -> tuple[torch.Tensor, torch.Tensor]:
    """q, k [B, n, Hk, Dk] (before L2 normalization), v [B, n, Hv, Dv], g (log decay) and beta
    [B, n, Hv], state [B, Hv, Dk, Dv] float32 (the state before the first token) -> (out [B, n, Hv,
    Dv] in v's dtype, the state after the last token). `chunked`: the chunked form (prefill), else
    token by token (decode); the same function, rounded differently."""
    dtype = v.dtype
    q, k, v, g, beta = _prepare(q, k, v, g, beta)
    initial = state.to(torch.float32)
    out, final = (_chunked(q, k, v, g, beta, initial) if chunked else _recurrent(q, k, v, g, beta, initial))
    return out.transpose(1, 2).contiguous().to(dtype), final


class GatedRMSNorm(nn.Module):
    """RMSNorm of each head's output (float32, weight applied after rounding back) times SiLU(gate)."""

    def __init__(self, size: int, eps: float, dtype: Optional[torch.dtype]) -> None:
        super().__init__()
        self.eps = eps
        self.weight = plain_parameter(size, dtype=dtype)

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        normed = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps)
        return (self.weight * normed.to(dtype) * F.silu(gate.float())).to(dtype)


class GatedDeltaNet(nn.Module):
    """One Gated DeltaNet layer over a flat batch. `projection`: "grouped" (Qwen3-Next:
    in_proj_qkvz / in_proj_ba, each key head's q, k, its value heads' v and z together) or "split"
    (Qwen3.5: one `in_proj` fused from in_proj_qkv / in_proj_z / in_proj_b / in_proj_a)."""

    def __init__(self, config: Any, dtype: torch.dtype, quant_method: QuantizationMethod,
                 projection: str = "split") -> None:
        super().__init__()
        self.hk, self.hv = int(config.linear_num_key_heads), int(config.linear_num_value_heads)
        self.dk, self.dv = int(config.linear_key_head_dim), int(config.linear_value_head_dim)
        self.kernel = int(config.linear_conv_kernel_dim)
        self.key_dim, self.value_dim = self.hk * self.dk, self.hv * self.dv
        self.conv_dim = 2 * self.key_dim + self.value_dim
        self.projection = projection
        hidden = config.hidden_size
        if projection == "grouped":
            self.in_proj_qkvz = Linear(hidden, 2 * self.key_dim + 2 * self.value_dim, dtype=dtype,
                                       quant_method=quant_method)
            self.in_proj_ba = Linear(hidden, 2 * self.hv, dtype=dtype, quant_method=quant_method)
        elif projection == "split":
            self.in_proj = Linear(hidden, [self.conv_dim, self.value_dim, self.hv, self.hv], dtype=dtype,
                                  quant_method=quant_method)
        else:
            raise ValueError(f"Gated DeltaNet projection must be 'grouped' or 'split', got {projection!r}")
        self.conv1d = DepthwiseConv(self.conv_dim, self.kernel, False, dtype)
        self.dt_bias = plain_parameter(self.hv, dtype=dtype)
        self.A_log = plain_parameter(self.hv, dtype=dtype)
        self.norm = GatedRMSNorm(self.dv, float(config.rms_norm_eps), dtype)
        self.out_proj = Linear(self.value_dim, hidden, dtype=dtype, quant_method=quant_method)
        self.state_spec = RecurrentStateSpec.conv_and_recurrent(
            "gated_deltanet", self.conv_dim, self.kernel, dtype, (self.hv, self.dk, self.dv))
        self.state: dict[str, torch.Tensor] = {}      # the state cache's slot tensors (core/state_cache.py)
        self.attn = None          # no paged attention: the model lists only its attention layers' `attn`
        self._kernel: Any = None

    def use_kernel(self, kernel: Any) -> None:
        """A platform's `gated_delta_rule` op (core/layers/kernels.py); may return NotImplemented."""
        self._kernel = kernel

    def delta_rule(self, q, k, v, g, beta, state, chunked: bool) -> tuple[torch.Tensor, torch.Tensor]:
        if self._kernel is not None:
            out = self._kernel(q, k, v, g, beta, state, chunked)
            if out is not NotImplemented:
                return out
        return gated_delta_rule_reference(q, k, v, g, beta, state, chunked)

    def _project(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """(mixed q|k|v [T, conv_dim], z [T, Hv, Dv], b [T, Hv], a [T, Hv])."""
        t = x.shape[0]
        if self.projection == "split":
            qkv, z, b, a = self.in_proj(x).split([self.conv_dim, self.value_dim, self.hv, self.hv], dim=-1)
            return qkv, z.reshape(t, self.hv, self.dv), b, a
        r = self.hv // self.hk
        qkvz = self.in_proj_qkvz(x).view(t, self.hk, 2 * self.dk + 2 * r * self.dv)
        q, k, v, z = qkvz.split([self.dk, self.dk, r * self.dv, r * self.dv], dim=-1)
        b, a = self.in_proj_ba(x).view(t, self.hk, 2 * r).split([r, r], dim=-1)
        qkv = torch.cat((q.reshape(t, -1), k.reshape(t, -1), v.reshape(t, -1)), dim=-1)
        return qkv, z.reshape(t, self.hv, self.dv), b.reshape(t, self.hv), a.reshape(t, self.hv)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, attn_metadata: Any) -> torch.Tensor:
        batch: Optional[RecurrentBatch] = getattr(attn_metadata, "state", None)
        if batch is None or not self.state:
            raise RuntimeError("a Gated DeltaNet layer needs the step's recurrent-state slots "
                               "(attn_metadata.state, set by the model runner from the state cache)")
        qkv, z, b, a = self._project(hidden)
        beta = b.sigmoid()
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)
        qsl = attn_metadata.query_start_loc_cpu
        out = torch.empty(hidden.shape[0], self.hv, self.dv, dtype=hidden.dtype, device=hidden.device)
        nd = batch.decode_rows
        if nd:
            self._decodes(qkv[:nd], g[:nd], beta[:nd], batch, out)
        for e in range(nd, len(batch.slots)):
            lo, hi = qsl[e], qsl[e + 1]
            slot, fresh = batch.slots[e], batch.starts[e] == 0
            mixed = F.silu(self.conv1d.prefill(qkv[lo:hi], self.state["conv"][slot], fresh))
            q, k, v = self._heads(mixed.to(hidden.dtype), 1)
            ssm = self.state["ssm"][slot]
            initial = torch.zeros_like(ssm) if fresh else ssm
            o, final = self.delta_rule(q, k, v, g[lo:hi].unsqueeze(0), beta[lo:hi].unsqueeze(0),
                                       initial.unsqueeze(0), chunked=True)
            ssm.copy_(final[0])
            out[lo:hi] = o[0]
        normed = self.norm(out.reshape(-1, self.dv), z.reshape(-1, self.dv))
        return self.out_proj(normed.reshape(hidden.shape[0], self.value_dim))

    def _heads(self, mixed: torch.Tensor, batch: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q, k, v = mixed.split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        return (q.reshape(batch, -1, self.hk, self.dk), k.reshape(batch, -1, self.hk, self.dk),
                v.reshape(batch, -1, self.hv, self.dv))

    def _decodes(self, qkv: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, batch: RecurrentBatch,
                 out: torch.Tensor) -> None:
        """The first `decode_rows` entries, one token each, in one recurrent step (states gathered
        by slot and written back; an entry starting its sequence here starts from zeros)."""
        n = qkv.shape[0]
        slots, fresh = decode_slots(batch, n)
        ssm = self.state["ssm"][slots]                                           # a gathered copy
        if fresh:
            ssm[fresh] = 0
        mixed = F.silu(self.conv1d.decode(qkv, self.state["conv"], slots, fresh))
        q, k, v = self._heads(mixed.to(out.dtype), n)
        o, final = self.delta_rule(q, k, v, g.unsqueeze(1), beta.unsqueeze(1), ssm, chunked=False)
        self.state["ssm"].index_copy_(0, slots, final)
        out[:n] = o[:, 0]
