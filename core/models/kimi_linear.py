"""Kimi Linear (`kimi_linear`): Kimi Delta Attention layers between multi-head latent attention ones,
DeepSeek-V3 experts.

The shared decoder network (core/models/decoder.py) with two token mixers: on `linear_attention`
layers Kimi Delta Attention (core/layers/kimi_delta.py, its per-sequence conv and delta-rule state in
the state cache: core/state_cache.py), on `full_attention` layers DeepSeek's MLA (core/layers/mla.py)
without rotary embeddings (NoPE: the shared key dims are cached and dotted unrotated). The FFN is
DeepSeek-V3's (core/models/deepseek.py): dense where config.mlp_layer_types says "dense", else
sigmoid-scored experts picked in groups with a correction bias, plus the shared experts.

What the recurrent layers refuse or turn off is Qwen3-Next's (core/models/qwen3_next.py
check_engine_config): one rank, no speculative decoding; prefix caching through the state
checkpoints at block boundaries (core/state_cache.py), as there.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Optional

import torch
from torch import nn

from tokenmill.platforms.interface import LayerStructure
from tokenmill.quantization.interface import QuantizationMethod

from .. import distributed
from ..layers.kimi_delta import KimiDeltaAttention
from ..layers.mla import DeepseekAttention, MLAAttention
from ..layers.moe import MIXTRAL_EXPERT_NAMES
from .decoder import layer_type
from .deepseek import DEEPSEEK_FEATURES, DeepseekV3ForCausalLM
from .qwen3_next import HYBRID_FEATURES, Qwen3NextForCausalLM

KIMI_LINEAR_FEATURES: dict[str, tuple[bool, str]] = {
    **DEEPSEEK_FEATURES,
    **{key: HYBRID_FEATURES[key] for key in ("pp", "lora", "fast_path", "pooling")},
    "tp": (False, "Kimi Delta Attention layers are not split over ranks yet: tensor_parallel_size=1"),
}


def is_linear_layer(config: Any, layer_idx: int) -> bool:
    return layer_type(config, layer_idx) == "linear_attention"


class KimiLinearForCausalLM(DeepseekV3ForCausalLM):
    """Kimi Linear: KDA on `linear_attention` layers, NoPE MLA on `full_attention` ones, DeepSeek-V3's
    router and shared experts on `sparse` FFN layers."""
    features = KIMI_LINEAR_FEATURES
    expert_names = MIXTRAL_EXPERT_NAMES
    check_engine_config = classmethod(Qwen3NextForCausalLM.check_engine_config.__func__)   # the recurrent refusals
    caches_prefix_state = True      # prefix caching through state checkpoints (core/state_cache.py)

    @classmethod
    def uses_rope(cls, config: Any, layer_idx: int) -> bool:
        return False

    @classmethod
    def deinterleave_rope(cls, config: Any) -> bool:
        return False

    @classmethod
    def num_experts(cls, config: Any) -> int:
        return int(getattr(config, "num_local_experts", None) or config.num_experts)

    @classmethod
    def is_moe_layer(cls, config: Any, layer_idx: int) -> bool:
        kinds = getattr(config, "mlp_layer_types", None)
        return kinds[layer_idx] == "sparse" if kinds else super().is_moe_layer(config, layer_idx)

    @staticmethod
    def attention_cls(config: Any, layer_idx: int, family: Any, rotary: Any, attn_backend_cls: type,
                      dtype: torch.dtype, kv_cache_dtype: str, quant_method: QuantizationMethod) -> nn.Module:
        if is_linear_layer(config, layer_idx):
            return KimiDeltaAttention(config, dtype, quant_method)
        return DeepseekAttention(config, layer_idx, family, rotary, attn_backend_cls, dtype, kv_cache_dtype,
                                 quant_method)

    @classmethod
    def layer_structure(cls, config: Any, layer_idx: int) -> LayerStructure:
        structure = super().layer_structure(config, layer_idx)
        return dataclasses.replace(structure, attention="kda") if is_linear_layer(config, layer_idx) else structure

    def __init__(self, hf_config: Any, *args: Any, **kwargs: Any) -> None:
        if distributed.tp_size() > 1 or distributed.get_state().pp_size > 1:
            raise ValueError(f"{type(self).__name__}: recurrent layers run on one rank only")
        super().__init__(hf_config, *args, **kwargs)
        layers = self.model.layers
        self.attention_layers: list[MLAAttention] = [layer.self_attn.attn for layer in layers
                                                     if isinstance(layer.self_attn, DeepseekAttention)]
        # The layers with a per-sequence state: the model runner gives them their slots.
        self.recurrent_layers: list[KimiDeltaAttention] = [layer.self_attn for layer in layers
                                                           if isinstance(layer.self_attn, KimiDeltaAttention)]

    def checkpoint_name(self, name: str) -> Optional[str]:
        """Kimi Linear checkpoints keep the FFN as block_sparse_moe (experts.{e}.w1 / w3 / w2, Mixtral's
        names), its shared experts as DeepSeek's."""
        return super().checkpoint_name(name.replace(".block_sparse_moe.", ".mlp.", 1))

    def decoder_stack(self) -> Any:
        raise NotImplementedError(f"{type(self).__name__}: recurrent layers are outside the decode programs' "
                                  "layer vocabulary")
