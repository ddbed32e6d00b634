"""Hybrid Gated DeltaNet families: Qwen3-Next (`qwen3_next`) and Qwen3.5 text, dense (`qwen3_5_text`)
and MoE (`qwen3_5_moe_text`).

The shared decoder network (core/models/decoder.py) with two token mixers: on `linear_attention`
layers a Gated DeltaNet (core/layers/gated_deltanet.py, its per-sequence state in the state cache:
core/state_cache.py), on `full_attention` layers gated attention (`GatedAttention`: the query
projection carries a per-head output gate, q/k RMSNorms per head, partial rotary) over the paged KV
cache. Every norm is (1 + w); the FFN is Qwen2-MoE's router, experts and gated shared expert (Qwen3-
Next, Qwen3.5-MoE) or a dense SwiGLU (Qwen3.5).

First cut, said in the refusals (`check_engine_config`): one rank (the DeltaNet layers are not split
over tensor-parallel ranks) and no speculative decoding (the state cannot roll back rejected drafts).
Prefix caching works through the state cache's checkpoints at block boundaries (core/state_cache.py).
"""
from __future__ import annotations

import dataclasses
import logging
from typing import Any, ClassVar, Optional

import torch
from torch import nn

from tokenmill.platforms.interface import LayerStructure
from tokenmill.quantization.interface import QuantizationMethod

from .. import distributed
from ..layers.attention import Attention
from ..layers.gated_deltanet import GatedDeltaNet
from ..layers.linear import Linear
from .decoder import head_dim, layer_type
from .moe_families import MOE_FEATURES, Qwen2MoeForCausalLM

logger = logging.getLogger("tokenmill.models")

HYBRID_FEATURES: dict[str, tuple[bool, str]] = {
    **MOE_FEATURES,
    "tp": (False, "Gated DeltaNet layers are not split over ranks yet: tensor_parallel_size=1"),
    "pp": (False, "one stage holds every recurrent layer's state: pipeline_parallel_size=1"),
    "lora": (False, "not supported on hybrid models"),
    "fast_path": (False, "recurrent layers: decode steps run eagerly (no native step carries their state)"),
    "sliding_window": (False, "no sliding windows in these families"),
    "pooling": (False, "generation only"),
}


def is_linear_layer(config: Any, layer_idx: int) -> bool:
    return layer_type(config, layer_idx) == "linear_attention"


class GatedAttention(nn.Module):
    """Qwen3-Next's full attention: q_proj gives each head's query and its output gate side by side
    ([H, 2 D]); q and k RMSNormed per head ((1 + w)), rotary on the leading dims, attention over the
    paged cache, the output times sigmoid(gate), then o_proj."""

    def __init__(self, config: Any, layer_idx: int, family: Any, rotary: Any, attn_backend_cls: type,
                 dtype: torch.dtype, kv_cache_dtype: str, quant_method: QuantizationMethod) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = getattr(config, "num_key_value_heads", None) or self.num_heads
        self.head_dim = d = head_dim(config)
        bias = family.qkv_bias(config)
        self.qkv_proj = Linear(config.hidden_size, [self.num_heads * 2 * d, self.num_kv_heads * d,
                                                    self.num_kv_heads * d], bias=bias, dtype=dtype,
                               quant_method=quant_method)
        self.o_proj = Linear(self.num_heads * d, config.hidden_size, bias=bias, dtype=dtype, quant_method=quant_method)
        self.q_norm = family.make_norm(config, d, dtype)
        self.k_norm = family.make_norm(config, d, dtype)
        self.rotary_emb = rotary
        self.attn = Attention(self.num_heads, d, family.attention_scale(config), self.num_kv_heads, attn_backend_cls,
                              kv_cache_dtype=kv_cache_dtype)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, attn_metadata: Any) -> torch.Tensor:
        t, h, hkv, d = hidden.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        qkv = self.qkv_proj(hidden)
        q_gate = qkv[:, :2 * h * d].view(t, h, 2 * d)
        gate = q_gate[..., d:].reshape(t, h * d)
        k = qkv[:, 2 * h * d:2 * h * d + hkv * d].view(t, hkv, d)
        v = qkv[:, 2 * h * d + hkv * d:]
        qk = torch.cat((self.q_norm(q_gate[..., :d]), self.k_norm(k)), dim=1)
        if self.rotary_emb is not None:
            qk = self.rotary_emb(positions, qk)
        out = self.attn(qk[:, :h].flatten(1), qk[:, h:].flatten(1), v, attn_metadata)
        return self.o_proj(out * torch.sigmoid(gate))


class Qwen3NextForCausalLM(Qwen2MoeForCausalLM):
    """Qwen3-Next: Gated DeltaNet on `linear_attention` layers (in_proj_qkvz / in_proj_ba grouped per
    key head), gated attention on `full_attention` ones, Qwen2-MoE's experts with the gated shared
    expert (dense where mlp_only_layers / decoder_sparse_step say), (1 + w) norms."""
    norm_offset = 1.0
    qk_norm = "head"
    features = HYBRID_FEATURES
    caches_prefix_state: ClassVar[bool] = True      # prefix caching through state checkpoints (core/state_cache.py)
    gdn_projection: ClassVar[str] = "grouped"
    packed_modules_mapping: ClassVar[dict[str, list[tuple[str, int]]]] = {
        "qkv_proj": [("q_proj", 0), ("k_proj", 1), ("v_proj", 2)],
        "gate_up_proj": [("gate_proj", 0), ("up_proj", 1)],
    }

    @classmethod
    def qkv_bias(cls, config: Any) -> bool:
        return bool(getattr(config, "attention_bias", False))

    o_bias = qkv_bias

    @staticmethod
    def attention_cls(config: Any, layer_idx: int, family: Any, rotary: Any, attn_backend_cls: type,
                      dtype: torch.dtype, kv_cache_dtype: str, quant_method: QuantizationMethod) -> nn.Module:
        """The layer's token mixer (core/models/decoder.py DecoderLayer builds it as `self_attn`)."""
        if is_linear_layer(config, layer_idx):
            return GatedDeltaNet(config, dtype, quant_method, family.gdn_projection)
        return GatedAttention(config, layer_idx, family, rotary, attn_backend_cls, dtype, kv_cache_dtype,
                              quant_method)

    @classmethod
    def layer_structure(cls, config: Any, layer_idx: int) -> LayerStructure:
        structure = super().layer_structure(config, layer_idx)
        if is_linear_layer(config, layer_idx):      # no rotary, no KV: a recurrent state instead
            return dataclasses.replace(structure, attention="gated_deltanet", rotary="none", rotary_dim=None)
        return dataclasses.replace(structure, attention="gated_mha")

    @classmethod
    def check_engine_config(cls, config: Any) -> None:
        """What this first cut of the hybrid families refuses or turns off, before the weights load."""
        name = cls.__name__
        parallel = config.parallel
        if parallel.tensor_parallel_size > 1 or parallel.pipeline_parallel_size > 1:
            raise ValueError(f"{name}: tensor_parallel_size/pipeline_parallel_size > 1 are not supported on models "
                             "with recurrent-state layers yet; use 1")
        if parallel.distributed_executor_backend not in (None, "uni"):
            raise ValueError(f"{name}: distributed_executor_backend {parallel.distributed_executor_backend!r}: the "
                             "recurrent state slots are the in-process runner's only (use 'uni')")
        if config.speculative.method:
            raise ValueError(f"speculative decoding ({config.speculative.method!r}) is not supported on {name}: "
                             "its recurrent layers' state cannot be rolled back for rejected draft tokens")
        if config.model.runner == "pooling" or config.lora.enable_lora:
            raise ValueError(f"{name}: {'runner=pooling' if config.model.runner == 'pooling' else 'enable_lora'} is "
                             "not supported on models with recurrent layers yet")
        # Families sharing these refusals opt in to prefix caching (state checkpoints) once checked.
        if config.cache.enable_prefix_caching and not getattr(cls, "caches_prefix_state", False):
            config.cache.enable_prefix_caching = False
            logger.info("%s: prefix caching disabled: this family's recurrent layers are not yet checked with the "
                        "state checkpoints at block boundaries (core/state_cache.py)", name)

    def __init__(self, hf_config: Any, *args: Any, **kwargs: Any) -> None:
        if distributed.tp_size() > 1 or distributed.get_state().pp_size > 1:
            raise ValueError(f"{type(self).__name__}: recurrent layers run on one rank only")
        super().__init__(hf_config, *args, **kwargs)
        layers = self.model.layers
        self.attention_layers: list[Attention] = [layer.self_attn.attn for layer in layers
                                                  if isinstance(layer.self_attn, GatedAttention)]
        # The layers with a per-sequence state: the model runner gives them their slots.
        self.recurrent_layers: list[GatedDeltaNet] = [layer.self_attn for layer in layers
                                                      if isinstance(layer.self_attn, GatedDeltaNet)]

    def checkpoint_name(self, name: str) -> Optional[str]:
        """DeltaNet layers' tensors (linear_attn.*) live in the layer's token-mixer slot here; the
        multi-token-prediction head (mtp.*) is not used."""
        if name.startswith("mtp."):
            return None
        return super().checkpoint_name(name.replace(".linear_attn.", ".self_attn.", 1))

    def decoder_stack(self) -> Any:
        raise NotImplementedError(f"{type(self).__name__}: recurrent layers are outside the decode programs' "
                                  "layer vocabulary")


class Qwen3_5ForCausalLM(Qwen3NextForCausalLM):
    """Qwen3.5 (text, dense): Qwen3-Next's layers with the DeltaNet's projections stored apart
    (in_proj_qkv, in_proj_z, in_proj_b, in_proj_a: fused here into one `in_proj`) and a dense SwiGLU on
    every layer. (Its rope is multimodal in transformers; for text its three position rows are equal,
    which is plain rope.)"""
    gdn_projection = "split"
    packed_modules_mapping = {
        **Qwen3NextForCausalLM.packed_modules_mapping,
        "in_proj": [("in_proj_qkv", 0), ("in_proj_z", 1), ("in_proj_b", 2), ("in_proj_a", 3)],
    }

    @classmethod
    def is_moe_layer(cls, config: Any, layer_idx: int) -> bool:
        return False


class Qwen3_5MoeForCausalLM(Qwen3_5ForCausalLM):
    """Qwen3.5-MoE (text): Qwen3.5's layers with experts on every layer, the top-k weights always
    renormalized, and the gated shared expert."""

    @classmethod
    def is_moe_layer(cls, config: Any, layer_idx: int) -> bool:
        return True

    @classmethod
    def renormalize(cls, config: Any) -> bool:
        return True

