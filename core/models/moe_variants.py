"""The mixture-of-experts variants of dense families (core/models/families.py): PhiMoE (Phi-3.5-MoE),
Granite 3 MoE with and without a shared expert, FlexOlmo (OLMo 2's layer with OLMoE's experts),
EXAONE-MoE (K-EXAONE) and Cohere 2 MoE. Each is its dense family's switches plus an expert FFN
(moe_families.py MoeForCausalLM), stated where it differs: its router's scoring, its experts'
checkpoint names, its sparse layers and shared experts.
"""
from __future__ import annotations

import copy
from typing import Any, Optional

import torch
from torch import nn

from tokenmill.platforms.interface import DecoderStackSpec, LayerStructure
from tokenmill.quantization.interface import QuantizationMethod

from ..layers.moe import FusedMoE
from ..layers.norm import LayerNorm
from .decoder import DecoderMLP, layer_type
from .families import Cohere2ForCausalLM, Exaone4ForCausalLM, GraniteForCausalLM
from .glm4_moe import Glm4MoeForCausalLM
from .moe_families import MixtralForCausalLM, MoeForCausalLM, OlmoeForCausalLM


def _shared_mlp(family: Any, config: Any, size: int, dtype: torch.dtype,
                quant_method: QuantizationMethod) -> Optional[DecoderMLP]:
    """A gated MLP of `size` every token runs (None for size 0)."""
    if not size:
        return None
    return DecoderMLP(config, family, LayerStructure(activation=family.activation(config)), dtype, quant_method,
                      size=size)


def _sparse(config: Any, layer_idx: int) -> bool:
    """mlp_layer_types' reading (EXAONE-MoE, Cohere 2 MoE): "sparse" layers hold experts."""
    return list(config.mlp_layer_types)[layer_idx] == "sparse"


class PhimoeForCausalLM(MixtralForCausalLM):
    """PhiMoE: Mixtral's layout with LayerNorms (with bias, eps rms_norm_eps), q/k/v/o biases
    (attention_bias), sparsemixer routing (the best expert, then the best other one, each weighted by
    a softmax over the logits within router_jitter_noise of it, in the activations' dtype) and
    longrope with its own short / long mscale (core/layers/rotary.py)."""
    norm_kind = "layer"
    weights_in_hidden_dtype = True

    @classmethod
    def make_norm(cls, config: Any, size: int, dtype: torch.dtype) -> nn.Module:
        return LayerNorm(size, float(config.rms_norm_eps), dtype, bias=True)

    @classmethod
    def make_moe(cls, config: Any, layer_idx: int, dtype: torch.dtype, quant_method: QuantizationMethod) -> FusedMoE:
        return FusedMoE(config.hidden_size, cls.expert_size(config), cls.num_experts(config),
                        int(config.num_experts_per_tok), dtype, quant_method, activation=cls.activation(config),
                        scoring="sparsemixer", jitter_eps=float(config.router_jitter_noise),
                        weights_in_hidden_dtype=True)

    def __init__(self, hf_config: Any, *args: Any, **kwargs: Any) -> None:
        if getattr(hf_config, "lm_head_bias", False):
            raise ValueError("PhimoeForCausalLM: lm_head_bias=True (a bias on the LM head) is not supported")
        super().__init__(hf_config, *args, **kwargs)


class GraniteMoeForCausalLM(MoeForCausalLM, GraniteForCausalLM):
    """Granite 3 MoE: Granite's multipliers (embeddings, attention scores, residual contributions,
    logits) around Mixtral-like layers whose router takes the top-k logits and softmaxes those;
    experts stored fused as block_sparse_moe.input_linear [E, 2I, H] (gate rows, then up) and
    output_linear [E, H, I], the router as block_sparse_moe.router.layer."""
    # Checkpoint module -> ours (the fused experts then take moe.py's fused-layout names).
    renames = {".block_sparse_moe.input_linear.weight": ".mlp.experts.gate_up_proj",
               ".block_sparse_moe.output_linear.weight": ".mlp.experts.down_proj",
               ".block_sparse_moe.router.layer.": ".mlp.gate.",
               ".shared_mlp.input_linear.": ".mlp.shared_expert.gate_up_proj.",
               ".shared_mlp.output_linear.": ".mlp.shared_expert.down_proj."}

    @classmethod
    def make_moe(cls, config: Any, layer_idx: int, dtype: torch.dtype, quant_method: QuantizationMethod) -> FusedMoE:
        shared = _shared_mlp(cls, config, int(getattr(config, "shared_intermediate_size", 0) or 0), dtype, quant_method)
        return FusedMoE(config.hidden_size, cls.expert_size(config), cls.num_experts(config),
                        int(config.num_experts_per_tok), dtype, quant_method, activation=cls.activation(config),
                        scoring="topk_softmax", weights_in_hidden_dtype=True, shared_expert=shared)

    def checkpoint_name(self, name: str) -> Optional[str]:
        for theirs, ours in self.renames.items():
            if theirs in name:
                name = name.replace(theirs, ours, 1)
                break
        return super().checkpoint_name(name)


class GraniteMoeSharedForCausalLM(GraniteMoeForCausalLM):
    """Granite 3 MoE with a shared expert (shared_mlp, shared_intermediate_size) added ungated."""


class FlexOlmoForCausalLM(OlmoeForCausalLM):
    """FlexOlmo: OLMoE's experts and whole-projection q/k norms in OLMo 2's layer (norms on each
    block's output, none on its input)."""
    norm_placement = "post"


class ExaoneMoeForCausalLM(Glm4MoeForCausalLM):
    """EXAONE-MoE (K-EXAONE): EXAONE 4's attention (per-head q/k norms; with a window, rope on the
    sliding layers only) in pre-norm layers, DeepSeek V3's router (as GLM-4-MoE's) over num_experts,
    num_shared_experts shared experts, the sparse layers listed in mlp_layer_types; the router's
    correction bias stored as mlp.e_score_correction_bias, multi-token-prediction weights (mtp.*) not
    weights here."""
    qk_norm = "head"

    @classmethod
    def num_experts(cls, config: Any) -> int:
        return int(config.num_experts)

    @classmethod
    def is_moe_layer(cls, config: Any, layer_idx: int) -> bool:
        return _sparse(config, layer_idx)

    @classmethod
    def uses_rope(cls, config: Any, layer_idx: int) -> bool:
        return Exaone4ForCausalLM.uses_rope(config, layer_idx)

    @classmethod
    def shared_expert(cls, config: Any, dtype: torch.dtype, quant_method: QuantizationMethod) -> Optional[DecoderMLP]:
        size = int(getattr(config, "num_shared_experts", 0) or 0) * int(config.moe_intermediate_size)
        return _shared_mlp(cls, config, size, dtype, quant_method)

    def checkpoint_name(self, name: str) -> Optional[str]:
        if name.startswith("mtp."):
            return None
        return super().checkpoint_name(name.replace(".mlp.e_score_correction_bias",
                                                    ".mlp.gate.e_score_correction_bias"))


class Cohere2MoeForCausalLM(MoeForCausalLM, Cohere2ForCausalLM):
    """Cohere 2 MoE: Cohere 2's parallel layer (attention and FFN from one LayerNorm without bias, or
    an RMSNorm where rms_norm_eps is set: Cohere2MoeRmsForCausalLM), GPT-J rotary on the sliding layers
    (and on the leading dense layers when prefix_dense_sliding_window_pattern is 1), logits times
    logit_scale; sparse layers per mlp_layer_types, the dense ones of prefix_dense_intermediate_size;
    the router's top-k logits softmaxed or sigmoided (expert_selection_fn, the sigmoids renormalized
    with norm_topk_prob); shared experts summed with the routed ones or averaged with them."""

    @classmethod
    def is_moe_layer(cls, config: Any, layer_idx: int) -> bool:
        return _sparse(config, layer_idx)

    @classmethod
    def uses_rope(cls, config: Any, layer_idx: int) -> bool:
        forced = not _sparse(config, layer_idx) and int(getattr(config, "prefix_dense_sliding_window_pattern", 1)) == 1
        return forced or layer_type(config, layer_idx) == "sliding_attention"

    @classmethod
    def make_moe(cls, config: Any, layer_idx: int, dtype: torch.dtype, quant_method: QuantizationMethod) -> FusedMoE:
        size = cls.expert_size(config)
        shared = _shared_mlp(cls, config, int(getattr(config, "num_shared_experts", 0) or 0) * size, dtype,
                             quant_method)
        strategy = getattr(config, "shared_expert_combination_strategy", "average")
        if strategy not in ("sum", "average"):
            raise ValueError(f"shared_expert_combination_strategy {strategy!r}: expected 'sum' or 'average'")
        # (routed + shared) / 2 as routed / 2 + shared / 2: halving is exact, so the sums are transformers'.
        half = 0.5 if shared is not None and strategy == "average" else 1.0
        selection = getattr(config, "expert_selection_fn", "softmax")
        if selection not in ("softmax", "sigmoid"):
            raise ValueError(f"expert_selection_fn {selection!r}: expected 'softmax' or 'sigmoid'")
        return FusedMoE(config.hidden_size, size, cls.num_experts(config), int(config.num_experts_per_tok), dtype,
                        quant_method, activation=cls.activation(config), scoring=f"topk_{selection}",
                        renormalize=bool(getattr(config, "norm_topk_prob", True)), routed_scaling_factor=half,
                        weights_in_hidden_dtype=True, shared_expert=shared, shared_expert_scale=half)

    def __init__(self, hf_config: Any, *args: Any, **kwargs: Any) -> None:
        if getattr(hf_config, "rms_norm_eps", None) is not None and type(self) is Cohere2MoeForCausalLM:
            self.__class__ = Cohere2MoeRmsForCausalLM     # the norm kind is a class switch of the network
        # The experts (and shared experts) are intermediate_size wide, the dense layers
        # prefix_dense_intermediate_size: the network reads the dense size, the experts moe_intermediate_size.
        hf_config = copy.copy(hf_config)
        hf_config.moe_intermediate_size = hf_config.intermediate_size
        hf_config.intermediate_size = getattr(hf_config, "prefix_dense_intermediate_size", None) \
            or hf_config.intermediate_size
        super().__init__(hf_config, *args, **kwargs)

    def checkpoint_name(self, name: str) -> Optional[str]:
        return super().checkpoint_name(name.replace(".mlp.shared_experts.", ".mlp.shared_expert.", 1))

    def decoder_stack(self) -> DecoderStackSpec:
        # MoeSpec has no shared_expert_scale: an averaged shared expert is not handed to decode
        # programs, so the native step refuses the layer ("ffn moe") and runs it eagerly.
        spec = super().decoder_stack()
        for layer_spec, layer in zip(spec.layers, self.model.layers):
            if isinstance(layer.mlp, FusedMoE) and layer.mlp.shared_expert_scale != 1.0:
                layer_spec.moe = None
        return spec


class Cohere2MoeRmsForCausalLM(Cohere2MoeForCausalLM):
    """Cohere 2 MoE with RMSNorms (rms_norm_eps set)."""
    norm_kind = "rms"
