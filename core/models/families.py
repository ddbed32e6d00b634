"""The dense decoder families beyond Llama/Mistral/Qwen, each stated as where it differs from
LlamaForCausalLM in the shared layer vocabulary (core/models/decoder.py, platforms/interface.py
LayerStructure). Nothing here computes: the network is decoder.py's for every one of them.
"""
from __future__ import annotations

import math
from typing import Any, ClassVar, Optional

from ..layers.activation import activation_kind
from .decoder import layer_type
from .llama import LlamaForCausalLM

QKV_ONLY = {"qkv_proj": [("q_proj", 0), ("k_proj", 1), ("v_proj", 2)]}


class Gemma2ForCausalLM(LlamaForCausalLM):
    """Gemma 2: (1 + w) RMSNorms before and after attention and the FFN, GeGLU (gelu_tanh),
    embeddings times sqrt(hidden), query_pre_attn_scalar, attention and final logit soft-capping,
    sliding and global layers alternating."""
    norm_offset = 1.0
    norm_placement = "sandwich"

    @classmethod
    def activation(cls, config: Any) -> str:
        return activation_kind(getattr(config, "hidden_activation", None) or config.hidden_act)

    @classmethod
    def attention_scale(cls, config: Any) -> float:
        return float(config.query_pre_attn_scalar) ** -0.5

    @classmethod
    def attn_softcap(cls, config: Any) -> Optional[float]:
        return getattr(config, "attn_logit_softcapping", None) or None

    @classmethod
    def final_logit_softcap(cls, config: Any) -> Optional[float]:
        return getattr(config, "final_logit_softcapping", None) or None

    @classmethod
    def embedding_scale(cls, config: Any) -> float:
        return math.sqrt(config.hidden_size)


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    """Gemma 3 (text): Gemma 2 without attention soft-capping, plus (1 + w) q/k norms per head and a
    rope table per layer type (local base on sliding layers, the scaled global one on full layers);
    five sliding layers to each global one."""
    qk_norm = "head"


class Phi3ForCausalLM(LlamaForCausalLM):
    """Phi-3 / Phi-4: the Llama network with partial rotary (from the rope parameters), longrope
    scaling, and q/k/v and gate/up stored fused in the checkpoint (split by the loader)."""


class Olmo2ForCausalLM(LlamaForCausalLM):
    """OLMo 2: norms on each block's output (no input norms), q/k RMSNorms over the whole projection."""
    norm_placement = "post"
    qk_norm = "projection"
    features = {**LlamaForCausalLM.features,
                "tp": (False, "q/k norms span every head: tensor_parallel_size=1")}


class Olmo3ForCausalLM(Olmo2ForCausalLM):
    """OLMo 3: OLMo 2 with sliding-window layers (three to each global one)."""


class GraniteForCausalLM(LlamaForCausalLM):
    """Granite 3: the Llama network with scalar multipliers on embeddings, attention scores, each
    block's residual contribution and the logits."""

    @classmethod
    def attention_scale(cls, config: Any) -> float:
        return float(config.attention_multiplier)

    @classmethod
    def embedding_scale(cls, config: Any) -> float:
        return float(config.embedding_multiplier)

    @classmethod
    def residual_scale(cls, config: Any) -> float:
        return float(config.residual_multiplier)

    @classmethod
    def logit_scale(cls, config: Any) -> float:
        return 1.0 / float(config.logits_scaling)


class GlmForCausalLM(LlamaForCausalLM):
    """GLM-4 (first release, `glm`): partial rotary over GPT-J pairs, q/k/v biases, gate/up stored fused."""
    interleaved_rope = True

    @classmethod
    def o_bias(cls, config: Any) -> bool:
        return False


class Glm4ForCausalLM(GlmForCausalLM):
    """GLM-4-0414: GLM with norms after attention and after the FFN as well (its own names)."""
    norm_placement = "sandwich"
    norm_names: ClassVar[dict[str, str]] = {"attn_out": "post_self_attn_layernorm",
                                            "ffn_in": "post_attention_layernorm", "ffn_out": "post_mlp_layernorm"}


class Cohere2ForCausalLM(LlamaForCausalLM):
    """Cohere 2 (Command R7B): LayerNorm without bias, attention and FFN in parallel from one norm,
    GPT-J pair rotary on the sliding layers only (the global ones use no position encoding),
    logits times logit_scale."""
    norm_kind = "layer_nobias"
    parallel_block = True
    interleaved_rope = True

    @classmethod
    def uses_rope(cls, config: Any, layer_idx: int) -> bool:
        return layer_type(config, layer_idx) == "sliding_attention"

    @classmethod
    def logit_scale(cls, config: Any) -> float:
        return float(config.logit_scale)


class Exaone4ForCausalLM(LlamaForCausalLM):
    """EXAONE 4: OLMo 2's post-block norms with per-head q/k norms; with a window, rope on the sliding
    layers only."""
    norm_placement = "post"
    qk_norm = "head"

    @classmethod
    def uses_rope(cls, config: Any, layer_idx: int) -> bool:
        return not getattr(config, "sliding_window", None) or layer_type(config, layer_idx) == "sliding_attention"


class SmolLM3ForCausalLM(LlamaForCausalLM):
    """SmolLM3: the Llama network with no position encoding on every fourth layer (no_rope_layers)."""

    @classmethod
    def uses_rope(cls, config: Any, layer_idx: int) -> bool:
        flags = getattr(config, "no_rope_layers", None)
        return bool(flags[layer_idx]) if flags else True


class Starcoder2ForCausalLM(LlamaForCausalLM):
    """StarCoder2: LayerNorm with bias, a plain GELU-tanh MLP (c_fc / c_proj), biases everywhere."""
    norm_kind = "layer"
    ffn = "plain"
    plain_mlp_names = ("c_fc", "c_proj")
    packed_modules_mapping = QKV_ONLY
    lora_plain_modules = ("o_proj", "c_fc", "c_proj")

    @classmethod
    def qkv_bias(cls, config: Any) -> bool:
        return bool(getattr(config, "use_bias", True))

    o_bias = mlp_bias = qkv_bias


class SeedOssForCausalLM(LlamaForCausalLM):
    """Seed-OSS: the Llama network with its own switches for the q/k/v and output biases."""

    @classmethod
    def o_bias(cls, config: Any) -> bool:
        return bool(getattr(config, "attention_out_bias", False))


class ApertusForCausalLM(LlamaForCausalLM):
    """Apertus: per-head q/k norms, a plain xIELU MLP (learned alpha_p / alpha_n), llama3 rope, its own
    norm names."""
    norm_names: ClassVar[dict[str, str]] = {"attn_in": "attention_layernorm", "ffn_in": "feedforward_layernorm"}
    qk_norm = "head"
    ffn = "plain"
    packed_modules_mapping = QKV_ONLY
    lora_plain_modules = ("o_proj", "up_proj", "down_proj")
    # transformers stores xIELU's constants as buffers; they are fixed (beta 0.5, eps -1e-6).
    ignored_weights = LlamaForCausalLM.ignored_weights + ("act_fn.beta", "act_fn.eps")
