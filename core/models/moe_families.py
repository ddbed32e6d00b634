"""The mixture-of-experts families: the shared decoder network (core/models/decoder.py) whose layers
with LayerStructure ffn="moe" hold a FusedMoE (core/layers/moe.py) instead of the dense MLP. Each
family states, as the dense ones do (core/models/families.py), where it differs: which layers are
sparse, its router's switches, its experts' checkpoint names, a shared expert.
"""
from __future__ import annotations

import dataclasses
from typing import Any, ClassVar, Optional

import torch

from tokenmill.platforms.interface import DecoderStackSpec, LayerStructure, MoeSpec
from tokenmill.quantization.interface import QuantizationMethod

from ..layers.moe import HF_EXPERT_NAMES, MIXTRAL_EXPERT_NAMES, FusedMoE, expert_checkpoint_target
from .decoder import DecoderMLP
from .llama import LlamaForCausalLM

MOE_FEATURES: dict[str, tuple[bool, str]] = {
    **LlamaForCausalLM.features,
    "tp": (True, "heads, each expert's and the shared expert's intermediate size split over ranks "
                 "(every rank holds every expert); enable_expert_parallel: whole experts, E / tp per rank"),
    "lora": (False, "experts: not supported"),
    "quantization": (True, "int4 / int8 quantize the experts too, GGUF files keep their experts' blocks "
                           "(quantization='gguf'): the cpu native MoE op runs them; fp8 keeps them float8 for the "
                           "torch op; quantized HF checkpoints' experts are refused"),
    "fast_path": (True, "decoder_stack(): the cpu native step runs expert FFNs (router, top-k, the native MoE "
                        "op, shared expert) where the platform's MoE op packed the experts (bf16, int4, int8, "
                        "GGUF); elsewhere MoE layers run eagerly between native dense layers"),
}


def _sparse_layer(config: Any, layer_idx: int, num_experts: int) -> bool:
    """Qwen's rule: sparse unless listed in mlp_only_layers or off every decoder_sparse_step-th layer."""
    step = int(getattr(config, "decoder_sparse_step", 1) or 1)
    return (layer_idx not in (getattr(config, "mlp_only_layers", None) or ())
            and num_experts > 0 and (layer_idx + 1) % step == 0)


class MoeForCausalLM(LlamaForCausalLM):
    """What the MoE families share: the Llama network with sparse layers (`is_moe_layer`), softmax
    top-k routing over `num_experts` gated SiLU experts, checkpoint experts stacked on loading
    (`stacked_target`, core/loaders/weights.py)."""
    expert_names: ClassVar[dict[str, str]] = HF_EXPERT_NAMES
    # transformers rounds the routing weights to the activations' dtype (Qwen2/3-MoE, OLMoE) or
    # keeps them in float32 (Mixtral).
    weights_in_hidden_dtype: ClassVar[bool] = True
    features = MOE_FEATURES

    @classmethod
    def num_experts(cls, config: Any) -> int:
        return int(getattr(config, "num_experts", None) or config.num_local_experts)

    @classmethod
    def expert_size(cls, config: Any) -> int:
        return int(getattr(config, "moe_intermediate_size", None) or config.intermediate_size)

    @classmethod
    def renormalize(cls, config: Any) -> bool:
        return bool(getattr(config, "norm_topk_prob", False))

    @classmethod
    def is_moe_layer(cls, config: Any, layer_idx: int) -> bool:
        return True

    @classmethod
    def shared_expert(cls, config: Any, dtype: torch.dtype, quant_method: QuantizationMethod) -> Optional[DecoderMLP]:
        return None

    @classmethod
    def layer_structure(cls, config: Any, layer_idx: int) -> LayerStructure:
        structure = super().layer_structure(config, layer_idx)
        return dataclasses.replace(structure, ffn="moe") if cls.is_moe_layer(config, layer_idx) else structure

    @classmethod
    def make_moe(cls, config: Any, layer_idx: int, dtype: torch.dtype, quant_method: QuantizationMethod) -> FusedMoE:
        """Layer `layer_idx`'s expert FFN (core/models/decoder.py DecoderLayer builds it)."""
        shared = cls.shared_expert(config, dtype, quant_method)
        return FusedMoE(config.hidden_size, cls.expert_size(config), cls.num_experts(config),
                        int(config.num_experts_per_tok), dtype, quant_method, activation=cls.activation(config),
                        renormalize=cls.renormalize(config), weights_in_hidden_dtype=cls.weights_in_hidden_dtype,
                        shared_expert=shared, shared_expert_gate=shared is not None)

    def decoder_stack(self) -> DecoderStackSpec:
        """Llama's spec with each sparse layer's expert FFN (platforms/layer_spec.py MoeSpec)."""
        spec = super().decoder_stack()
        for layer_spec, layer in zip(spec.layers, self.model.layers):
            if isinstance(layer.mlp, FusedMoE):
                layer_spec.moe = moe_spec(layer.mlp)
        return spec

    def stacked_target(self, name: str) -> Optional[tuple[str, Any]]:
        """(parameter, shard id) of an expert's checkpoint tensor; None for every other tensor."""
        return expert_checkpoint_target(name, self.expert_names)


def moe_spec(moe: FusedMoE) -> MoeSpec:
    """A FusedMoE as a decode program reads it: its router's switches, experts, the platform
    kernel's packed experts and its shared expert."""
    shared = moe.shared_expert
    return MoeSpec(
        router=moe.gate, top_k=moe.top_k, scoring=moe.scoring, renormalize=moe.renormalize, w13=moe.w13, w2=moe.w2,
        activation=moe.activation, num_groups=moe.num_groups, topk_groups=moe.topk_groups,
        correction_bias=getattr(moe.gate, "e_score_correction_bias", None),
        routed_scaling_factor=moe.routed_scaling_factor, weights_in_hidden_dtype=moe.weights_in_hidden_dtype,
        w13_bias=moe.w13_bias, w2_bias=moe.w2_bias, swiglu_alpha=moe.swiglu_alpha, swiglu_limit=moe.swiglu_limit,
        prepared=moe._prepared, shared_gate_up=getattr(shared, "up", None), shared_down=getattr(shared, "down", None),
        shared_gate=moe.shared_expert_gate, counted=moe)


class MixtralForCausalLM(MoeForCausalLM):
    """Mixtral: every layer sparse, the top-k weights always renormalized (and kept in float32);
    experts stored as block_sparse_moe.experts.{e}.w1 (gate) / w3 (up) / w2 (down)."""
    expert_names = MIXTRAL_EXPERT_NAMES
    weights_in_hidden_dtype = False

    @classmethod
    def renormalize(cls, config: Any) -> bool:
        return True

    def checkpoint_name(self, name: str) -> Optional[str]:
        return super().checkpoint_name(name.replace(".block_sparse_moe.", ".mlp.", 1))


class Qwen2MoeForCausalLM(MoeForCausalLM):
    """Qwen2-MoE: q/k/v biases, a shared expert every token runs, scaled by sigmoid(shared_expert_gate);
    layers listed in mlp_only_layers, and those off the decoder_sparse_step, dense."""

    @classmethod
    def qkv_bias(cls, config: Any) -> bool:
        return bool(getattr(config, "qkv_bias", True))

    @classmethod
    def o_bias(cls, config: Any) -> bool:
        return False

    @classmethod
    def is_moe_layer(cls, config: Any, layer_idx: int) -> bool:
        return _sparse_layer(config, layer_idx, cls.num_experts(config))

    @classmethod
    def shared_expert(cls, config: Any, dtype: torch.dtype, quant_method: QuantizationMethod) -> Optional[DecoderMLP]:
        size = getattr(config, "shared_expert_intermediate_size", 0)
        if not size:
            return None
        return DecoderMLP(config, cls, LayerStructure(activation=cls.activation(config)), dtype, quant_method,
                          size=size)


class Qwen3MoeForCausalLM(MoeForCausalLM):
    """Qwen3-MoE: Qwen3's per-head q/k norms; no shared expert; sparse layers as Qwen2-MoE's."""
    qk_norm = "head"

    @classmethod
    def is_moe_layer(cls, config: Any, layer_idx: int) -> bool:
        return _sparse_layer(config, layer_idx, cls.num_experts(config))


class OlmoeForCausalLM(MoeForCausalLM):
    """OLMoE: q/k RMSNorms over the whole projection (as OLMo 2) before rotary, every layer sparse."""
    qk_norm = "projection"
    features = {**MOE_FEATURES, "tp": (False, "q/k norms span every head: tensor_parallel_size=1")}

    def __init__(self, hf_config: Any, *args: Any, **kwargs: Any) -> None:
        if getattr(hf_config, "clip_qkv", None) is not None:
            raise ValueError(f"OlmoeForCausalLM: clip_qkv={hf_config.clip_qkv} (q/k/v clamping) is not supported")
        super().__init__(hf_config, *args, **kwargs)
