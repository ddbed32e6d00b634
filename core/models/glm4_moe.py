"""GLM-4-MoE (GLM-4.5, GLM-4.6; transformers' glm4_moe): the Llama network with partial rotary (the
leading partial_rotary_factor of each head, rotate-half), q/k/v biases (attention_bias) and no o bias,
optional per-head q/k RMSNorms (use_qk_norm), the first `first_k_dense_replace` layers dense and
every later one a mixture of experts: DeepSeek V3's router (sigmoid scores, a per-expert
e_score_correction_bias that picks experts without weighting them, n_group groups of which topk_group
stay eligible, the top-k renormalized and times routed_scaling_factor) and n_shared_experts shared
experts every token runs, one MLP of n_shared_experts * moe_intermediate_size.

Its checkpoints may carry multi-token-prediction layers past num_hidden_layers (model.layers.46 of
GLM-4.5-Air); they are not weights here.
"""
from __future__ import annotations

from typing import Any, Optional

import torch

from tokenmill.platforms.interface import LayerStructure
from tokenmill.quantization.interface import QuantizationMethod

from ..layers.moe import FusedMoE
from .decoder import DecoderMLP
from .moe_families import MoeForCausalLM


class Glm4MoeForCausalLM(MoeForCausalLM):
    """GLM-4-MoE; a config with use_qk_norm builds Glm4MoeQkNormForCausalLM's layers."""

    @classmethod
    def num_experts(cls, config: Any) -> int:
        return int(config.n_routed_experts)

    @classmethod
    def o_bias(cls, config: Any) -> bool:
        return False

    @classmethod
    def renormalize(cls, config: Any) -> bool:
        return bool(getattr(config, "norm_topk_prob", True))

    @classmethod
    def is_moe_layer(cls, config: Any, layer_idx: int) -> bool:
        return layer_idx >= int(getattr(config, "first_k_dense_replace", 0) or 0)

    @classmethod
    def shared_expert(cls, config: Any, dtype: torch.dtype, quant_method: QuantizationMethod) -> Optional[DecoderMLP]:
        shared = int(getattr(config, "n_shared_experts", 0) or 0)
        if not shared:
            return None
        return DecoderMLP(config, cls, LayerStructure(activation=cls.activation(config)), dtype, quant_method,
                          size=shared * int(config.moe_intermediate_size))

    @classmethod
    def make_moe(cls, config: Any, layer_idx: int, dtype: torch.dtype, quant_method: QuantizationMethod) -> FusedMoE:
        # transformers multiplies the routing weights in float32 (its router runs in float32).
        return FusedMoE(config.hidden_size, cls.expert_size(config), cls.num_experts(config),
                        int(config.num_experts_per_tok), dtype, quant_method, activation=cls.activation(config),
                        scoring="sigmoid", renormalize=cls.renormalize(config),
                        num_groups=int(getattr(config, "n_group", 1) or 1),
                        topk_groups=int(getattr(config, "topk_group", 1) or 1), correction_bias=True,
                        routed_scaling_factor=float(getattr(config, "routed_scaling_factor", 1.0) or 1.0),
                        weights_in_hidden_dtype=False, shared_expert=cls.shared_expert(config, dtype, quant_method))

    def __init__(self, hf_config: Any, *args: Any, **kwargs: Any) -> None:
        if getattr(hf_config, "use_qk_norm", False) and type(self) is Glm4MoeForCausalLM:
            # The q/k norms are a class switch of the shared network (qk_norm): the variant that has them.
            self.__class__ = Glm4MoeQkNormForCausalLM
        super().__init__(hf_config, *args, **kwargs)

    def checkpoint_name(self, name: str) -> Optional[str]:
        if name.startswith("model.layers."):
            if int(name.split(".")[2]) >= self.config.num_hidden_layers:     # multi-token-prediction layers
                return None
            name = name.replace(".mlp.shared_experts.", ".mlp.shared_expert.", 1)
        return super().checkpoint_name(name)


class Glm4MoeQkNormForCausalLM(Glm4MoeForCausalLM):
    """GLM-4-MoE with use_qk_norm: RMSNorm over each head of q and k before rotary."""
    qk_norm = "head"
