"""The decoder network every dense family shares, composed per layer from the layer vocabulary
(platforms/interface.py LayerStructure): norm kind, offset and placement, q/k norms, rotary
layout, partial rotary and NoPE layers, per-layer rope tables and sliding windows, attention
soft-capping, gated or plain FFN with its activation, parallel blocks, residual scaling, biases.

A family (core/models/llama.py, families.py) is a subclass that states where it differs from Llama:
class attributes for what is fixed, classmethods for what its HF config decides. Runs on a flat
batch: input_ids/positions are [T] over all scheduled tokens of all sequences; the attention
backend sorts out which token attends to which through attn_metadata.
"""
from __future__ import annotations

from typing import Any, Optional

import torch
from torch import nn

from tokenmill.platforms.interface import LayerStructure
from tokenmill.quantization.interface import QuantizationMethod

from .. import distributed
from ..layers.activation import XIELU, Activation, GatedActivation, SiluAndMul
from ..layers.attention import Attention
from ..layers.embedding import VocabEmbedding
from ..layers.linear import Linear
from ..layers.rotary import RotaryEmbedding, get_rope

# Where each norm of a layer sits, by placement: slot -> the checkpoint's module name.
#   attn_in: before attention; attn_out: on attention's output; ffn_in / ffn_out: around the FFN.
NORM_SLOTS: dict[str, dict[str, str]] = {
    "pre": {"attn_in": "input_layernorm", "ffn_in": "post_attention_layernorm"},
    "sandwich": {"attn_in": "input_layernorm", "attn_out": "post_attention_layernorm",
                 "ffn_in": "pre_feedforward_layernorm", "ffn_out": "post_feedforward_layernorm"},
    "post": {"attn_out": "post_attention_layernorm", "ffn_out": "post_feedforward_layernorm"},
    "parallel": {"attn_in": "input_layernorm"},
}


def head_dim(config: Any) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def sliding_window(config: Any, layer_idx: int) -> Optional[int]:
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


def layer_type(config: Any, layer_idx: int) -> Optional[str]:
    layer_types = getattr(config, "layer_types", None)
    return layer_types[layer_idx] if layer_types else None


class DecoderAttention(nn.Module):
    def __init__(self, config: Any, layer_idx: int, family: Any,
                 rotary: Optional[RotaryEmbedding], attn_backend_cls: type, dtype: torch.dtype,
                 kv_cache_dtype: str, quant_method: QuantizationMethod) -> None:
        super().__init__()
        total_heads = config.num_attention_heads
        total_kv_heads = getattr(config, "num_key_value_heads", None) or total_heads
        self.head_dim = d = head_dim(config)
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
                               bias=family.qkv_bias(config), dtype=dtype, quant_method=quant_method,
                               parallel="column", shard_slices=[(rank * self.q_size, self.q_size), kv_slice, kv_slice])
        self.o_proj = Linear(total_heads * d, config.hidden_size, bias=family.o_bias(config), dtype=dtype,
                             quant_method=quant_method, parallel="row")
        self.rotary_emb = rotary
        self.qk_norm = family.qk_norm
        if family.qk_norm == "projection" and tp > 1:
            # OLMo 2 normalizes over all heads at once, which a rank holding some of them cannot.
            raise ValueError(f"{family.__name__}: q/k norms over the whole projection do not split over "
                             "tensor-parallel ranks; use tensor_parallel_size=1")
        sizes = {"head": (d, d), "projection": (total_heads * d, total_kv_heads * d)}.get(family.qk_norm)
        self.q_norm = family.make_norm(config, sizes[0], dtype) if sizes else None
        self.k_norm = family.make_norm(config, sizes[1], dtype) if sizes else None
        self.attn = Attention(self.num_heads, self.head_dim, family.attention_scale(config), self.num_kv_heads,
                              attn_backend_cls, sliding_window=sliding_window(config, layer_idx),
                              kv_cache_dtype=kv_cache_dtype, logits_soft_cap=family.attn_softcap(config))

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, attn_metadata) -> torch.Tensor:
        t = hidden.shape[0]
        qkv = self.qkv_proj(hidden)
        qk = qkv[:, :self.q_size + self.kv_size]
        if self.qk_norm == "projection":
            qk = torch.cat((self.q_norm(qk[:, :self.q_size]), self.k_norm(qk[:, self.q_size:])), dim=1)
        # q and k are adjacent in the fused output: rotate them as one [T, H + Hkv, D] tensor.
        qk = qk.reshape(t, self.num_heads + self.num_kv_heads, self.head_dim)
        if self.qk_norm == "head":
            qk = torch.cat((self.q_norm(qk[:, :self.num_heads]), self.k_norm(qk[:, self.num_heads:])), dim=1)
        if self.rotary_emb is not None:
            qk = self.rotary_emb(positions, qk)
        q = qk[:, :self.num_heads].flatten(1)
        k = qk[:, self.num_heads:].flatten(1)
        v = qkv[:, self.q_size + self.kv_size:]
        return self.o_proj(self.attn(q, k, v, attn_metadata))


class DecoderMLP(nn.Module):
    """Gated (`gate_up_proj` [gate | up] -> act(gate) * up -> `down_proj`) or plain (up -> act ->
    down, under the family's checkpoint names)."""

    def __init__(self, config: Any, family: Any, structure: LayerStructure,
                 dtype: torch.dtype, quant_method: QuantizationMethod, size: Optional[int] = None) -> None:
        """`size`: the intermediate size where it is not config.intermediate_size (a shared expert)."""
        super().__init__()
        bias, size = family.mlp_bias(config), size or config.intermediate_size
        self.gated = structure.ffn == "dense"
        up_name, down_name = ("gate_up_proj", "down_proj") if self.gated else family.plain_mlp_names
        self.up_name, self.down_name = up_name, down_name
        setattr(self, up_name, Linear(config.hidden_size, [size] * 2 if self.gated else size, bias=bias, dtype=dtype,
                                      quant_method=quant_method, parallel="column"))
        setattr(self, down_name, Linear(size, config.hidden_size, bias=bias, dtype=dtype, quant_method=quant_method,
                                        parallel="row"))
        kind = structure.activation
        if self.gated:
            self.act_fn = SiluAndMul() if kind == "silu" else GatedActivation(kind)
        else:
            self.act_fn = XIELU(dtype) if kind == "xielu" else Activation(kind)

    @property
    def up(self) -> Linear:
        return getattr(self, self.up_name)

    @property
    def down(self) -> Linear:
        return getattr(self, self.down_name)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(self.act_fn(self.up(x)))


class DecoderLayer(nn.Module):
    def __init__(self, config: Any, layer_idx: int, family: Any, structure: LayerStructure,
                 rotary: Optional[RotaryEmbedding], attn_backend_cls: type, dtype: torch.dtype, kv_cache_dtype: str,
                 quant_method: QuantizationMethod) -> None:
        super().__init__()
        self.structure = structure
        # A family may bring its own attention block (DeepSeek's MLA: core/layers/mla.py), built alike.
        attention_cls = getattr(family, "attention_cls", None) or DecoderAttention
        self.self_attn = attention_cls(config, layer_idx, family, rotary, attn_backend_cls, dtype, kv_cache_dtype,
                                       quant_method)
        # An expert FFN (structure.ffn "moe") is the family's own (core/models/moe_families.py).
        self.mlp = family.make_moe(config, layer_idx, dtype, quant_method) if structure.ffn == "moe" \
            else DecoderMLP(config, family, structure, dtype, quant_method)
        placement = "parallel" if structure.parallel_block else structure.norm_placement
        self.norm_names = {slot: family.norm_names.get(slot, name) for slot, name in NORM_SLOTS[placement].items()}
        for name in self.norm_names.values():
            setattr(self, name, family.make_norm(config, config.hidden_size, dtype))
        # Llama's layout runs the fused residual-add-and-norm; any other one the general form.
        self.plain_pre_norm = placement == "pre" and structure.residual_scale == 1.0

    def norm(self, slot: str) -> Optional[nn.Module]:
        name = self.norm_names.get(slot)
        return getattr(self, name) if name else None

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, residual: Optional[torch.Tensor],
                attn_metadata) -> tuple[torch.Tensor, torch.Tensor]:
        """(this layer's output delta, the residual stream before it): the next layer or the final
        norm adds them, so a pre-norm model folds each residual add into its next norm."""
        if self.plain_pre_norm:
            attn_in, ffn_in = self.norm("attn_in"), self.norm("ffn_in")
            if residual is None:
                residual, hidden = hidden, attn_in(hidden)
            else:
                hidden, residual = attn_in(hidden, residual)
            hidden = self.self_attn(positions, hidden, attn_metadata)
            hidden, residual = ffn_in(hidden, residual)
            return self.mlp(hidden), residual
        scale = self.structure.residual_scale
        normed, stream = self._add_and_norm("attn_in", hidden, residual)
        attn = self._apply("attn_out", self.self_attn(positions, normed, attn_metadata))
        if self.structure.parallel_block:         # attention and FFN read the same normed input
            return (attn + self.mlp(normed)) * scale if scale != 1.0 else attn + self.mlp(normed), stream
        normed, stream = self._add_and_norm("ffn_in", attn * scale if scale != 1.0 else attn, stream)
        ffn = self._apply("ffn_out", self.mlp(normed))
        return (ffn * scale if scale != 1.0 else ffn), stream

    def _add_and_norm(self, slot: str, x: torch.Tensor, residual: Optional[torch.Tensor]
                      ) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + residual), x + residual), the add folded into the norm's fused form where
        the slot has a norm (the same sums: one op instead of two passes)."""
        norm = self.norm(slot)
        if residual is None:
            return (x if norm is None else norm(x)), x
        if norm is None:
            stream = x + residual
            return stream, stream
        return norm(x, residual)

    def _apply(self, slot: str, x: torch.Tensor) -> torch.Tensor:
        norm = self.norm(slot)
        return x if norm is None else norm(x)


class PPMissingLayer(nn.Identity):
    """A layer another pipeline stage holds: no parameters here (the loader skips its weights)."""


class DecoderModel(nn.Module):
    def __init__(self, config: Any, family: Any, attn_backend_cls: type, dtype: torch.dtype,
                 kv_cache_dtype: str, quant_method: QuantizationMethod) -> None:
        super().__init__()
        # Pipeline parallelism: this stage builds only its layers (the others are PPMissingLayer,
        # holding nothing); the first stage embeds, the last one applies the final norm.
        state = distributed.get_state()
        self.start_layer, self.end_layer = distributed.stage_layers(config.num_hidden_layers, state.pp_rank,
                                                                    state.pp_size)
        self.is_first_stage, self.is_last_stage = state.is_first_stage, state.is_last_stage
        self.embed_tokens = VocabEmbedding(config.vocab_size, config.hidden_size, dtype) \
            if self.is_first_stage else PPMissingLayer()
        self.embedding_scale = family.embedding_scale(config)
        self.structures = [family.layer_structure(config, i) for i in range(config.num_hidden_layers)]
        # One cos/sin table per rope variant, shared by the layers that use it.
        self.rotaries = nn.ModuleDict()
        for structure in self.structures:
            if structure.rotary != "none" and structure.rope_table not in self.rotaries:
                self.rotaries[structure.rope_table] = get_rope(
                    config, head_dim(config), config.max_position_embeddings, dtype,
                    layer_type=None if structure.rope_table == "default" else structure.rope_table,
                    interleaved=structure.rotary == "gptj")
        self.layers = nn.ModuleList(
            DecoderLayer(config, i, family, s, self.rotaries[s.rope_table] if s.rotary != "none" else None,
                         attn_backend_cls, dtype, kv_cache_dtype, quant_method)
            if self.start_layer <= i < self.end_layer else PPMissingLayer()
            for i, s in enumerate(self.structures))
        self.norm = family.make_norm(config, config.hidden_size, dtype) if self.is_last_stage else PPMissingLayer()

    @property
    def rotary_emb(self) -> RotaryEmbedding:
        return next(iter(self.rotaries.values()))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn_metadata,
                intermediate: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The final hidden states; at a pipeline stage that is not the last, [2, T, H] hidden and
        residual for the next stage, which passes them back in as `intermediate`."""
        for rotary in self.rotaries.values():
            rotary.new_forward()
        if intermediate is None:
            hidden, residual = self.embed_tokens(input_ids), None
            if self.embedding_scale != 1.0:       # in the model dtype, as HF scales it
                hidden = hidden * torch.tensor(self.embedding_scale, dtype=hidden.dtype)
        else:
            hidden, residual = intermediate[0], intermediate[1]
        for layer in self.layers[self.start_layer:self.end_layer]:
            hidden, residual = layer(positions, hidden, residual, attn_metadata)
        if not self.is_last_stage:
            return torch.stack((hidden, residual if residual is not None else torch.zeros_like(hidden)))
        hidden, _ = self.norm(hidden, residual if residual is not None else torch.zeros_like(hidden))
        return hidden

