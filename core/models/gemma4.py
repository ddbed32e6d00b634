"""Gemma 4 text (`Gemma4ForCausalLM`, HF model_type "gemma4_text"), token-exact with transformers'
modeling_gemma4.py at float32.

What the network adds to Gemma 3, all read from Gemma4TextConfig:
- per-layer-type attention geometry: full-attention layers have their own head size
  (`global_head_dim`) and, with `attention_k_eq_v`, their own KV head count
  (`num_global_key_value_heads`) and no v_proj (the keys' projection is the values' too);
- q/k RMSNorms per head, an unscaled RMSNorm on the values, attention scale 1;
- rope per layer type: the local base on sliding layers, "proportional" rope on full layers
  (the first `partial_rotary_factor` of the frequencies rotate, the rest are zero: rotate-half over
  the whole head, not partial rotary);
- KV sharing: the last `num_kv_shared_layers` layers compute no K/V; each reads those of the last
  earlier layer of its type (its `producer`) and attends over that layer's cache, so it has no
  cache of its own (it is not among `attention_layers`) and its MLP may be twice as wide
  (`use_double_wide_mlp`);
- per-layer inputs (`hidden_size_per_layer_input`): a per-layer embedding table plus a projection
  of the token embedding, gated into the residual stream after each layer's FFN;
- a mixture-of-experts block beside the dense MLP (`enable_moe_block`; core/models/gemma4_moe.py);
- a learned scalar on each layer's output; (w)-scaled RMSNorms (not Gemma 3's 1 + w); final logit
  soft-capping.

The KV pool holds one geometry for every layer (core/model_runner.py sizes it from the first
attention layer). Where the layer types differ, every cache holds the widest head size and the KV
head count all of them divide into (`cache_geometry`): a narrower layer pads its q/k/v heads with
zeros (which change no dot product; scale is 1) and repeats its KV heads (which changes no
grouped-query pairing), and cuts its output back. Layers of the cache's own geometry pass through.
"""
from __future__ import annotations

import logging
import math
from typing import Any, ClassVar, Optional

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.attention_backends.interface import AttentionConfig
from tokenmill.quantization.interface import QuantizationMethod
from tokenmill.quantization.unquantized import UnquantizedLinearMethod

from .. import distributed
from ..layers.activation import Activation, GatedActivation, activation_kind
from ..layers.attention import Attention
from ..layers.embedding import LMHead, VocabEmbedding
from ..layers.linear import Linear
from ..layers.params import plain_parameter
from ..layers.rotary import RotaryEmbedding, is_per_layer_type, rope_parameters
from .gemma4_moe import Gemma4Experts, Gemma4RMSNorm, Gemma4Router

SLIDING = "sliding_attention"
logger = logging.getLogger("tokenmill.models.gemma4")


def layer_config(config: Any, layer_idx: int) -> Any:
    """The config as layer `layer_idx` reads it: transformers keeps the full-attention layers'
    head size and KV heads as per-layer overrides (`per_layer_config`)."""
    view = getattr(config, "per_layer_config", None)
    return view[layer_idx] if view is not None else config


def geometry(config: Any, layer_idx: int) -> tuple[int, int]:
    """(head size, KV heads) of layer `layer_idx`."""
    lc = layer_config(config, layer_idx)
    heads = config.num_attention_heads
    return (getattr(lc, "head_dim", None) or config.hidden_size // heads,
            getattr(lc, "num_key_value_heads", None) or heads)


def cache_geometry(config: Any) -> tuple[int, int]:
    """(KV heads, head size) of the shared KV pool: the widest head, and the fewest KV heads every
    layer's count divides (all the query heads where none does)."""
    shapes = {geometry(config, i) for i in range(config.num_hidden_layers)}
    kv_heads = math.lcm(*(kv for _, kv in shapes))
    if config.num_attention_heads % kv_heads:
        kv_heads = config.num_attention_heads
    return kv_heads, max(d for d, _ in shapes)


def kv_producers(config: Any) -> dict[int, int]:
    """KV-sharing layer -> the layer whose keys and values it reads: the last one of its type
    before the shared ones (transformers' "store" layer, `kv_sharing_modes`)."""
    num_layers, shared = config.num_hidden_layers, int(getattr(config, "num_kv_shared_layers", 0) or 0)
    if not shared:
        return {}
    first = num_layers - shared
    if first <= 0:
        raise ValueError("Gemma 4: num_kv_shared_layers covers every layer; no layer computes the keys and values "
                         "they would share (an assistant model's, which this engine does not run)")
    types = config.layer_types
    out = {}
    for i in range(first, num_layers):
        earlier = [j for j in range(first) if types[j] == types[i]]
        if not earlier:
            raise ValueError(f"Gemma 4: layer {i} ({types[i]}) shares KV but no earlier layer has its type")
        out[i] = earlier[-1]
    return out


def sliding_window(config: Any, layer_idx: int) -> Optional[int]:
    return config.sliding_window if config.layer_types[layer_idx] == SLIDING else None


def gemma4_rope(config: Any, layer_type: str, head_size: int, dtype: torch.dtype) -> RotaryEmbedding:
    """The cos/sin table of `layer_type`, over the whole head (proportional rope's unrotated
    frequencies are zero, so those dims pass through), with transformers' inverse frequencies."""
    per_type = is_per_layer_type(getattr(config, "rope_parameters", None))
    params = rope_parameters(config, layer_type if per_type else None)
    rope_type = params["rope_type"]
    if rope_type == "default":
        base = float(params["rope_theta"])
        inv_freq = 1.0 / (base ** (torch.arange(0, head_size, 2, dtype=torch.float) / head_size))
        scaling = 1.0
    elif rope_type in ("dynamic", "longrope"):
        raise NotImplementedError(f"Gemma 4: rope type {rope_type!r} (frequencies that change with the length)")
    else:
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
        kwargs = {"layer_type": layer_type} if per_type else {}
        inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](layer_config(config, config.layer_types.index(layer_type)),
                                                           torch.device("cpu"), **kwargs)
    return RotaryEmbedding(head_size, config.max_position_embeddings, inv_freq, float(scaling), dtype)


def _scale(x: torch.Tensor, value: float) -> torch.Tensor:
    """x times a constant held as transformers holds it (a float32 buffer cast to x's dtype)."""
    return x * torch.tensor(value, dtype=torch.float32).to(x.dtype)


class Gemma4Attention(nn.Module):
    def __init__(self, config: Any, layer_idx: int, producer: Optional[int], stores: bool,
                 rotary: RotaryEmbedding, attn_backend_cls: type, dtype: torch.dtype, kv_cache_dtype: str,
                 quant_method: QuantizationMethod) -> None:
        super().__init__()
        hidden, bias, eps = config.hidden_size, bool(config.attention_bias), config.rms_norm_eps
        self.layer_type = config.layer_types[layer_idx]
        self.head_dim, self.num_kv_heads = d, kv = geometry(config, layer_idx)
        self.num_heads = h = config.num_attention_heads
        self.cache_kv_heads, self.cache_head_size = cache_geometry(config)
        self.shares, self.stores = producer is not None, stores
        self.rotary_emb = rotary
        self.q_proj = Linear(hidden, h * d, bias=bias, dtype=dtype, quant_method=quant_method)
        self.q_norm = Gemma4RMSNorm(d, eps, dtype)
        self.o_proj = Linear(h * d, hidden, bias=bias, dtype=dtype, quant_method=quant_method)
        if not self.shares:
            self.k_proj = Linear(hidden, kv * d, bias=bias, dtype=dtype, quant_method=quant_method)
            keys_are_values = bool(getattr(config, "attention_k_eq_v", False)) and self.layer_type != SLIDING
            self.v_proj = None if keys_are_values else Linear(hidden, kv * d, bias=bias, dtype=dtype,
                                                              quant_method=quant_method)
            self.k_norm = Gemma4RMSNorm(d, eps, dtype)
            self.v_norm = Gemma4RMSNorm(d, eps, dtype, with_scale=False)
            # Scale 1: the q/k norms take the place of 1/sqrt(d).
            self.attn = Attention(h, self.cache_head_size, 1.0, self.cache_kv_heads, attn_backend_cls,
                                  sliding_window=sliding_window(config, layer_idx), kv_cache_dtype=kv_cache_dtype)

    def _to_cache(self, x: torch.Tensor, kv: bool = True) -> torch.Tensor:
        """[T, heads, d] -> [T, heads * size] in the pool's geometry: KV heads repeated (`kv`),
        heads zero-padded to its head size."""
        if kv and self.num_kv_heads != self.cache_kv_heads:
            x = x.repeat_interleave(self.cache_kv_heads // self.num_kv_heads, dim=1)
        if self.head_dim != self.cache_head_size:
            x = F.pad(x, (0, self.cache_head_size - self.head_dim))
        return x.flatten(1)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, attn_metadata,
                shared: dict[str, tuple[torch.Tensor, torch.Tensor, Attention]]) -> torch.Tensor:
        t, d = hidden.shape[0], self.head_dim
        q = self.rotary_emb(positions, self.q_norm(self.q_proj(hidden).view(t, self.num_heads, d)))
        if self.shares:
            # The producer's keys and values of this step, written again to the same slots of its
            # cache (the same values) as its attention layer attends over them and the cached ones.
            k, v, attn = shared[self.layer_type]
        else:
            k = self.k_proj(hidden).view(t, self.num_kv_heads, d)
            v = self.v_proj(hidden).view(t, self.num_kv_heads, d) if self.v_proj is not None else k
            k = self._to_cache(self.rotary_emb(positions, self.k_norm(k)))
            v = self._to_cache(self.v_norm(v))
            attn = self.attn
            if self.stores:
                shared[self.layer_type] = (k, v, attn)
        out = attn(self._to_cache(q, kv=False), k, v, attn_metadata)
        if self.head_dim != self.cache_head_size:
            out = out.view(t, self.num_heads, self.cache_head_size)[..., :d].reshape(t, self.num_heads * d)
        return self.o_proj(out)


class Gemma4MLP(nn.Module):
    """gate/up (loaded into one fused `gate_up_proj`) -> act(gate) * up -> down."""

    def __init__(self, hidden: int, intermediate: int, kind: str, dtype: torch.dtype,
                 quant_method: QuantizationMethod) -> None:
        super().__init__()
        self.gate_up_proj = Linear(hidden, [intermediate] * 2, dtype=dtype, quant_method=quant_method)
        self.down_proj = Linear(intermediate, hidden, dtype=dtype, quant_method=quant_method)
        self.act_fn = GatedActivation(kind)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class Gemma4DecoderLayer(nn.Module):
    NORMS = ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm", "post_feedforward_layernorm")
    MOE_NORMS = ("post_feedforward_layernorm_1", "post_feedforward_layernorm_2", "pre_feedforward_layernorm_2")
    input_layernorm: Gemma4RMSNorm
    post_attention_layernorm: Gemma4RMSNorm
    pre_feedforward_layernorm: Gemma4RMSNorm
    post_feedforward_layernorm: Gemma4RMSNorm
    post_feedforward_layernorm_1: Gemma4RMSNorm
    post_feedforward_layernorm_2: Gemma4RMSNorm
    pre_feedforward_layernorm_2: Gemma4RMSNorm

    def __init__(self, config: Any, layer_idx: int, producer: Optional[int], stores: bool,
                 rotary: RotaryEmbedding, attn_backend_cls: type, dtype: torch.dtype, kv_cache_dtype: str,
                 quant_method: QuantizationMethod) -> None:
        super().__init__()
        hidden, eps = config.hidden_size, config.rms_norm_eps
        kind = activation_kind(config.hidden_activation)
        self.self_attn = Gemma4Attention(config, layer_idx, producer, stores, rotary, attn_backend_cls, dtype,
                                         kv_cache_dtype, quant_method)
        wide = bool(getattr(config, "use_double_wide_mlp", False)) and producer is not None
        self.mlp = Gemma4MLP(hidden, config.intermediate_size * (2 if wide else 1), kind, dtype, quant_method)
        self.moe = bool(getattr(config, "enable_moe_block", False))
        for name in self.NORMS + (self.MOE_NORMS if self.moe else ()):
            setattr(self, name, Gemma4RMSNorm(hidden, eps, dtype))
        if self.moe:
            self.router = Gemma4Router(config, dtype)
            self.experts = Gemma4Experts(config, kind, dtype)
        self.per_layer_size = int(getattr(config, "hidden_size_per_layer_input", 0) or 0)
        if self.per_layer_size:
            self.act_fn = Activation(kind)
            self.per_layer_input_gate = Linear(hidden, self.per_layer_size, dtype=dtype, quant_method=quant_method)
            self.per_layer_projection = Linear(self.per_layer_size, hidden, dtype=dtype, quant_method=quant_method)
            self.post_per_layer_input_norm = Gemma4RMSNorm(hidden, eps, dtype)
        self.layer_scalar = plain_parameter(1, dtype=dtype)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, per_layer_input: Optional[torch.Tensor],
                attn_metadata, shared: dict) -> torch.Tensor:
        residual = hidden
        hidden = self.self_attn(positions, self.input_layernorm(hidden), attn_metadata, shared)
        hidden = residual + self.post_attention_layernorm(hidden)
        residual = hidden
        hidden = self.mlp(self.pre_feedforward_layernorm(hidden))
        if self.moe:      # the experts read the stream before the FFN, beside the dense MLP
            weights, experts = self.router(residual)
            routed = self.experts(self.pre_feedforward_layernorm_2(residual), experts, weights)
            hidden = self.post_feedforward_layernorm_1(hidden) + self.post_feedforward_layernorm_2(routed)
        hidden = residual + self.post_feedforward_layernorm(hidden)
        if self.per_layer_size:
            gate = self.act_fn(self.per_layer_input_gate(hidden)) * per_layer_input
            hidden = hidden + self.post_per_layer_input_norm(self.per_layer_projection(gate))
        return hidden * self.layer_scalar


class Gemma4TextModel(nn.Module):
    embed_tokens_per_layer: VocabEmbedding
    per_layer_model_projection: Linear
    per_layer_projection_norm: Gemma4RMSNorm
    def __init__(self, config: Any, attn_backend_cls: type, dtype: torch.dtype, kv_cache_dtype: str,
                 quant_method: QuantizationMethod) -> None:
        super().__init__()
        num_layers, hidden = config.num_hidden_layers, config.hidden_size
        self.hidden_size = hidden
        self.embed_tokens = VocabEmbedding(config.vocab_size, hidden, dtype)
        self.producers = kv_producers(config)
        stores = set(self.producers.values())
        rotaries = {kind: gemma4_rope(config, kind, geometry(config, config.layer_types.index(kind))[0], dtype)
                    for kind in sorted(set(config.layer_types))}
        self.rotaries = nn.ModuleDict(rotaries)
        self.decoder_layers = [
            Gemma4DecoderLayer(config, i, self.producers.get(i), i in stores, rotaries[config.layer_types[i]],
                               attn_backend_cls, dtype, kv_cache_dtype, quant_method)
            for i in range(num_layers)]
        self.layers = nn.ModuleList(self.decoder_layers)
        self.norm = Gemma4RMSNorm(hidden, config.rms_norm_eps, dtype)
        self.per_layer_size = size = int(getattr(config, "hidden_size_per_layer_input", 0) or 0)
        if size:
            self.embed_tokens_per_layer = VocabEmbedding(config.vocab_size_per_layer_input, num_layers * size, dtype)
            self.per_layer_model_projection = Linear(hidden, num_layers * size, dtype=dtype, quant_method=quant_method)
            self.per_layer_projection_norm = Gemma4RMSNorm(size, config.rms_norm_eps, dtype)

    def per_layer_inputs(self, input_ids: torch.Tensor, embeds: torch.Tensor) -> torch.Tensor:
        """[T, layers, size]: the token's per-layer embedding and the projection of its embedding,
        averaged (times 1/sqrt(2), as transformers sums and scales them)."""
        shape = (input_ids.shape[0], len(self.layers), self.per_layer_size)
        tokens = _scale(self.embed_tokens_per_layer(input_ids), self.per_layer_size ** 0.5).reshape(shape)
        projected = self.per_layer_model_projection(embeds) * self.hidden_size ** -0.5
        projected = self.per_layer_projection_norm(projected.reshape(shape))
        return (projected + tokens) * 2.0 ** -0.5

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn_metadata) -> torch.Tensor:
        for rotary in self.rotaries.values():
            rotary.new_forward()      # type: ignore[operator]
        hidden = _scale(self.embed_tokens(input_ids), self.hidden_size ** 0.5)
        per_layer = self.per_layer_inputs(input_ids, hidden) if self.per_layer_size else None
        shared: dict = {}          # layer type -> (keys, values, attention layer) of its producer this step
        for i, layer in enumerate(self.decoder_layers):
            hidden = layer(positions, hidden, per_layer[:, i] if per_layer is not None else None, attn_metadata, shared)
        return self.norm(hidden)


class Gemma4ForCausalLM(nn.Module):
    """The model contract of core/models/llama.py:LlamaForCausalLM for Gemma 4's network; no
    `decoder_stack()`, so it runs eagerly."""
    packed_modules_mapping: ClassVar[dict[str, list[tuple[str, int]]]] = {
        "gate_up_proj": [("gate_proj", 0), ("up_proj", 1)]}
    lora_plain_modules: ClassVar[tuple[str, ...]] = ("q_proj", "k_proj", "v_proj", "o_proj", "down_proj")
    ignored_weights: ClassVar[tuple[str, ...]] = ()
    features: ClassVar[dict[str, tuple[bool, str]]] = {
        "tp": (False, "tensor_parallel_size=1: per-type head sizes, shared KV and experts are not split"),
        "pp": (False, "pipeline_parallel_size=1: KV-sharing layers read an earlier layer's cache"),
        "lora": (True, "q/k/v/o and the dense MLP's gate/up/down adapters (not the experts')"),
        "quantization": (False, "not verified for Gemma 4: run-time int8/int4/fp8 load into the dense projections; "
                                "experts, router and per-layer tables stay in the model dtype"),
        "fast_path": (False, "decode steps run eagerly: no decoder_stack() (per-layer inputs, shared KV, "
                             "per-type head sizes, experts)"),
        "sliding_window": (True, "sliding and full layers from layer_types; hybrid KV groups"),
        "pooling": (False, "not verified for Gemma 4"),
    }

    def __init__(self, hf_config: Any, attn_backend_cls: type, dtype: torch.dtype,
                 kv_cache_dtype: str = "auto", quant_method: Optional[QuantizationMethod] = None) -> None:
        super().__init__()
        check_supported(hf_config)
        if distributed.tp_size() > 1 or distributed.get_state().pp_size > 1:
            raise ValueError("Gemma4ForCausalLM runs with tensor_parallel_size=1 and pipeline_parallel_size=1")
        self.config = hf_config
        self.dtype = dtype
        quant_method = quant_method or UnquantizedLinearMethod()
        self.model = Gemma4TextModel(hf_config, attn_backend_cls, dtype, kv_cache_dtype, quant_method)
        self.tie_word_embeddings = bool(getattr(hf_config, "tie_word_embeddings", True))
        self.lm_head = LMHead(hf_config.vocab_size, hf_config.hidden_size, dtype,
                              tied_to=self.model.embed_tokens if self.tie_word_embeddings else None,
                              quant_method=quant_method.lm_head_method())
        self.final_softcap = getattr(hf_config, "final_logit_softcapping", None) or None
        kv_heads, head_size = cache_geometry(hf_config)
        padded = sorted({geometry(hf_config, i) for i in range(hf_config.num_hidden_layers)} - {(head_size, kv_heads)})
        if padded:
            logger.info("Gemma 4: every KV cache holds %d heads of %d; layers of (head size, KV heads) %s are "
                        "padded to it", kv_heads, head_size, ", ".join(map(str, padded)))
        # KV-sharing layers attend over their producer's cache: they hold none of their own.
        self.attention_layers: list[Attention] = [layer.self_attn.attn for layer in self.model.decoder_layers
                                                  if not layer.self_attn.shares]

    @classmethod
    def attention_config(cls, hf_config: Any, dtype: torch.dtype, kv_cache_dtype: str = "auto",
                         block_size: int = 16, graph_capture: str = "none", device: str = "cpu") -> AttentionConfig:
        check_supported(hf_config)
        kv_heads, head_size = cache_geometry(hf_config)
        windows = {w for i in range(hf_config.num_hidden_layers) if (w := sliding_window(hf_config, i)) is not None}
        return AttentionConfig(
            head_size=head_size, num_heads=hf_config.num_attention_heads, num_kv_heads=kv_heads, dtype=dtype,
            kv_cache_dtype=kv_cache_dtype, block_size=block_size, sliding_window=max(windows, default=None),
            graph_capture=graph_capture, device=device)

    def forward(self, input_ids: torch.LongTensor, positions: torch.LongTensor, attn_metadata,
                intermediate: Optional[torch.Tensor] = None) -> torch.Tensor:
        return self.model(input_ids, positions, attn_metadata)

    def checkpoint_name(self, name: str) -> Optional[str]:
        """None for a KV-sharing layer's K/V projections and norms, which checkpoints may carry and
        transformers too skips (`_keys_to_ignore_on_load_unexpected`)."""
        parts = name.split(".")
        if (len(parts) > 4 and parts[:2] == ["model", "layers"] and parts[3] == "self_attn"
                and parts[4] in ("k_proj", "v_proj", "k_norm", "v_norm") and int(parts[2]) in self.model.producers):
            return None
        return name

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden)
        if self.final_softcap:
            logits = torch.tanh(logits / self.final_softcap) * self.final_softcap
        return logits


def check_supported(config: Any) -> None:
    """ValueError naming what of a Gemma 4 text config this implementation does not run."""
    if getattr(config, "use_bidirectional_attention", None) == "all":
        raise ValueError("Gemma 4: use_bidirectional_attention='all' (bidirectional text attention) is not supported")
