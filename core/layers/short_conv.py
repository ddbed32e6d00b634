"""LFM2's gated short convolution, and the causal depthwise conv over a cached state it is built on
(Kimi Delta Attention's q/k/v convs use the same one: core/layers/kimi_delta.py).

Per token: in_proj gives B, C and x ([B | C | x], hidden each); B * x goes through a causal depthwise
conv of width L (`conv_L_cache`), the output is gated by C and projected by out_proj. The conv's
state per sequence is its last L - 1 inputs [hidden, L - 1] (in the state cache, core/state_cache.py:
`state["conv"]`), so a prefill chunk continues from the previous chunk's inputs and a decode is one
step; nothing else is carried between tokens.
"""
from __future__ import annotations

from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.quantization.interface import QuantizationMethod

from ..state_cache import RecurrentBatch, RecurrentStateSpec, StateTensorSpec
from .linear import Linear
from .params import plain_parameter


class DepthwiseConv(nn.Module):
    """Holds a depthwise conv's weight [channels, 1, kernel] (and bias) under the checkpoint's names."""

    def __init__(self, channels: int, kernel: int, bias: bool, dtype: Optional[torch.dtype]) -> None:
        super().__init__()
        self.channels, self.kernel = channels, kernel
        self.weight = plain_parameter(channels, 1, kernel, dtype=dtype)
        self.bias = plain_parameter(channels, dtype=dtype) if bias else None

    def prefill(self, x: torch.Tensor, conv_state: torch.Tensor, fresh: bool) -> torch.Tensor:
        """One sequence's chunk x [n, C] after the inputs `conv_state` [C, kernel - 1] holds (zeros
        when `fresh`: the sequence starts here) -> the conv's outputs [n, C] in x's dtype; the state
        is updated in place to the chunk's last kernel - 1 inputs."""
        prev = torch.zeros_like(conv_state) if fresh else conv_state
        window = torch.cat((prev, x.t().to(prev.dtype)), dim=-1)              # [C, kernel - 1 + n]
        conv_state.copy_(window[:, window.shape[1] - (self.kernel - 1):])
        out = F.conv1d(window.unsqueeze(0).to(self.weight.dtype), self.weight, self.bias, groups=self.channels)
        return out[0].t().to(x.dtype)

    def decode(self, x: torch.Tensor, states: torch.Tensor, slots: torch.Tensor, fresh: list[int]) -> torch.Tensor:
        """One token per sequence, x [n, C], the sequences' slots in `states` [slots, C, kernel - 1]
        (rows listed in `fresh` start from zeros) -> [n, C]; the states are written back by slot."""
        prev = states[slots]                                                  # a gathered copy
        if fresh:
            prev[fresh] = 0
        window = torch.cat((prev, x.unsqueeze(-1).to(prev.dtype)), dim=-1)    # [n, C, kernel]
        states.index_copy_(0, slots, window[:, :, 1:])
        out = F.conv1d(window.to(self.weight.dtype), self.weight, self.bias, groups=self.channels)
        return out[:, :, 0].to(x.dtype)


def decode_slots(batch: RecurrentBatch, n: int) -> tuple[torch.Tensor, list[int]]:
    """The first `n` entries' slot tensor and which of them start their sequence in this step."""
    slots = batch.slots_t[:n] if batch.slots_t is not None else torch.tensor(batch.slots[:n])
    return slots, [i for i in range(n) if batch.starts[i] == 0]


def recurrent_batch(attn_metadata: Any, layer: nn.Module) -> RecurrentBatch:
    batch: Optional[RecurrentBatch] = getattr(attn_metadata, "state", None)
    if batch is None or not layer.state:
        raise RuntimeError(f"a {type(layer).__name__} layer needs the step's recurrent-state slots "
                           "(attn_metadata.state, set by the model runner from the state cache)")
    return batch


class ShortConv(nn.Module):
    """One LFM2 short-conv layer over a flat batch (the token mixer in its layer's attention slot)."""

    def __init__(self, config: Any, dtype: torch.dtype, quant_method: QuantizationMethod) -> None:
        super().__init__()
        hidden, bias = config.hidden_size, bool(getattr(config, "conv_bias", False))
        self.hidden_size, self.kernel = hidden, int(config.conv_L_cache)
        self.in_proj = Linear(hidden, 3 * hidden, bias=bias, dtype=dtype, quant_method=quant_method)
        self.conv = DepthwiseConv(hidden, self.kernel, bias, dtype)
        self.out_proj = Linear(hidden, hidden, bias=bias, dtype=dtype, quant_method=quant_method)
        self.state_spec = RecurrentStateSpec("short_conv", (StateTensorSpec("conv", (hidden, self.kernel - 1), dtype),))
        self.state: dict[str, torch.Tensor] = {}      # the state cache's slot tensors (core/state_cache.py)
        self.attn = None          # no paged attention: the model lists only its attention layers' `attn`

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, attn_metadata: Any) -> torch.Tensor:
        batch = recurrent_batch(attn_metadata, self)
        b, c, x = self.in_proj(hidden).chunk(3, dim=-1)
        bx = b * x
        conv = torch.empty_like(bx)
        nd, qsl, states = batch.decode_rows, attn_metadata.query_start_loc_cpu, self.state["conv"]
        if nd:
            slots, fresh = decode_slots(batch, nd)
            conv[:nd] = self.conv.decode(bx[:nd], states, slots, fresh)
        for e in range(nd, len(batch.slots)):
            lo, hi = qsl[e], qsl[e + 1]
            conv[lo:hi] = self.conv.prefill(bx[lo:hi], states[batch.slots[e]], batch.starts[e] == 0)
        return self.out_proj(c * conv)
