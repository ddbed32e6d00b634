"""Falcon-H1 (`falcon_h1`): attention and Mamba-2 side by side in every layer.

The shared decoder network (core/models/decoder.py) whose token mixer is `ParallelMixer`: the normed
input goes to a Mamba-2 layer (core/layers/mamba2.py) and, times attention_in_multiplier, to rope
attention; their outputs, times ssm_out_multiplier and attention_out_multiplier, are summed. Falcon-H1's
other µP multipliers: the Mamba-2 input times ssm_in_multiplier and its in_proj output times a per-
section vector (ssm_multipliers over z, x, B, C, dt), keys times key_multiplier (folded into the
attention scale), the MLP's gate times mlp_multipliers[0] and its output times mlp_multipliers[1],
embeddings times embedding_multiplier, logits times lm_head_multiplier. The Mamba-2 norm is gated
before or after normalizing (mamba_norm_before_gate), or absent (mamba_rms_norm False: y * SiLU(z)).

What the recurrent layers refuse or turn off is the other Mamba-2 families' (mamba_hybrids.py).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.quantization.interface import QuantizationMethod

from ..layers.mamba2 import GroupGatedRMSNorm, Mamba2Mixer
from .decoder import DecoderAttention, DecoderMLP, head_dim
from .llama import LlamaForCausalLM
from .mamba_hybrids import MambaHybridMixin, _check_mamba_act, _geometry


def _mup_vector(config: Any, inner: int, group_state: int, heads: int) -> torch.Tensor:
    """The in_proj output's multipliers by section (transformers' compute_mup_vector)."""
    sizes = (inner, inner, group_state, group_state, heads)
    return torch.cat([torch.full((n,), float(m)) for n, m in zip(sizes, config.ssm_multipliers)])


class FalconMamba(Mamba2Mixer):
    """Mamba-2 with Falcon-H1's input and projection multipliers and its norm variants."""

    def __init__(self, config: Any, dtype: torch.dtype, quant_method: QuantizationMethod) -> None:
        _check_mamba_act(config, "hidden_act")
        geometry = _geometry(config, "mamba_", "mamba_n_heads", "mamba_d_head", "mamba_n_groups", "mamba_d_state")
        geometry = dataclasses.replace(geometry, out_bias=bool(getattr(config, "projectors_bias", False)))
        super().__init__(geometry, dtype, quant_method)
        g = self.g
        inner = getattr(config, "mamba_d_ssm", None) or int(config.mamba_expand * config.hidden_size)
        if inner != g.inner:
            raise ValueError(f"FalconH1: mamba_d_ssm {inner} != mamba_n_heads * mamba_d_head {g.inner}")
        self.in_scale = float(config.ssm_in_multiplier)
        self.register_buffer("mup", _mup_vector(config, g.inner, g.groups * g.state, g.heads).to(dtype),
                             persistent=False)
        self.rms_norm = bool(config.mamba_rms_norm)
        self.norm = GroupGatedRMSNorm(g.inner, g.groups, g.eps, dtype,
                                      before_gate=bool(config.mamba_norm_before_gate)) if self.rms_norm else None

    def project(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.in_proj(hidden * self.in_scale) * self.mup

    def gated_norm(self, y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        return self.norm(y, z) if self.rms_norm else y * F.silu(z)


class ParallelMixer(nn.Module):
    """Mamba-2 and attention over the same normed input, summed with their multipliers."""

    def __init__(self, config: Any, layer_idx: int, family: Any, rotary: Any, attn_backend_cls: type,
                 dtype: torch.dtype, kv_cache_dtype: str, quant_method: QuantizationMethod) -> None:
        super().__init__()
        self.mamba = FalconMamba(config, dtype, quant_method)
        self.attention = DecoderAttention(config, layer_idx, family, rotary, attn_backend_cls, dtype, kv_cache_dtype,
                                          quant_method)
        self.attn_in = float(config.attention_in_multiplier)
        self.attn_out = float(config.attention_out_multiplier)
        self.ssm_out = float(config.ssm_out_multiplier)
        self.attn = None          # the model lists `attention.attn` among its attention layers

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, attn_metadata: Any) -> torch.Tensor:
        ssm = self.mamba(positions, hidden, attn_metadata) * self.ssm_out
        return ssm + self.attention(positions, hidden * self.attn_in, attn_metadata) * self.attn_out


class FalconMLP(nn.Module):
    """The gated MLP with Falcon-H1's gate and output multipliers (`ffn` is the decoder's MLP)."""

    def __init__(self, ffn: DecoderMLP, gate_multiplier: float, down_multiplier: float, size: int) -> None:
        super().__init__()
        self.ffn, self.size = ffn, size
        self.gate_multiplier, self.down_multiplier = gate_multiplier, down_multiplier

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.ffn.up(x)
        h = torch.cat((h[..., :self.size] * self.gate_multiplier, h[..., self.size:]), dim=-1)
        return self.ffn.down(self.ffn.act_fn(h)) * self.down_multiplier


class FalconH1ForCausalLM(MambaHybridMixin, LlamaForCausalLM):
    """Falcon-H1: Llama's pre-norm layers (`pre_ff_layernorm` before the SwiGLU `feed_forward`,
    `final_layernorm`) with `ParallelMixer` as the token mixer of every layer."""
    norm_names = {"ffn_in": "pre_ff_layernorm"}

    @classmethod
    def is_mamba_layer(cls, config: Any, layer_idx: int) -> bool:
        return False              # every layer holds both: ParallelMixer

    @staticmethod
    def attention_cls(*args: Any) -> nn.Module:
        return ParallelMixer(*args)

    @classmethod
    def attention_scale(cls, config: Any) -> float:
        return head_dim(config) ** -0.5 * float(config.key_multiplier)

    @classmethod
    def embedding_scale(cls, config: Any) -> float:
        return float(config.embedding_multiplier)

    @classmethod
    def logit_scale(cls, config: Any) -> float:
        return float(config.lm_head_multiplier)

    def __init__(self, hf_config: Any, *args: Any, **kwargs: Any) -> None:
        super().__init__(hf_config, *args, **kwargs)
        gate, down = (float(m) for m in hf_config.mlp_multipliers)
        for layer in self.model.layers:
            layer.mlp = FalconMLP(layer.mlp, gate, down, int(hf_config.intermediate_size))

    def checkpoint_name(self, name: str) -> Optional[str]:
        name = (name.replace(".self_attn.", ".self_attn.attention.", 1).replace(".mamba.", ".self_attn.mamba.", 1)
                .replace(".feed_forward.", ".mlp.ffn.", 1).replace("model.final_layernorm.", "model.norm.", 1))
        return LlamaForCausalLM.checkpoint_name(self, name)
