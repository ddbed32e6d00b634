"""LFM2 (`lfm2`) and LFM2-MoE (`lfm2_moe`): gated short-convolution layers between attention layers.

The shared decoder network (core/models/decoder.py) with two token mixers: on `conv` layers
(config.layer_types, from full_attn_idxs) LFM2's gated short conv (core/layers/short_conv.py, its last
L_cache - 1 inputs per sequence in the state cache: core/state_cache.py), on `full_attention` layers
Llama's attention with per-head q/k RMSNorms. Pre-norm (operator_norm, ffn_norm), a SwiGLU FFN (w1, w3,
w2; LFM2 shrinks intermediate_size to 2/3, times block_ffn_dim_multiplier, rounded up to
block_multiple_of, where block_auto_adjust_ff_dim says), the final norm stored as embedding_norm.
LFM2-MoE: dense FFNs on the first num_dense_layers, then sigmoid-scored experts picked with a
per-expert bias (feed_forward.expert_bias), renormalized, times routed_scaling_factor.

What the recurrent layers refuse or turn off is Qwen3-Next's (core/models/qwen3_next.py
check_engine_config): one rank, no speculative decoding; prefix caching through the state
checkpoints at block boundaries (core/state_cache.py), as there.
"""
from __future__ import annotations

import copy
import dataclasses
from typing import Any, Optional

import torch
from torch import nn

from tokenmill.platforms.interface import LayerStructure
from tokenmill.quantization.interface import QuantizationMethod

from .. import distributed
from ..layers.attention import Attention
from ..layers.moe import MIXTRAL_EXPERT_NAMES, FusedMoE
from ..layers.norm import RMSNorm
from ..layers.short_conv import ShortConv
from .decoder import DecoderAttention, layer_type
from .llama import LlamaForCausalLM
from .moe_families import MoeForCausalLM
from .qwen3_next import HYBRID_FEATURES, Qwen3NextForCausalLM

LFM2_FEATURES = {**HYBRID_FEATURES, "tp": (False, "short-conv layers are not split over ranks yet: "
                                                  "tensor_parallel_size=1")}
# Checkpoint name -> ours, inside a layer.
_RENAMES = ((".feed_forward.w1.", ".mlp.gate_proj."), (".feed_forward.w3.", ".mlp.up_proj."),
            (".feed_forward.w2.", ".mlp.down_proj."), (".feed_forward.", ".mlp."),
            (".operator_norm.", ".input_layernorm."), (".ffn_norm.", ".post_attention_layernorm."),
            (".self_attn.q_layernorm.", ".self_attn.q_norm."), (".self_attn.k_layernorm.", ".self_attn.k_norm."),
            (".self_attn.out_proj.", ".self_attn.o_proj."), (".conv.", ".self_attn."),
            (".mlp.expert_bias", ".mlp.gate.e_score_correction_bias"))


def is_conv_layer(config: Any, layer_idx: int) -> bool:
    return layer_type(config, layer_idx) == "conv"


def lfm2_ffn_size(config: Any) -> int:
    """LFM2's dense FFN width: transformers' Lfm2MLP rule."""
    size = int(config.intermediate_size)
    if getattr(config, "block_auto_adjust_ff_dim", False):
        size = int(2 * size / 3)
        multiplier = getattr(config, "block_ffn_dim_multiplier", None)
        if multiplier is not None:
            size = int(multiplier * size)
            step = int(config.block_multiple_of)
            size = step * ((size + step - 1) // step)
    return size


class Lfm2ForCausalLM(LlamaForCausalLM):
    """LFM2: short-conv layers and q/k-normed attention layers, Llama's norms and FFN under LFM2's names."""
    qk_norm = "head"
    features = LFM2_FEATURES
    # The recurrent layers' refusals (one rank, no speculative decoding).
    check_engine_config = classmethod(Qwen3NextForCausalLM.check_engine_config.__func__)
    caches_prefix_state = True      # prefix caching through state checkpoints (core/state_cache.py)

    @classmethod
    def make_norm(cls, config: Any, size: int, dtype: torch.dtype) -> nn.Module:
        return RMSNorm(size, float(config.norm_eps), dtype)

    @staticmethod
    def attention_cls(config: Any, layer_idx: int, family: Any, rotary: Any, attn_backend_cls: type,
                      dtype: torch.dtype, kv_cache_dtype: str, quant_method: QuantizationMethod) -> nn.Module:
        if is_conv_layer(config, layer_idx):
            return ShortConv(config, dtype, quant_method)
        return DecoderAttention(config, layer_idx, family, rotary, attn_backend_cls, dtype, kv_cache_dtype,
                                quant_method)

    @classmethod
    def layer_structure(cls, config: Any, layer_idx: int) -> LayerStructure:
        structure = super().layer_structure(config, layer_idx)
        if is_conv_layer(config, layer_idx):      # no rotary, no KV: a conv state instead
            return dataclasses.replace(structure, attention="short_conv", rotary="none", rotary_dim=None)
        return structure

    @classmethod
    def ffn_config(cls, hf_config: Any) -> Any:
        """The config the dense FFNs are built from (LFM2's adjusted width as intermediate_size)."""
        config = copy.copy(hf_config)
        config.intermediate_size = lfm2_ffn_size(hf_config)
        return config

    def __init__(self, hf_config: Any, *args: Any, **kwargs: Any) -> None:
        if distributed.tp_size() > 1 or distributed.get_state().pp_size > 1:
            raise ValueError(f"{type(self).__name__}: recurrent layers run on one rank only")
        super().__init__(self.ffn_config(hf_config), *args, **kwargs)
        layers = self.model.layers
        self.attention_layers: list[Attention] = [layer.self_attn.attn for layer in layers
                                                  if isinstance(layer.self_attn, DecoderAttention)]
        # The layers with a per-sequence state: the model runner gives them their slots.
        self.recurrent_layers: list[ShortConv] = [layer.self_attn for layer in layers
                                                  if isinstance(layer.self_attn, ShortConv)]

    def checkpoint_name(self, name: str) -> Optional[str]:
        if name.startswith("model.embedding_norm."):
            name = "model.norm." + name[len("model.embedding_norm."):]
        for old, new in _RENAMES:
            name = name.replace(old, new, 1)
        return super().checkpoint_name(name)

    def decoder_stack(self) -> Any:
        raise NotImplementedError(f"{type(self).__name__}: recurrent layers are outside the decode programs' "
                                  "layer vocabulary")


class Lfm2MoeForCausalLM(Lfm2ForCausalLM, MoeForCausalLM):
    """LFM2-MoE: LFM2's layers, experts from layer num_dense_layers on (transformers' fused
    experts.{e}.w1 / w3 / w2 as transformers saves them), the dense FFNs at intermediate_size as stored."""
    expert_names = MIXTRAL_EXPERT_NAMES

    @classmethod
    def ffn_config(cls, hf_config: Any) -> Any:
        return hf_config

    @classmethod
    def is_moe_layer(cls, config: Any, layer_idx: int) -> bool:
        return layer_idx >= int(getattr(config, "num_dense_layers", 0) or 0)

    @classmethod
    def make_moe(cls, config: Any, layer_idx: int, dtype: torch.dtype, quant_method: QuantizationMethod) -> FusedMoE:
        return FusedMoE(config.hidden_size, cls.expert_size(config), cls.num_experts(config),
                        int(config.num_experts_per_tok), dtype, quant_method, activation="silu", scoring="sigmoid",
                        renormalize=bool(config.norm_topk_prob), correction_bias=bool(config.use_expert_bias),
                        routed_scaling_factor=float(config.routed_scaling_factor))
