"""Mamba-2 (Mamba2, Bamba, Granite 4, Nemotron-H, Falcon-H1): a state-space token mixer with a
fixed-size state.

Per token: in_proj gives the gate z [I], xBC [I + 2 G N] and dt [H]; xBC goes through a causal
depthwise conv of width `kernel` (with bias) and SiLU and splits into x [H, P], B and C [G, N] (each
of the G groups serves H / G heads); per head a state S [P, N] (float32) decays by exp(A dt) and takes
dt x B^T, and is read as y = S C + D x, with A = -exp(A_log) and dt = softplus(dt + dt_bias) clamped
to time_step_limit. Then y * SiLU(z) is RMS-normalized per group (transformers' MambaRMSNormGated,
norm_before_gate=False) and goes through out_proj.

The state per sequence lives in the state cache (core/state_cache.py): `state["conv"]` [slots,
conv_dim, kernel - 1] (the conv's last inputs) and `state["ssm"]` [slots, H, P, N]. A step's prefill
chunks run the chunked (SSD) form (transformers' `mamba2_chunk_scan`: chunk_size-token blocks,
intra-chunk attention-like products and a scan of the chunk states) from the sequence's cached state;
its decodes run the recurrent form for all of them at once. The scan is the op `ssd_scan(x, dt, A, B,
C, D, dt_bias, dt_limit, state, chunked, chunk_size)` a platform may supply (LayerKernels, returning
NotImplemented for what it does not take); `ssd_scan_reference` is the torch one.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.quantization.interface import QuantizationMethod

from ..state_cache import RecurrentBatch, RecurrentStateSpec
from .linear import Linear
from .short_conv import DepthwiseConv, decode_slots
from .params import plain_parameter


@dataclass(frozen=True)
class Mamba2Geometry:
    """One family's reading of its config (each names these its own way)."""
    hidden: int
    heads: int
    head_dim: int
    groups: int
    state: int                      # N, the state size per head dim
    kernel: int
    chunk: int
    eps: float
    proj_bias: bool = False
    conv_bias: bool = True
    out_bias: Optional[bool] = None             # None: proj_bias (Falcon-H1 names it apart)
    dt_limit: tuple[float, float] = (0.0, float("inf"))

    @property
    def inner(self) -> int:
        return self.heads * self.head_dim

    @property
    def conv_dim(self) -> int:
        return self.inner + 2 * self.groups * self.state


def _segment_sum(x: torch.Tensor) -> torch.Tensor:
    """[..., L] -> [..., L, L]: out[i, j] = sum x[j+1..i] below the diagonal, -inf above (transformers')."""
    n = x.size(-1)
    x = x[..., None].expand(*x.size(), n)
    x = x.masked_fill(~torch.tril(torch.ones(n, n, dtype=torch.bool, device=x.device), diagonal=-1), 0)
    out = torch.cumsum(x, dim=-2)
    return out.masked_fill(~torch.tril(torch.ones(n, n, dtype=torch.bool, device=x.device), diagonal=0), -torch.inf)


def _chunks(x: torch.Tensor, pad: int, chunk: int) -> torch.Tensor:
    """[b, n, ...] -> [b, c, chunk, ...], zero-padded to whole chunks."""
    x = F.pad(x, (0, 0) * (x.dim() - 2) + (0, pad))
    return x.reshape(x.shape[0], -1, chunk, *x.shape[2:])


def _chunked(x, dt, A, B, C, state: torch.Tensor, chunk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [b, n, H, P] float32 (already times dt), dt [b, n, H], A [H], B/C [b, n, H, N] -> (y without
    the D skip, final state): transformers' mamba2_chunk_scan with its order of operations."""
    n = x.shape[1]
    pad = (chunk - n % chunk) % chunk
    a = A.to(x.dtype) * dt
    x, a, B, C = (_chunks(t, pad, chunk) for t in (x, a, B, C))
    a = a.permute(0, 3, 1, 2)                                              # [b, H, c, l]
    a_cum = torch.cumsum(a, dim=-1)
    L = torch.exp(_segment_sum(a))
    M = torch.einsum("bclhn,bcshn->bclsh", C, B) * L.permute(0, 2, 3, 4, 1)
    y_diag = torch.einsum("bclsh,bcshp->bclhp", M, x)
    decay = torch.exp(a_cum[:, :, :, -1:] - a_cum)
    states = torch.einsum("bclhn,bclhp->bchpn", B * decay.permute(0, -2, -1, 1)[..., None], x)
    states = torch.cat([state[:, None].to(states.dtype), states], dim=1)
    decay_chunk = torch.exp(_segment_sum(F.pad(a_cum[:, :, :, -1], (1, 0)))).transpose(1, 3)
    new_states = torch.einsum("bzch,bzhpn->bchpn", decay_chunk, states)
    states, final = new_states[:, :-1], new_states[:, -1]
    y_off = torch.einsum("bclhn,bchpn->bclhp", C, states) * torch.exp(a_cum).permute(0, 2, 3, 1)[..., None]
    y = (y_diag + y_off).reshape(x.shape[0], -1, *x.shape[3:])
    return y[:, :n], final


def _recurrent(x, dt, A, B, C, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Token by token (transformers' selective_state_update per token): the decode form."""
    out = torch.empty_like(x)
    s = state
    for i in range(x.shape[1]):
        d = dt[:, i, :, None, None]                                        # [b, H, 1, 1]
        s = s * torch.exp(d * A[:, None, None]) + (d * B[:, i, :, None, :]) * x[:, i, :, :, None]
        out[:, i] = (s @ C[:, i, :, :, None])[..., 0]
    return out, s


def ssd_scan_reference(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
                       D: torch.Tensor, dt_bias: torch.Tensor, dt_limit: tuple[float, float], state: torch.Tensor,
                       chunked: bool, chunk_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [b, n, H, P], dt [b, n, H] (before dt_bias and softplus), A [H] (negative, float32), B, C
    [b, n, G, N], D and dt_bias [H], state [b, H, P, N] float32 (before the first token) -> (y [b, n, H,
    P] with the D skip, in x's dtype; the state after the last token). `chunked`: the SSD form over
    `chunk_size` blocks (prefill), else token by token (decode): the same function, rounded differently."""
    dtype, heads = x.dtype, x.shape[2]
    dt = F.softplus(dt + dt_bias.to(dt.dtype))
    dt = torch.clamp(dt, min=dt_limit[0], max=dt_limit[1]).float()
    xf = x.float()
    B = B.float().repeat_interleave(heads // B.shape[2], dim=2)
    C = C.float().repeat_interleave(heads // C.shape[2], dim=2)
    A = A.float()
    initial = state.to(torch.float32)
    if chunked:
        y, final = _chunked(xf * dt[..., None], dt, A, B, C, initial, chunk_size)
    else:
        y, final = _recurrent(xf, dt, A, B, C, initial)
    return (y + D.float()[:, None] * xf).to(dtype), final


class GroupGatedRMSNorm(nn.Module):
    """RMSNorm over each of `groups` equal slices (float32) of x * SiLU(gate) (transformers'
    MambaRMSNormGated, the weight applied after rounding back), or with `before_gate` of x, then times
    the weight and SiLU(gate) (Falcon-H1's norm_before_gate)."""

    def __init__(self, size: int, groups: int, eps: float, dtype: Optional[torch.dtype],
                 before_gate: bool = False) -> None:
        super().__init__()
        self.groups, self.eps, self.before_gate = groups, eps, before_gate
        self.weight = plain_parameter(size, dtype=dtype)

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.float() if self.before_gate else x.float() * F.silu(gate.float())
        g = h.view(*h.shape[:-1], self.groups, -1)
        g = (g * torch.rsqrt(g.pow(2).mean(-1, keepdim=True) + self.eps)).view(h.shape)
        if self.before_gate:
            return (self.weight * g * F.silu(gate.float())).to(dtype)
        return self.weight * g.to(dtype)


class Mamba2Mixer(nn.Module):
    """One Mamba-2 layer over a flat batch (checkpoint names in_proj, conv1d, dt_bias, A_log, D, norm,
    out_proj as every family stores them)."""

    def __init__(self, geometry: Mamba2Geometry, dtype: torch.dtype, quant_method: QuantizationMethod) -> None:
        super().__init__()
        self.g = g = geometry
        self.in_proj = Linear(g.hidden, g.inner + g.conv_dim + g.heads, bias=g.proj_bias, dtype=dtype,
                              quant_method=quant_method)
        self.conv1d = DepthwiseConv(g.conv_dim, g.kernel, g.conv_bias, dtype)
        self.dt_bias = plain_parameter(g.heads, dtype=dtype)
        self.A_log = plain_parameter(g.heads, dtype=dtype)
        self.D = plain_parameter(g.heads, dtype=dtype)
        self.norm = GroupGatedRMSNorm(g.inner, g.groups, g.eps, dtype)
        out_bias = g.proj_bias if g.out_bias is None else g.out_bias
        self.out_proj = Linear(g.inner, g.hidden, bias=out_bias, dtype=dtype, quant_method=quant_method)
        self.state_spec = RecurrentStateSpec.conv_and_recurrent("mamba2", g.conv_dim, g.kernel, dtype,
                                                                (g.heads, g.head_dim, g.state))
        self.state: dict[str, torch.Tensor] = {}      # the state cache's slot tensors (core/state_cache.py)
        self.attn = None          # no paged attention: the model lists only its attention layers' `attn`
        self._kernel: Any = None

    def use_kernel(self, kernel: Any) -> None:
        """A platform's `ssd_scan` op (core/layers/kernels.py); may return NotImplemented."""
        self._kernel = kernel

    def scan(self, x, dt, B, C, state, chunked: bool) -> tuple[torch.Tensor, torch.Tensor]:
        args = (x, dt, -torch.exp(self.A_log.float()), B, C, self.D, self.dt_bias, self.g.dt_limit, state, chunked,
                self.g.chunk)
        if self._kernel is not None:
            out = self._kernel(*args)
            if out is not NotImplemented:
                return out
        return ssd_scan_reference(*args)

    def _split(self, xbc: torch.Tensor, b: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        g = self.g
        x, B, C = xbc.split([g.inner, g.groups * g.state, g.groups * g.state], dim=-1)
        return (x.reshape(b, -1, g.heads, g.head_dim), B.reshape(b, -1, g.groups, g.state),
                C.reshape(b, -1, g.groups, g.state))

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, attn_metadata: Any) -> torch.Tensor:
        batch: Optional[RecurrentBatch] = getattr(attn_metadata, "state", None)
        if batch is None or not self.state:
            raise RuntimeError("a Mamba-2 layer needs the step's recurrent-state slots "
                               "(attn_metadata.state, set by the model runner from the state cache)")
        g = self.g
        z, xbc, dt = self.project(hidden).split([g.inner, g.conv_dim, g.heads], dim=-1)
        qsl = attn_metadata.query_start_loc_cpu
        out = torch.empty(hidden.shape[0], g.heads, g.head_dim, dtype=hidden.dtype, device=hidden.device)
        nd = batch.decode_rows
        if nd:
            self._decodes(xbc[:nd], dt[:nd], batch, out)
        for e in range(nd, len(batch.slots)):
            lo, hi = qsl[e], qsl[e + 1]
            slot, fresh = batch.slots[e], batch.starts[e] == 0
            mixed = F.silu(self.conv1d.prefill(xbc[lo:hi], self.state["conv"][slot], fresh))
            xs, B, C = self._split(mixed.unsqueeze(0).to(hidden.dtype), 1)
            ssm = self.state["ssm"][slot]
            initial = torch.zeros_like(ssm) if fresh else ssm
            y, final = self.scan(xs, dt[lo:hi].unsqueeze(0), B, C, initial.unsqueeze(0), chunked=True)
            ssm.copy_(final[0])
            out[lo:hi] = y[0]
        return self.out_proj(self.gated_norm(out.reshape(hidden.shape[0], g.inner), z))

    def project(self, hidden: torch.Tensor) -> torch.Tensor:
        """z | xBC | dt; a family may scale around in_proj (Falcon-H1's multipliers)."""
        return self.in_proj(hidden)

    def gated_norm(self, y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        return self.norm(y, z)

    def _decodes(self, xbc: torch.Tensor, dt: torch.Tensor, batch: RecurrentBatch, out: torch.Tensor) -> None:
        """The first `decode_rows` entries, one token each, in one recurrent step (states gathered
        by slot and written back; an entry starting its sequence here starts from zeros)."""
        n = xbc.shape[0]
        slots, fresh = decode_slots(batch, n)
        ssm = self.state["ssm"][slots]                                           # a gathered copy
        if fresh:
            ssm[fresh] = 0
        mixed = F.silu(self.conv1d.decode(xbc, self.state["conv"], slots, fresh))
        xs, B, C = self._split(mixed.unsqueeze(1).to(out.dtype), n)
        y, final = self.scan(xs, dt.unsqueeze(1), B, C, ssm, chunked=False)
        self.state["ssm"].index_copy_(0, slots, final)
        out[:n] = y[:, 0]
