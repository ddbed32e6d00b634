"""The Llama decoder family (Llama 2/3, SmolLM2, Mistral) and the model contract every dense family
keeps: the network is core/models/decoder.py's, the other families subclass this class and state
where they differ (core/models/families.py; Qwen2 and Qwen3 in their own files)."""
from __future__ import annotations

from typing import Any, ClassVar, Optional

import torch
from torch import nn

from tokenmill.attention_backends.interface import AttentionConfig
from tokenmill.platforms.interface import DecoderLayerSpec, DecoderStackSpec, LayerStructure
from tokenmill.quantization.interface import QuantizationMethod
from tokenmill.quantization.unquantized import UnquantizedLinearMethod

from ..layers.activation import activation_constants, activation_kind
from ..layers.attention import Attention
from ..layers.embedding import LMHead
from ..layers.norm import LayerNorm, RMSNorm
from ..layers.rotary import is_per_layer_type, rope_parameters
from .decoder import DecoderModel, PPMissingLayer, head_dim, layer_type, sliding_window


class LlamaForCausalLM(nn.Module):
    """The model contract the engine relies on: built as cls(hf_config, attn_backend_cls, dtype,
    kv_cache_dtype, quant_method); `attention_config(...)` before building (the backend is chosen
    from it); `packed_modules_mapping` and per-parameter weight loaders for the generic loader
    (core/loaders/weights.py); `attention_layers`, forward(input_ids, positions, attn_metadata)
    and compute_logits(hidden) for the model runner; `decoder_stack()` for decode programs.

    Its switches and config readings are Llama's; every other dense family is a subclass that
    overrides where it differs (core/models/families.py)."""
    # What is fixed for the family.
    norm_kind: ClassVar[str] = "rms"               # "rms" | "layer" (LayerNorm with bias) | "layer_nobias"
    norm_offset: ClassVar[float] = 0.0             # Gemma's (1 + w)
    norm_placement: ClassVar[str] = "pre"          # see NORM_SLOTS
    norm_names: ClassVar[dict[str, str]] = {}      # slot -> checkpoint name, where the family renames one
    qk_norm: ClassVar[str] = "none"                # "none" | "head" (per head, Qwen3) | "projection" (OLMo 2)
    interleaved_rope: ClassVar[bool] = False       # GPT-J pairs (GLM, Cohere) instead of rotate-half
    parallel_block: ClassVar[bool] = False
    ffn: ClassVar[str] = "dense"                   # "dense" (gated) | "plain"
    plain_mlp_names: ClassVar[tuple[str, str]] = ("up_proj", "down_proj")
    # Our fused module -> the HF tensors it is loaded from, with each one's output shard.
    packed_modules_mapping: ClassVar[dict[str, list[tuple[str, int]]]] = {
        "qkv_proj": [("q_proj", 0), ("k_proj", 1), ("v_proj", 2)],
        "gate_up_proj": [("gate_proj", 0), ("up_proj", 1)],
    }
    # LoRA targets that are one unfused layer each (the fused ones come from packed_modules_mapping).
    lora_plain_modules: ClassVar[tuple[str, ...]] = ("o_proj", "down_proj")
    # Checkpoint tensors that are not weights here (older HF checkpoints store the rope table).
    ignored_weights: ClassVar[tuple[str, ...]] = ("rotary_emb.inv_freq",)
    # What `tokenmill models` lists (core/models/features.py): (supported, how / why not).
    features: ClassVar[dict[str, tuple[bool, str]]] = {
        "tp": (True, "heads, MLP and vocabulary split over ranks"),
        "pp": (True, "contiguous layers per stage"),
        "lora": (True, "q/k/v/o and gate/up/down adapters"),
        "quantization": (True, "every registered method the platform offers; GGUF files"),
        "fast_path": (True, "decoder_stack(): the platform's decode program"),
        "sliding_window": (True, "per layer (Mistral, Qwen2 max_window_layers, layer_types)"),
        "pooling": (True, "runner='pooling': LAST/MEAN pooling of the final hidden states"),
    }

    # What the family's HF config decides (Llama's reading by default).
    @classmethod
    def qkv_bias(cls, config: Any) -> bool:
        return bool(getattr(config, "attention_bias", False))

    @classmethod
    def o_bias(cls, config: Any) -> bool:
        return bool(getattr(config, "attention_bias", False))

    @classmethod
    def mlp_bias(cls, config: Any) -> bool:
        return bool(getattr(config, "mlp_bias", False))

    @classmethod
    def attention_scale(cls, config: Any) -> float:
        return head_dim(config) ** -0.5

    @classmethod
    def attn_softcap(cls, config: Any) -> Optional[float]:
        return None

    @classmethod
    def embedding_scale(cls, config: Any) -> float:
        return 1.0

    @classmethod
    def final_logit_softcap(cls, config: Any) -> Optional[float]:
        return None

    @classmethod
    def logit_scale(cls, config: Any) -> float:
        return 1.0

    @classmethod
    def uses_rope(cls, config: Any, layer_idx: int) -> bool:
        return True

    @classmethod
    def activation(cls, config: Any) -> str:
        return activation_kind(getattr(config, "hidden_act", None) or getattr(config, "hidden_activation", "silu"))

    @classmethod
    def residual_scale(cls, config: Any) -> float:
        return 1.0

    @classmethod
    def layer_structure(cls, config: Any, layer_idx: int) -> LayerStructure:
        """Layer `layer_idx` in the shared vocabulary, from the family's switches and its config."""
        partial = float(rope_parameters(config)["partial_rotary_factor"])
        kind = layer_type(config, layer_idx)
        return LayerStructure(
            norm=cls.norm_kind, norm_offset=cls.norm_offset, norm_placement=cls.norm_placement,
            rotary=("gptj" if cls.interleaved_rope else "neox") if cls.uses_rope(config, layer_idx) else "none",
            rotary_dim=None if partial == 1.0 else int(head_dim(config) * partial),
            rope_table=kind if kind and is_per_layer_type(getattr(config, "rope_parameters", None)) else "default",
            attn_logit_softcap=cls.attn_softcap(config), activation=cls.activation(config), ffn=cls.ffn,
            parallel_block=cls.parallel_block, residual_scale=cls.residual_scale(config),
            qk_norm=cls.qk_norm)

    @classmethod
    def make_norm(cls, config: Any, size: int, dtype: torch.dtype) -> nn.Module:
        if cls.norm_kind == "rms":
            return RMSNorm(size, getattr(config, "rms_norm_eps", 1e-6), dtype, offset=cls.norm_offset)
        eps = getattr(config, "layer_norm_eps", None) or getattr(config, "norm_epsilon", None) or 1e-5
        return LayerNorm(size, eps, dtype, bias=cls.norm_kind == "layer")

    def __init__(self, hf_config: Any, attn_backend_cls: type, dtype: torch.dtype,
                 kv_cache_dtype: str = "auto", quant_method: Optional[QuantizationMethod] = None) -> None:
        super().__init__()
        self.config = hf_config
        self.dtype = dtype
        quant_method = quant_method or UnquantizedLinearMethod()
        self.model = DecoderModel(hf_config, type(self), attn_backend_cls, dtype, kv_cache_dtype, quant_method)
        self.tie_word_embeddings = bool(getattr(hf_config, "tie_word_embeddings", False))
        stage = self.model
        # A tied head on a last stage that is not the first loads its own copy (of embed_tokens).
        tied = self.tie_word_embeddings and stage.is_first_stage
        self.lm_head = LMHead(hf_config.vocab_size, hf_config.hidden_size, dtype,
                              tied_to=stage.embed_tokens if tied else None,
                              quant_method=quant_method.lm_head_method()) if stage.is_last_stage else PPMissingLayer()
        self.final_softcap = self.final_logit_softcap(hf_config)
        self.output_scale = self.logit_scale(hf_config)
        self.attention_layers: list[Attention] = [layer.self_attn.attn
                                                  for layer in stage.layers[stage.start_layer:stage.end_layer]]

    @classmethod
    def attention_config(cls, hf_config: Any, dtype: torch.dtype, kv_cache_dtype: str = "auto",
                         block_size: int = 16, graph_capture: str = "none", device: str = "cpu") -> AttentionConfig:
        """What the attention layers will ask of a backend, known before the model is built. With
        a window on only some layers, the window: the backend must support it for those."""
        windows = {sliding_window(hf_config, i) for i in range(hf_config.num_hidden_layers)} - {None}
        num_heads = hf_config.num_attention_heads
        return AttentionConfig(
            head_size=head_dim(hf_config), num_heads=num_heads,
            num_kv_heads=getattr(hf_config, "num_key_value_heads", None) or num_heads, dtype=dtype,
            kv_cache_dtype=kv_cache_dtype, block_size=block_size, sliding_window=max(windows, default=None),
            logits_soft_cap=cls.attn_softcap(hf_config), graph_capture=graph_capture, device=device)

    def forward(self, input_ids: torch.LongTensor, positions: torch.LongTensor, attn_metadata,
                intermediate: Optional[torch.Tensor] = None) -> torch.Tensor:
        return self.model(input_ids, positions, attn_metadata, intermediate)

    def checkpoint_name(self, name: str) -> Optional[str]:
        """None for a checkpoint tensor another pipeline stage holds (and a tied head's copy of the
        embedding, stored as lm_head, on a last stage that is not the first)."""
        stage = self.model
        if stage.is_first_stage and stage.is_last_stage:
            return name
        if name.startswith("model.layers."):
            index = int(name.split(".")[2])
            return name if stage.start_layer <= index < stage.end_layer else None
        if name.startswith("model.embed_tokens."):
            if stage.is_first_stage:
                return name
            return "lm_head.weight" if stage.is_last_stage and self.tie_word_embeddings else None
        if name.startswith("model.norm.") or name.startswith("lm_head."):
            return name if stage.is_last_stage else None
        return name

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden)
        if self.output_scale != 1.0:
            logits = logits * self.output_scale
        if self.final_softcap:
            logits = torch.tanh(logits / self.final_softcap) * self.final_softcap
        return logits

    def decoder_stack(self) -> DecoderStackSpec:
        """This network as a platform's decode program reads it (platforms/interface.py)."""
        model, attn0 = self.model, self.model.layers[0].self_attn

        def weight(norm: Optional[nn.Module]) -> Optional[torch.Tensor]:
            return norm.weight if norm is not None else None

        def biases(layer: nn.Module) -> dict[str, torch.Tensor]:
            found = {slot: getattr(layer.norm(slot), "bias", None) for slot in layer.norm_names}
            return {slot: bias for slot, bias in found.items() if bias is not None}

        layers = [DecoderLayerSpec(
            input_norm=weight(layer.norm("attn_in")), post_norm=weight(layer.norm("ffn_in")),
            attn_out_norm=weight(layer.norm("attn_out")), ffn_out_norm=weight(layer.norm("ffn_out")),
            norm_bias=biases(layer), qkv=layer.self_attn.qkv_proj, o=layer.self_attn.o_proj,
            gate_up=getattr(layer.mlp, "up", None), down=getattr(layer.mlp, "down", None),    # None: an expert FFN
            attention=layer.self_attn.attn,
            q_norm=weight(layer.self_attn.q_norm), k_norm=weight(layer.self_attn.k_norm), structure=layer.structure,
            cos_sin=layer.self_attn.rotary_emb.cos_sin_cache if layer.self_attn.rotary_emb is not None else None,
            activation_constants=activation_constants(getattr(layer.mlp, "act_fn", None)), eager=layer)
            for layer in model.layers]
        return DecoderStackSpec(
            embedding=model.embed_tokens.weight, final_norm=model.norm.weight, eps=float(model.norm.eps),
            cos_sin=model.rotary_emb.cos_sin_cache, num_heads=attn0.num_heads, num_kv_heads=attn0.num_kv_heads,
            head_size=attn0.head_dim, hidden_size=self.config.hidden_size,
            intermediate_size=self.config.intermediate_size, layers=layers, embed=model.embed_tokens,
            embedding_scale=model.embedding_scale, final_logit_softcap=self.final_softcap,
            logit_scale=self.output_scale, final_norm_bias=getattr(model.norm, "bias", None))


class MistralForCausalLM(LlamaForCausalLM):
    """Same network as Llama; Mistral configs add a sliding window, handled per layer."""
