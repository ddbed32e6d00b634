"""What llama.cpp's converter (convert_hf_to_gguf.py; conversion/*.py in newer trees) writes for
each family (dense, and the mixture-of-experts Mixtral, Qwen2/3-MoE, OLMoE, Granite MoE), read back: GGUF metadata
-> HF config fields, GGUF block tensor names -> HF module names, and which of the converter's
tensor transforms the loader undoes (core/loaders/gguf_loader.py applies them).

Where the converter stores nothing and llama.cpp hardcodes a value (Gemma's attention scale, the
sliding-window periods, SmolLM3's NoPE layers, Gemma 3's local rope base), the same value is used
here, so a file means what it means to llama.cpp; each such rule is stated where it is applied.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Optional

from .gguf_file import GGUFFile

Configure = Callable[[GGUFFile, dict], None]


def _nothing(gguf: GGUFFile, kwargs: dict) -> None:
    pass


@dataclass(frozen=True)
class GGUFFamily:
    model_type: str                       # HF model_type
    architecture: str                     # our (HF) architecture class name
    configure: Configure = _nothing       # family-specific config fields from the metadata
    # GGUF block tensor -> HF module, where the family's names differ from Llama's.
    block_names: Mapping[str, str] = field(default_factory=dict)
    permuted_qk: bool = False             # the converter's LlamaModel.permute interleaved q/k rotary halves
    norm_shift: float = 0.0               # the converter added this to every norm weight (Gemma's 1 + w)
    fused_ffn_up: bool = False            # ffn_up holds gate and up stacked (Phi-3, GLM): split again
    plain_config: bool = False            # a bare PretrainedConfig suffices (no derived fields needed)
    # Metadata that picks another HF class for the same GGUF architecture (OLMo 2 vs 3).
    variant: Optional[Callable[[GGUFFile], Optional[tuple[str, str]]]] = None

    def resolve(self, gguf: GGUFFile) -> tuple[str, str]:
        chosen = self.variant(gguf) if self.variant is not None else None
        return chosen or (self.model_type, self.architecture)


def _window(gguf: GGUFFile) -> Optional[int]:
    return int(gguf.arch_value("attention.sliding_window") or 0) or None


def _layer_types(gguf: GGUFFile, kwargs: dict, period: int) -> list[str]:
    """Per layer "sliding_attention" / "full_attention": the file's sliding_window_pattern where the
    converter wrote one (a bool per layer: OLMo 3, EXAONE 4; or a period), else llama.cpp's
    set_swa_pattern(period): period - 1 sliding layers, then a full one. No window: all full."""
    n = kwargs["num_hidden_layers"]
    if kwargs.get("sliding_window") is None:
        return ["full_attention"] * n
    stored = gguf.arch_value("attention.sliding_window_pattern")
    if isinstance(stored, list) and len(stored) == n:
        return ["sliding_attention" if s else "full_attention" for s in stored]
    if isinstance(stored, int) and stored > 0:
        period = stored
    return ["sliding_attention" if (i + 1) % period else "full_attention" for i in range(n)]


def _windowed(kwargs: dict, gguf: GGUFFile, period: int) -> None:
    kwargs["sliding_window"] = _window(gguf)
    kwargs["layer_types"] = _layer_types(gguf, kwargs, period)


def _has_qkv_bias(gguf: GGUFFile) -> bool:
    return "blk.0.attn_q.bias" in gguf.tensors or "blk.0.attn_qkv.bias" in gguf.tensors


def _rotary_fraction(gguf: GGUFFile, kwargs: dict, default: float = 1.0) -> None:
    """rope.dimension_count is the rotated part of a head: partial_rotary_factor = it / head_dim."""
    dims = gguf.arch_value("rope.dimension_count")
    kwargs["partial_rotary_factor"] = int(dims) / kwargs["head_dim"] if dims else default


def _full_rope(kwargs: dict) -> dict:
    """The rope parameters of full-attention layers: the base and any scaling the converter wrote."""
    params = {"rope_type": "default", "rope_theta": kwargs.pop("rope_theta")}
    params.update(kwargs.pop("rope_scaling", None) or {})
    return params


def _gemma_query_scalar(kwargs: dict, layers_of_27b: int) -> int:
    """Not in the file: llama.cpp scales queries by 1/sqrt(hidden / heads) for the 27B (known by its
    layer count) and by 1/sqrt(head_dim) otherwise, which is what HF's query_pre_attn_scalar holds."""
    if kwargs["num_hidden_layers"] == layers_of_27b:
        return kwargs["hidden_size"] // kwargs["num_attention_heads"]
    return kwargs["head_dim"]


def _softcaps(gguf: GGUFFile, kwargs: dict, keys: tuple[str, ...]) -> None:
    for key in keys:
        if gguf.arch_value(key) is not None:
            kwargs[key] = float(gguf.arch_value(key))


def _llama_like(gguf: GGUFFile, kwargs: dict) -> None:
    if _window(gguf):
        kwargs["sliding_window"] = _window(gguf)


def _qwen2(gguf: GGUFFile, kwargs: dict) -> None:
    kwargs["attention_bias"] = True
    if _window(gguf):
        kwargs["sliding_window"] = _window(gguf)
        kwargs["use_sliding_window"] = True


def _experts(gguf: GGUFFile, kwargs: dict, count_key: str = "num_experts") -> None:
    """Mixture-of-experts fields: expert_count, expert_used_count, the experts' own FFN length
    (expert_feed_forward_length; absent: feed_forward_length, as Mixtral's files)."""
    a = gguf.arch_value
    kwargs[count_key] = int(a("expert_count"))
    kwargs["num_experts_per_tok"] = int(a("expert_used_count"))
    kwargs["moe_intermediate_size"] = int(a("expert_feed_forward_length") or kwargs["intermediate_size"])


def _mixtral(gguf: GGUFFile) -> Optional[tuple[str, str]]:
    # Mixtral files are "llama" with experts (expert_count).
    return ("mixtral", "MixtralForCausalLM") if gguf.arch_value("expert_count") else None


def _llama(gguf: GGUFFile, kwargs: dict) -> None:
    _llama_like(gguf, kwargs)
    if gguf.arch_value("expert_count"):
        _experts(gguf, kwargs, "num_local_experts")
        kwargs.pop("moe_intermediate_size")              # Mixtral's experts are intermediate_size wide


def _qwen2moe(gguf: GGUFFile, kwargs: dict) -> None:
    _qwen2(gguf, kwargs)
    _experts(gguf, kwargs)
    kwargs["shared_expert_intermediate_size"] = int(gguf.arch_value("expert_shared_feed_forward_length") or 0)
    kwargs["norm_topk_prob"] = False           # llama.cpp: Qwen2-MoE's top-k weights are not renormalized
    kwargs["mlp_only_layers"] = []             # nor are any of its layers dense
    kwargs["decoder_sparse_step"] = 1


def _qwen3moe(gguf: GGUFFile, kwargs: dict) -> None:
    _llama_like(gguf, kwargs)
    _experts(gguf, kwargs)
    kwargs["norm_topk_prob"] = True            # llama.cpp renormalizes Qwen3-MoE's top-k weights
    kwargs["mlp_only_layers"] = []
    kwargs["decoder_sparse_step"] = 1


def _olmoe(gguf: GGUFFile, kwargs: dict) -> None:
    _experts(gguf, kwargs)
    kwargs.pop("moe_intermediate_size")        # OLMoE's experts are intermediate_size wide
    kwargs["intermediate_size"] = int(gguf.arch_value("expert_feed_forward_length") or kwargs["intermediate_size"])
    kwargs["norm_topk_prob"] = False           # llama.cpp: OLMoE's top-k weights are not renormalized


def _gemma2(gguf: GGUFFile, kwargs: dict) -> None:
    kwargs["query_pre_attn_scalar"] = _gemma_query_scalar(kwargs, 46)
    # Absent soft-caps: HF's defaults (50, 30) are llama.cpp's too.
    _softcaps(gguf, kwargs, ("attn_logit_softcapping", "final_logit_softcapping"))
    _windowed(kwargs, gguf, 2)


def _gemma3(gguf: GGUFFile, kwargs: dict) -> None:
    kwargs["query_pre_attn_scalar"] = _gemma_query_scalar(kwargs, 62)
    _softcaps(gguf, kwargs, ("final_logit_softcapping",))
    _windowed(kwargs, gguf, 6)
    # Global layers: rope.freq_base and the converter's (linear) scaling. Local layers: llama.cpp
    # rotates them with base 10000 and no scaling unless the file gives rope.freq_base_swa.
    kwargs["rope_parameters"] = {
        "full_attention": _full_rope(kwargs),
        "sliding_attention": {"rope_type": "default",
                              "rope_theta": float(gguf.arch_value("rope.freq_base_swa", 10000.0))}}


def _phi3(gguf: GGUFFile, kwargs: dict) -> None:
    _rotary_fraction(gguf, kwargs)
    kwargs["sliding_window"] = _window(gguf)          # the converter writes 0 for "none" (Phi-4)
    original = gguf.arch_value("rope.scaling.original_context_length")
    if original:
        kwargs["original_max_position_embeddings"] = int(original)
    if "rope_factors_long.weight" in gguf.tensors:
        # LongRoPE arrives as two factor tensors (no scaling type key). The converter's
        # rope.scaling.attn_factor is HF's own longrope formula on the same lengths, so HF recomputes it.
        kwargs["rope_scaling"] = {"rope_type": "longrope", "original_max_position_embeddings": int(original),
                                  "long_factor": _floats(gguf, "rope_factors_long.weight"),
                                  "short_factor": _floats(gguf, "rope_factors_short.weight")}


def _olmo3(gguf: GGUFFile) -> Optional[tuple[str, str]]:
    # OLMo 3 files are "olmo2" with a sliding window (and a sliding_window_pattern array).
    return ("olmo3", "Olmo3ForCausalLM") if _window(gguf) else None


def _olmo(gguf: GGUFFile, kwargs: dict) -> None:
    kwargs["attention_bias"] = _has_qkv_bias(gguf)
    if not _window(gguf):
        return
    _windowed(kwargs, gguf, 4)
    full = _full_rope(kwargs)
    kwargs["rope_parameters"] = {
        "full_attention": full,
        "sliding_attention": {"rope_type": "default",
                              "rope_theta": float(gguf.arch_value("rope.freq_base_swa", full["rope_theta"]))}}


def _granite(gguf: GGUFFile, kwargs: dict) -> None:
    a = gguf.arch_value
    kwargs["attention_bias"] = _has_qkv_bias(gguf)
    # Each written only when set; llama.cpp's defaults when absent (1/sqrt(head_dim) for the scores).
    kwargs["attention_multiplier"] = float(a("attention.scale") or kwargs["head_dim"] ** -0.5)
    kwargs["embedding_multiplier"] = float(a("embedding_scale") or 1.0)
    kwargs["residual_multiplier"] = float(a("residual_scale") or 1.0)
    kwargs["logits_scaling"] = float(a("logit_scale") or 1.0)          # logits are divided by it


def _granitemoe(gguf: GGUFFile, kwargs: dict) -> None:
    _granite(gguf, kwargs)
    _experts(gguf, kwargs, "num_local_experts")
    kwargs.pop("moe_intermediate_size")        # Granite's experts are intermediate_size wide
    kwargs["shared_intermediate_size"] = int(gguf.arch_value("expert_shared_feed_forward_length") or 0)


def _granitemoe_shared(gguf: GGUFFile) -> Optional[tuple[str, str]]:
    # The converter writes GraniteMoeShared as "granitemoe" with ffn_*_shexp tensors.
    return ("granitemoeshared", "GraniteMoeSharedForCausalLM") if "blk.0.ffn_up_shexp.weight" in gguf.tensors else None


def _glm(gguf: GGUFFile, kwargs: dict) -> None:
    kwargs["attention_bias"] = _has_qkv_bias(gguf)
    _rotary_fraction(gguf, kwargs, default=0.5)


def _cohere2(gguf: GGUFFile, kwargs: dict) -> None:
    a = gguf.arch_value
    kwargs["layer_norm_eps"] = float(a("attention.layer_norm_epsilon", 1e-5))
    kwargs["logit_scale"] = float(a("logit_scale", 1.0))
    kwargs["attention_bias"] = False                    # the converter drops the (all-zero) biases
    dims = a("rope.dimension_count")
    if dims and int(dims) != kwargs["head_dim"]:
        raise ValueError(f"GGUF cohere2 file rotates {dims} of {kwargs['head_dim']} head dims; "
                         "Cohere2ForCausalLM rotates whole heads")
    _windowed(kwargs, gguf, 4)


def _exaone4(gguf: GGUFFile, kwargs: dict) -> None:
    _windowed(kwargs, gguf, 4)


def _smollm3(gguf: GGUFFile, kwargs: dict) -> None:
    kwargs["attention_bias"] = _has_qkv_bias(gguf)
    # Not in the file: llama.cpp skips rope on every fourth layer (n_no_rope_layer_step = 4), HF's default too.
    kwargs["no_rope_layers"] = [int((i + 1) % 4 != 0) for i in range(kwargs["num_hidden_layers"])]


def _starcoder2(gguf: GGUFFile, kwargs: dict) -> None:
    kwargs["norm_epsilon"] = float(gguf.arch_value("attention.layer_norm_epsilon", 1e-5))
    kwargs["use_bias"] = _has_qkv_bias(gguf)
    # The converter writes no window (llama.cpp attends over the whole context); one a file states is kept.
    kwargs["sliding_window"] = _window(gguf)


def _floats(gguf: GGUFFile, name: str) -> list[float]:
    from tokenmill.quantization.gguf import dequantize
    info = gguf.tensors[name]
    return dequantize(gguf.raw(name), info.qtype, info.shape).flatten().tolist()


_GEMMA_NAMES = {"post_attention_norm": "post_attention_layernorm", "ffn_norm": "pre_feedforward_layernorm",
                "post_ffw_norm": "post_feedforward_layernorm"}
_POST_NORM_NAMES = {"post_attention_norm": "post_attention_layernorm", "post_ffw_norm": "post_feedforward_layernorm"}

# GGUF general.architecture -> how to read it.
FAMILIES: dict[str, GGUFFamily] = {
    "llama": GGUFFamily("llama", "LlamaForCausalLM", _llama, permuted_qk=True, plain_config=True, variant=_mixtral),
    "mistral": GGUFFamily("mistral", "MistralForCausalLM", _llama_like, permuted_qk=True, plain_config=True),
    "qwen2": GGUFFamily("qwen2", "Qwen2ForCausalLM", _qwen2, plain_config=True),
    "qwen3": GGUFFamily("qwen3", "Qwen3ForCausalLM", _llama_like, plain_config=True),
    "qwen2moe": GGUFFamily("qwen2_moe", "Qwen2MoeForCausalLM", _qwen2moe),
    "qwen3moe": GGUFFamily("qwen3_moe", "Qwen3MoeForCausalLM", _qwen3moe),
    "olmoe": GGUFFamily("olmoe", "OlmoeForCausalLM", _olmoe),
    "gemma2": GGUFFamily("gemma2", "Gemma2ForCausalLM", _gemma2, _GEMMA_NAMES, norm_shift=1.0),
    "gemma3": GGUFFamily("gemma3_text", "Gemma3ForCausalLM", _gemma3, _GEMMA_NAMES, norm_shift=1.0),
    "phi3": GGUFFamily("phi3", "Phi3ForCausalLM", _phi3, fused_ffn_up=True),
    "olmo2": GGUFFamily("olmo2", "Olmo2ForCausalLM", _olmo, _POST_NORM_NAMES, variant=_olmo3),
    "granite": GGUFFamily("granite", "GraniteForCausalLM", _granite, permuted_qk=True),
    "granitemoe": GGUFFamily("granitemoe", "GraniteMoeForCausalLM", _granitemoe, permuted_qk=True,
                             variant=_granitemoe_shared),
    # GlmForCausalLM (and THUDM's ChatGLM checkpoints) convert to "chatglm".
    "chatglm": GGUFFamily("glm", "GlmForCausalLM", _glm, fused_ffn_up=True),
    "glm4": GGUFFamily("glm4", "Glm4ForCausalLM", _glm, {"post_attention_norm": "post_self_attn_layernorm",
                                                          "ffn_norm": "post_attention_layernorm",
                                                          "post_ffw_norm": "post_mlp_layernorm"},
                       fused_ffn_up=True),
    "cohere2": GGUFFamily("cohere2", "Cohere2ForCausalLM", _cohere2),
    "exaone4": GGUFFamily("exaone4", "Exaone4ForCausalLM", _exaone4, _POST_NORM_NAMES),
    "smollm3": GGUFFamily("smollm3", "SmolLM3ForCausalLM", _smollm3, permuted_qk=True),
    "starcoder2": GGUFFamily("starcoder2", "Starcoder2ForCausalLM", _starcoder2,
                             {"ffn_up": "mlp.c_fc", "ffn_down": "mlp.c_proj"}),
}


def family_of(gguf: GGUFFile) -> GGUFFamily:
    arch = gguf.architecture
    if arch not in FAMILIES:
        raise ValueError(f"GGUF architecture {arch!r} is not supported; supported: {sorted(FAMILIES)}")
    return FAMILIES[arch]


def build_config(family: GGUFFamily, model_type: str, kwargs: dict[str, Any]) -> Any:
    """The config object. For the plain families, a bare PretrainedConfig holding exactly the values
    the GGUF states when those are all the model needs: importing transformers' per-architecture
    config modules costs seconds of start-up (they pull in torch.distributed.tensor through
    transformers' kernels integration) for nothing but defaults. Sliding windows, rope scaling and
    every other family keep the architecture's own class: its derived fields matter there."""
    if (family.plain_config and "sliding_window" not in kwargs and "rope_scaling" not in kwargs
            and "num_local_experts" not in kwargs):
        from transformers import PretrainedConfig
        config = PretrainedConfig(**kwargs)
        config.model_type = model_type
        return config
    from transformers import AutoConfig
    return AutoConfig.for_model(model_type, **kwargs)
