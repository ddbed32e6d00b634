"""The Llama decoder family (Llama 2/3, SmolLM2, Mistral); Qwen2/Qwen3 subclass it.

Runs on a flat batch: input_ids/positions are [T] over all scheduled tokens of all sequences;
the attention backend sorts out which token attends to which through attn_metadata.
"""
from __future__ import annotations

from typing import Any, ClassVar, Optional

import torch
from torch import nn

from tokenmill.attention_backends.interface import AttentionConfig
from tokenmill.platforms.interface import DecoderLayerSpec, DecoderStackSpec
from tokenmill.quantization.interface import QuantizationMethod
from tokenmill.quantization.unquantized import UnquantizedLinearMethod

from .. import distributed
from ..layers.activation import SiluAndMul
from ..layers.attention import Attention
from ..layers.embedding import LMHead, VocabEmbedding
from ..layers.linear import Linear
from ..layers.norm import RMSNorm
from ..layers.rotary import RotaryEmbedding, get_rope


def _head_dim(config: Any) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def _sliding_window(config: Any, layer_idx: int) -> Optional[int]:
    """The layer's attention window, or None for full attention."""
    window = getattr(config, "sliding_window", None)
    if not window:
        return None
    layer_types = getattr(config, "layer_types", None)
    if layer_types:
        return window if layer_types[layer_idx] == "sliding_attention" else None
    if getattr(config, "use_sliding_window", True) is False:   # Qwen2 keeps a window it does not use
        return None
    max_window_layers = getattr(config, "max_window_layers", None)
    if max_window_layers is not None and layer_idx >= max_window_layers:
        return None
    return window


class LlamaAttention(nn.Module):
    def __init__(self, config: Any, layer_idx: int, rotary: RotaryEmbedding, attn_backend_cls: type,
                 dtype: torch.dtype, kv_cache_dtype: str, qkv_bias: bool, o_bias: bool, qk_norm: bool,
                 quant_method: QuantizationMethod) -> None:
        super().__init__()
        total_heads = config.num_attention_heads
        total_kv_heads = getattr(config, "num_key_value_heads", None) or total_heads
        self.head_dim = d = _head_dim(config)
        # Tensor parallelism: each rank holds 1/tp of the query heads and the KV heads they read
        # (one KV head replicated over tp/num_kv ranks when there are fewer KV heads than ranks).
        rank, tp = distributed.tp_rank(), distributed.tp_size()
        self.num_heads = total_heads // tp
        self.num_kv_heads = max(1, total_kv_heads // tp)
        first_kv = rank * total_kv_heads // tp if total_kv_heads < tp else rank * self.num_kv_heads
        self.q_size = self.num_heads * d
        self.kv_size = self.num_kv_heads * d
        kv_slice = (first_kv * d, self.kv_size)
        self.qkv_proj = Linear(config.hidden_size, [total_heads * d, total_kv_heads * d, total_kv_heads * d],
                               bias=qkv_bias, dtype=dtype, quant_method=quant_method, parallel="column",
                               shard_slices=[(rank * self.q_size, self.q_size), kv_slice, kv_slice])
        self.o_proj = Linear(total_heads * d, config.hidden_size, bias=o_bias, dtype=dtype, quant_method=quant_method,
                             parallel="row")
        self.rotary_emb = rotary
        if qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps, dtype)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps, dtype)
        else:
            self.q_norm = self.k_norm = None
        self.attn = Attention(self.num_heads, self.head_dim, self.head_dim ** -0.5, self.num_kv_heads,
                              attn_backend_cls, sliding_window=_sliding_window(config, layer_idx),
                              kv_cache_dtype=kv_cache_dtype)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, attn_metadata) -> torch.Tensor:
        t = hidden.shape[0]
        qkv = self.qkv_proj(hidden)
        # q and k are adjacent in the fused output: rotate them as one [T, H + Hkv, D] tensor.
        qk = qkv[:, :self.q_size + self.kv_size].view(t, self.num_heads + self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            qk = torch.cat((self.q_norm(qk[:, :self.num_heads]), self.k_norm(qk[:, self.num_heads:])), dim=1)
        qk = self.rotary_emb(positions, qk)
        q = qk[:, :self.num_heads].flatten(1)
        k = qk[:, self.num_heads:].flatten(1)
        v = qkv[:, self.q_size + self.kv_size:]
        return self.o_proj(self.attn(q, k, v, attn_metadata))


class LlamaMLP(nn.Module):
    def __init__(self, config: Any, dtype: torch.dtype, bias: bool, quant_method: QuantizationMethod) -> None:
        super().__init__()
        act = getattr(config, "hidden_act", "silu")
        if act not in ("silu", "swish"):
            raise ValueError(f"activation {act!r} is not supported (only silu)")
        self.gate_up_proj = Linear(config.hidden_size, [config.intermediate_size] * 2, bias=bias, dtype=dtype,
                                   quant_method=quant_method, parallel="column")
        self.down_proj = Linear(config.intermediate_size, config.hidden_size, bias=bias, dtype=dtype,
                                quant_method=quant_method, parallel="row")
        self.act_fn = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: Any, layer_idx: int, rotary: RotaryEmbedding, attn_backend_cls: type,
                 dtype: torch.dtype, kv_cache_dtype: str, qkv_bias: bool, o_bias: bool, qk_norm: bool,
                 quant_method: QuantizationMethod) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(config, layer_idx, rotary, attn_backend_cls, dtype, kv_cache_dtype,
                                        qkv_bias, o_bias, qk_norm, quant_method)
        self.mlp = LlamaMLP(config, dtype, bool(getattr(config, "mlp_bias", False)), quant_method)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, residual: Optional[torch.Tensor],
                attn_metadata) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(positions, hidden, attn_metadata)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class LlamaModel(nn.Module):
    def __init__(self, config: Any, attn_backend_cls: type, dtype: torch.dtype, kv_cache_dtype: str,
                 qkv_bias: bool, o_bias: bool, qk_norm: bool, quant_method: QuantizationMethod) -> None:
        super().__init__()
        # Pipeline parallelism: this stage builds only its layers (the others are PPMissingLayer,
        # holding nothing); the first stage embeds, the last one applies the final norm.
        state = distributed.get_state()
        self.start_layer, self.end_layer = distributed.stage_layers(config.num_hidden_layers, state.pp_rank,
                                                                    state.pp_size)
        self.is_first_stage, self.is_last_stage = state.is_first_stage, state.is_last_stage
        self.embed_tokens = VocabEmbedding(config.vocab_size, config.hidden_size, dtype) \
            if self.is_first_stage else PPMissingLayer()
        # One cos/sin table shared by every layer.
        rotary = get_rope(config, _head_dim(config), config.max_position_embeddings, dtype)
        self.rotary_emb = rotary
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, i, rotary, attn_backend_cls, dtype, kv_cache_dtype, qkv_bias, o_bias, qk_norm,
                              quant_method) if self.start_layer <= i < self.end_layer else PPMissingLayer()
            for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype) if self.is_last_stage else PPMissingLayer()

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn_metadata,
                intermediate: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The final hidden states; at a pipeline stage that is not the last, [2, T, H] hidden and
        residual for the next stage, which passes them back in as `intermediate`."""
        self.rotary_emb.new_forward()
        if intermediate is None:
            hidden, residual = self.embed_tokens(input_ids), None
        else:
            hidden, residual = intermediate[0], intermediate[1]
        for layer in self.layers[self.start_layer:self.end_layer]:
            hidden, residual = layer(positions, hidden, residual, attn_metadata)
        if not self.is_last_stage:
            return torch.stack((hidden, residual))
        hidden, _ = self.norm(hidden, residual)
        return hidden


class PPMissingLayer(nn.Identity):
    """A layer another pipeline stage holds: no parameters here (the loader skips its weights)."""


class LlamaForCausalLM(nn.Module):
    """The model contract the engine relies on: built as cls(hf_config, attn_backend_cls, dtype,
    kv_cache_dtype, quant_method); `attention_config(...)` before building (the backend is chosen
    from it); `packed_modules_mapping` and per-parameter weight loaders for the generic loader
    (core/loaders/weights.py); `attention_layers`, forward(input_ids, positions, attn_metadata)
    and compute_logits(hidden) for the model runner."""
    # Per-architecture switches the subclasses flip; None = read from the config.
    qkv_bias: Optional[bool] = None
    o_bias: Optional[bool] = None
    qk_norm: bool = False
    # Our fused module -> the HF tensors it is loaded from, with each one's output shard.
    packed_modules_mapping: ClassVar[dict[str, list[tuple[str, int]]]] = {
        "qkv_proj": [("q_proj", 0), ("k_proj", 1), ("v_proj", 2)],
        "gate_up_proj": [("gate_proj", 0), ("up_proj", 1)],
    }
    # Checkpoint tensors that are not weights here (older HF checkpoints store the rope table).
    ignored_weights: ClassVar[tuple[str, ...]] = ("rotary_emb.inv_freq",)
    # What `tokenmill models` lists (core/models/features.py): (supported, how / why not).
    features: ClassVar[dict[str, tuple[bool, str]]] = {
        "tp": (True, "heads, MLP and vocabulary split over ranks"),
        "pp": (True, "contiguous layers per stage"),
        "lora": (True, "q/k/v/o and gate/up/down adapters"),
        "quantization": (True, "every registered method the platform offers; GGUF files"),
        "fast_path": (True, "decoder_stack(): the cpu platform's fused decode step"),
        "sliding_window": (True, "per layer (Mistral, Qwen2 max_window_layers, layer_types)"),
        "pooling": (True, "runner='pooling': LAST/MEAN pooling of the final hidden states"),
    }

    def __init__(self, hf_config: Any, attn_backend_cls: type, dtype: torch.dtype,
                 kv_cache_dtype: str = "auto", quant_method: Optional[QuantizationMethod] = None) -> None:
        super().__init__()
        self.config = hf_config
        self.dtype = dtype
        quant_method = quant_method or UnquantizedLinearMethod()
        attention_bias = bool(getattr(hf_config, "attention_bias", False))
        qkv_bias = attention_bias if self.qkv_bias is None else self.qkv_bias
        o_bias = attention_bias if self.o_bias is None else self.o_bias
        self.model = LlamaModel(hf_config, attn_backend_cls, dtype, kv_cache_dtype, qkv_bias, o_bias, self.qk_norm,
                                quant_method)
        self.tie_word_embeddings = bool(getattr(hf_config, "tie_word_embeddings", False))
        stage = self.model
        # A tied head on a last stage that is not the first loads its own copy (of embed_tokens).
        tied = self.tie_word_embeddings and stage.is_first_stage
        self.lm_head = LMHead(hf_config.vocab_size, hf_config.hidden_size, dtype,
                              tied_to=stage.embed_tokens if tied else None,
                              quant_method=quant_method.lm_head_method()) if stage.is_last_stage else PPMissingLayer()
        self.attention_layers: list[Attention] = [layer.self_attn.attn
                                                  for layer in stage.layers[stage.start_layer:stage.end_layer]]

    @classmethod
    def attention_config(cls, hf_config: Any, dtype: torch.dtype, kv_cache_dtype: str = "auto",
                         block_size: int = 16, graph_capture: str = "none", device: str = "cpu") -> AttentionConfig:
        """What the attention layers will ask of a backend, known before the model is built. With
        a window on only some layers, the window: the backend must support it for those."""
        windows = {_sliding_window(hf_config, i) for i in range(hf_config.num_hidden_layers)} - {None}
        num_heads = hf_config.num_attention_heads
        return AttentionConfig(
            head_size=_head_dim(hf_config), num_heads=num_heads,
            num_kv_heads=getattr(hf_config, "num_key_value_heads", None) or num_heads, dtype=dtype,
            kv_cache_dtype=kv_cache_dtype, block_size=block_size, sliding_window=max(windows, default=None),
            logits_soft_cap=None, graph_capture=graph_capture, device=device)

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
        return self.lm_head(hidden)

    def decoder_stack(self) -> DecoderStackSpec:
        """This network as a platform's fused decode step reads it (platforms/interface.py)."""
        model, attn0 = self.model, self.model.layers[0].self_attn
        layers = [DecoderLayerSpec(
            input_norm=layer.input_layernorm.weight, post_norm=layer.post_attention_layernorm.weight,
            qkv=layer.self_attn.qkv_proj, o=layer.self_attn.o_proj, gate_up=layer.mlp.gate_up_proj,
            down=layer.mlp.down_proj, attention=layer.self_attn.attn,
            q_norm=layer.self_attn.q_norm.weight if layer.self_attn.q_norm is not None else None,
            k_norm=layer.self_attn.k_norm.weight if layer.self_attn.k_norm is not None else None)
            for layer in model.layers]
        return DecoderStackSpec(
            embedding=model.embed_tokens.weight, final_norm=model.norm.weight, eps=float(model.norm.eps),
            cos_sin=model.rotary_emb.cos_sin_cache, num_heads=attn0.num_heads, num_kv_heads=attn0.num_kv_heads,
            head_size=attn0.head_dim, hidden_size=self.config.hidden_size,
            intermediate_size=self.config.intermediate_size, layers=layers, embed=model.embed_tokens)


class MistralForCausalLM(LlamaForCausalLM):
    """Same network as Llama; Mistral configs add a sliding window, handled per layer."""
