"""Multi-head latent attention (DeepSeek V2/V3, Kimi K2): the projections and the cache-owning layer.

A token's query comes from q_proj (or the low-rank q_a_proj -> RMSNorm -> q_b_proj), per head a
"nope" part (N dims) and a rotary part (R dims). Its key and value are compressed: kv_a_proj_with_mqa
gives a latent (kv_lora_rank L, RMS-normalized) and one rope key (R dims) shared by every head; the
cache holds only those L + R numbers per token (core/kv_groups.py MLAKVSpec). kv_b_proj [H * (N + V),
L] expands a latent into each head's key nope part and value; the backend applies it, expanded or
absorbed into the query and output (attention_backends/mla.py).
"""
from __future__ import annotations

from typing import Any, Optional

import torch
from torch import nn

from tokenmill.quantization.interface import QuantizationMethod

from .. import distributed
from ..kv_groups import MLAKVSpec
from .linear import Linear
from .norm import RMSNorm
from .rotary import RotaryEmbedding, rope_parameters

# transformers builds q_a_layernorm and kv_a_layernorm with RMSNorm's default eps, not rms_norm_eps.
LATENT_NORM_EPS = 1e-6


def mla_kv_spec(config: Any, tp_size: int = 1) -> MLAKVSpec:
    """The cache of one layer on a rank holding 1/tp_size of the heads (every rank caches the whole
    latent: the heads share it)."""
    heads = int(config.num_attention_heads)
    if heads % tp_size:
        raise ValueError(f"num_attention_heads {heads} does not divide by tensor_parallel_size={tp_size}")
    return MLAKVSpec(int(config.kv_lora_rank), int(config.qk_rope_head_dim), heads // tp_size,
                     int(config.qk_nope_head_dim), int(config.v_head_dim))


def mla_softmax_scale(config: Any) -> float:
    """(N + R) ** -0.5, times mscale(factor, mscale_all_dim) squared under yarn scaling (DeepSeek's
    reference, transformers' yarn_apply_mscale): the yarn factor reaches the nope dims too."""
    scale = float(config.qk_nope_head_dim + config.qk_rope_head_dim) ** -0.5
    params = rope_parameters(config)
    mscale_all_dim = params.get("mscale_all_dim", 0) if params["rope_type"] != "default" else 0
    if mscale_all_dim:
        from transformers.modeling_rope_utils import yarn_get_mscale
        mscale = yarn_get_mscale(params["factor"], mscale_all_dim)
        scale = scale * mscale * mscale
    return scale


class MLAAttention(nn.Module):
    """The paged attention of one MLA layer: what the model runner gives a cache (its `kv_spec`
    sizes it: [num_blocks, block_size, L + R]) and the backend's `forward_mla` runs on."""

    def __init__(self, spec: MLAKVSpec, scale: float, attn_backend_cls: type, kv_cache_dtype: str = "auto") -> None:
        super().__init__()
        if not getattr(attn_backend_cls, "supports_mla", False):
            raise ValueError(f"attention backend {getattr(attn_backend_cls, 'name', attn_backend_cls)!r}: "
                             "multi-head latent attention (MLA) not supported")
        self.kv_spec = spec
        self.num_heads, self.num_kv_heads, self.head_size = spec.num_heads, 1, spec.width
        self.scale = scale
        self.sliding_window: Optional[int] = None
        self.impl = attn_backend_cls(spec.num_heads, spec.width, scale, 1, kv_cache_dtype=kv_cache_dtype)
        self.kv_cache: Optional[torch.Tensor] = None
        self.kv_group = 0

    def forward(self, q_nope: torch.Tensor, q_pe: torch.Tensor, latent: torch.Tensor, k_pe: torch.Tensor,
                kv_b_weight: torch.Tensor, attn_metadata) -> torch.Tensor:
        """q_nope [T, H, N], q_pe [T, H, R], latent [T, L], k_pe [T, R] -> [T, H * V]."""
        if self.kv_cache is None:
            raise RuntimeError("MLAAttention.kv_cache is not set; the model runner must assign it before forward")
        if attn_metadata.groups is not None:
            attn_metadata = attn_metadata.groups[self.kv_group]
        out = self.impl.forward_mla(q_nope, q_pe, latent, k_pe, self.kv_cache, attn_metadata, kv_b_weight)
        return out.reshape(q_nope.shape[0], -1)


class DeepseekAttention(nn.Module):
    """DeepSeek's attention block, built as core/models/decoder.py builds DecoderAttention."""

    def __init__(self, config: Any, layer_idx: int, family: Any, rotary: Optional[RotaryEmbedding],
                 attn_backend_cls: type, dtype: torch.dtype, kv_cache_dtype: str,
                 quant_method: QuantizationMethod) -> None:
        super().__init__()
        # Tensor parallelism: each rank holds 1/tp of the heads (q, kv_b and o split by head); the
        # latent projection, its norm and the cache are whole on every rank.
        self.spec = spec = mla_kv_spec(config, distributed.tp_size())
        h, hidden = int(config.num_attention_heads), config.hidden_size
        bias = bool(getattr(config, "attention_bias", False))
        self.q_lora_rank = getattr(config, "q_lora_rank", None)
        q_width = h * (spec.qk_nope_head_dim + spec.qk_rope_head_dim)
        linear: dict[str, Any] = dict(dtype=dtype, quant_method=quant_method)
        if self.q_lora_rank is None:              # DeepSeek-V2-Lite: a plain query projection
            self.q_proj = Linear(hidden, q_width, parallel="column", **linear)
        else:
            self.q_a_proj = Linear(hidden, self.q_lora_rank, bias=bias, **linear)
            self.q_a_layernorm = RMSNorm(self.q_lora_rank, LATENT_NORM_EPS, dtype)
            self.q_b_proj = Linear(self.q_lora_rank, q_width, parallel="column", **linear)
        self.kv_a_proj_with_mqa = Linear(hidden, spec.width, bias=bias, **linear)
        self.kv_a_layernorm = RMSNorm(spec.kv_lora_rank, LATENT_NORM_EPS, dtype)
        # Dense whatever the quantization: the backend reads it as a matrix (W_UK / W_UV per head).
        self.kv_b_proj = Linear(spec.kv_lora_rank, h * (spec.qk_nope_head_dim + spec.v_head_dim), dtype=dtype,
                                parallel="column")
        self.o_proj = Linear(h * spec.v_head_dim, hidden, bias=bias, parallel="row", **linear)
        if rotary is None and family.uses_rope(config, layer_idx):
            raise ValueError(f"{family.__name__}: MLA rotates its rope dims; the layer has no rotary table")
        self.rotary_emb = rotary          # None: NoPE (Kimi Linear keeps the shared key dims unrotated)
        # DeepSeek-V3 checkpoints store each rope part as interleaved pairs that transformers
        # de-interleaves (evens, then odds) and rotates by halves (config.rope_interleave).
        self.deinterleave = bool(family.deinterleave_rope(config))
        self.attn = MLAAttention(spec, mla_softmax_scale(config), attn_backend_cls, kv_cache_dtype)

    def query(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.q_lora_rank is None:
            return self.q_proj(hidden)
        return self.q_b_proj(self.q_a_layernorm(self.q_a_proj(hidden)))

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, attn_metadata) -> torch.Tensor:
        spec, t = self.spec, hidden.shape[0]
        q = self.query(hidden).view(t, spec.num_heads, -1)
        q_nope, q_pe = q.split([spec.qk_nope_head_dim, spec.qk_rope_head_dim], dim=-1)
        latent, k_pe = self.kv_a_proj_with_mqa(hidden).split([spec.kv_lora_rank, spec.qk_rope_head_dim], dim=-1)
        latent = self.kv_a_layernorm(latent.contiguous())
        # The query's rope parts and the shared rope key rotate as one [T, H + 1, R] tensor.
        pe = torch.cat((q_pe, k_pe.unsqueeze(1)), dim=1)
        if self.deinterleave:
            pe = torch.cat((pe[..., 0::2], pe[..., 1::2]), dim=-1)
        if self.rotary_emb is not None:
            pe = self.rotary_emb(positions, pe)
        out = self.attn(q_nope, pe[:, :spec.num_heads], latent, pe[:, spec.num_heads],
                        self.kv_b_proj.weight.view(spec.num_heads, -1, spec.kv_lora_rank), attn_metadata)
        return self.o_proj(out)
