"""DeepSeek-V2 and DeepSeek-V3 (and Kimi K2, a V3): multi-head latent attention (core/layers/mla.py)
over a compressed KV cache, and mixture-of-experts layers with shared experts after the first
`first_k_dense_replace` dense ones. Where the two differ:

* V2 rotates its rope dims as complex numbers over interleaved pairs; its router takes the top-k of
  softmax scores ("greedy", or "group_limited_greedy": only the `topk_group` groups with the best
  single expert are eligible), scaled by routed_scaling_factor, never renormalized.
* V3 stores each rope part interleaved, de-interleaves it and rotates by halves (rope_interleave);
  its router scores with a sigmoid, picks groups and experts by the scores plus
  e_score_correction_bias but weights them by the scores alone, optionally renormalized
  (norm_topk_prob), times routed_scaling_factor.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Optional

import torch

from tokenmill.attention_backends.interface import AttentionConfig
from tokenmill.platforms.interface import DecoderLayerSpec, DecoderStackSpec, LayerStructure
from tokenmill.quantization.interface import QuantizationMethod

from ..layers.mla import DeepseekAttention, mla_kv_spec
from ..layers.moe import FusedMoE
from .decoder import DecoderMLP
from .moe_families import MOE_FEATURES, MoeForCausalLM

DEEPSEEK_FEATURES: dict[str, tuple[bool, str]] = {
    **MOE_FEATURES,
    "tp": (True, "MLA heads (q, kv_b and o projections) split over ranks, each caching the whole latent; "
                 "experts as the other MoE families"),
    "lora": (True, "q (q_proj, q_a_proj, q_b_proj), kv_a_proj_with_mqa, o_proj and the dense layers' gate/up/down; "
                   "not kv_b_proj (MLA reads it as W_UK / W_UV), the experts or the shared experts"),
    "fast_path": (False, "decode steps run eagerly (the cpu native step does not express MLA's latent cache); "
                         "the attention backend decodes in the absorbed form"),
    "sliding_window": (False, "DeepSeek attends over the whole context"),
    "quantization": (True, "int4 / int8 on the projections and the experts; kv_b_proj stays dense (MLA reads it "
                           "as each head's W_UK / W_UV); other methods and quantized checkpoints are refused"),
}


class DeepseekV2ForCausalLM(MoeForCausalLM):
    attention_cls = DeepseekAttention
    interleaved_rope = True                       # V2's complex rotation of adjacent pairs
    weights_in_hidden_dtype = False               # transformers' router weighs in float32
    features = DEEPSEEK_FEATURES
    # q/k/v are not fused here (q_proj is V2-Lite's whole query); only the dense MLPs' gate/up are.
    packed_modules_mapping = {"gate_up_proj": [("gate_proj", 0), ("up_proj", 1)]}
    lora_plain_modules = ("q_proj", "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "o_proj", "down_proj")

    @classmethod
    def deinterleave_rope(cls, config: Any) -> bool:
        return False

    @classmethod
    def num_experts(cls, config: Any) -> int:
        return int(config.n_routed_experts or 0)

    @classmethod
    def is_moe_layer(cls, config: Any, layer_idx: int) -> bool:
        return cls.num_experts(config) > 0 and layer_idx >= int(config.first_k_dense_replace or 0)

    @classmethod
    def layer_structure(cls, config: Any, layer_idx: int) -> LayerStructure:
        return dataclasses.replace(super().layer_structure(config, layer_idx), attention="mla")

    @classmethod
    def router(cls, config: Any) -> dict[str, Any]:
        """FusedMoE's routing switches."""
        grouped = getattr(config, "topk_method", "greedy") == "group_limited_greedy"
        return dict(scoring="softmax", renormalize=False, num_groups=config.n_group if grouped else None,
                    topk_groups=config.topk_group if grouped else None)

    @classmethod
    def shared_expert(cls, config: Any, dtype: torch.dtype, quant_method: QuantizationMethod) -> Optional[DecoderMLP]:
        shared = int(getattr(config, "n_shared_experts", 0) or 0)
        if not shared:
            return None
        return DecoderMLP(config, cls, LayerStructure(activation=cls.activation(config)), dtype, quant_method,
                          size=cls.expert_size(config) * shared)

    @classmethod
    def make_moe(cls, config: Any, layer_idx: int, dtype: torch.dtype, quant_method: QuantizationMethod) -> FusedMoE:
        return FusedMoE(config.hidden_size, cls.expert_size(config), cls.num_experts(config),
                        int(config.num_experts_per_tok), dtype, quant_method, activation=cls.activation(config),
                        routed_scaling_factor=float(config.routed_scaling_factor),
                        weights_in_hidden_dtype=cls.weights_in_hidden_dtype,
                        shared_expert=cls.shared_expert(config, dtype, quant_method), **cls.router(config))

    @classmethod
    def attention_config(cls, hf_config: Any, dtype: torch.dtype, kv_cache_dtype: str = "auto",
                         block_size: int = 16, graph_capture: str = "none", device: str = "cpu") -> AttentionConfig:
        """An MLA backend: one row of latent + rope key per token (head_size its width, one KV head)."""
        spec = mla_kv_spec(hf_config)
        return AttentionConfig(head_size=spec.width, num_heads=spec.num_heads, num_kv_heads=1, dtype=dtype,
                               kv_cache_dtype=kv_cache_dtype, block_size=block_size, graph_capture=graph_capture,
                               device=device, mla=True)

    def checkpoint_name(self, name: str) -> Optional[str]:
        """transformers' `shared_experts` are our FusedMoE's `shared_expert`; layers past
        num_hidden_layers (V3's multi-token-prediction layer) are not run here."""
        if name.startswith("model.layers.") and int(name.split(".")[2]) >= self.config.num_hidden_layers:
            return None
        return super().checkpoint_name(name.replace(".mlp.shared_experts.", ".mlp.shared_expert.", 1))

    def decoder_stack(self) -> DecoderStackSpec:
        """Every layer in the vocabulary with attention "mla", which a decode program that does not
        express it refuses by that name (the model then runs eagerly); no q/k/v projection to pack."""
        model = self.model
        layers = [DecoderLayerSpec(
            input_norm=layer.norm("attn_in").weight, post_norm=layer.norm("ffn_in").weight, qkv=None,
            o=layer.self_attn.o_proj, gate_up=getattr(layer.mlp, "up", None), down=getattr(layer.mlp, "down", None),
            attention=layer.self_attn.attn, structure=layer.structure, cos_sin=layer.self_attn.rotary_emb.cos_sin_cache,
            eager=layer) for layer in model.layers]
        spec = mla_kv_spec(self.config)
        return DecoderStackSpec(
            embedding=model.embed_tokens.weight, final_norm=model.norm.weight, eps=float(model.norm.eps),
            cos_sin=model.rotary_emb.cos_sin_cache, num_heads=spec.num_heads, num_kv_heads=1, head_size=spec.width,
            hidden_size=self.config.hidden_size, intermediate_size=self.config.intermediate_size, layers=layers,
            embed=model.embed_tokens)


class DeepseekV3ForCausalLM(DeepseekV2ForCausalLM):
    interleaved_rope = False

    @classmethod
    def deinterleave_rope(cls, config: Any) -> bool:
        return bool(getattr(config, "rope_interleave", True))

    @classmethod
    def router(cls, config: Any) -> dict[str, Any]:
        return dict(scoring="sigmoid", renormalize=bool(config.norm_topk_prob), num_groups=config.n_group,
                    topk_groups=config.topk_group, correction_bias=True)
