"""Mamba-2 families: Mamba-2 alone (`mamba2`), Bamba (`bamba`), Granite 4 (`granitemoehybrid`) and
Nemotron-H (`nemotron_h`).

Bamba and Granite 4 are the shared decoder network (core/models/decoder.py) whose token mixer is a
Mamba-2 layer (core/layers/mamba2.py, its per-sequence state in the state cache: core/state_cache.py)
on the config's mamba layers and attention on the others, as Qwen3-Next mixes in Gated DeltaNet
(core/models/qwen3_next.py). Mamba-2 and Nemotron-H are a plainer network, `BlockStack`: per layer one
RMSNorm and one mixer (Mamba-2, attention without position encoding, a squared-ReLU MLP) added to the
residual stream, under `backbone.*`.

What the recurrent layers refuse is Qwen3-Next's (`check_engine_config`): one rank, no speculative
decoding; prefix caching runs through the state checkpoints at block boundaries (core/state_cache.py).
A model without any attention layer (Mamba-2) keeps one placeholder attention layer that nothing
calls: the model runner sizes its step metadata and the block manager its blocks from the attention
layers, so the placeholder keeps those paths unchanged at the cost of a one-head KV block per block
of tokens.
"""
from __future__ import annotations

import dataclasses
from typing import Any, ClassVar, Optional

import torch
from torch import nn

from tokenmill.attention_backends.interface import AttentionConfig
from tokenmill.platforms.interface import LayerStructure
from tokenmill.quantization.interface import QuantizationMethod
from tokenmill.quantization.unquantized import UnquantizedLinearMethod

from .. import distributed
from ..layers.attention import Attention
from ..layers.embedding import LMHead, VocabEmbedding
from ..layers.mamba2 import Mamba2Geometry, Mamba2Mixer
from ..layers.norm import RMSNorm
from .decoder import DecoderAttention, DecoderMLP, layer_type
from .llama import LlamaForCausalLM
from .moe_variants import GraniteMoeForCausalLM, _shared_mlp
from .qwen3_next import HYBRID_FEATURES, Qwen3NextForCausalLM

MAMBA_FEATURES: dict[str, tuple[bool, str]] = {
    **HYBRID_FEATURES,
    "tp": (False, "Mamba-2 layers are not split over ranks yet: tensor_parallel_size=1"),
    "lora": (False, "not supported on models with Mamba-2 layers"),
    "quantization": (True, "the linear layers (in_proj, out_proj, attention, MLP) through the registered methods; "
                           "the conv, A, D and dt bias stay in the model dtype"),
    "fast_path": (False, "Mamba-2 layers: decode steps run eagerly (no native step carries their state)"),
}
MAMBA_TYPES = ("mamba", "linear_attention", "M")
PLACEHOLDER_HEAD = 64      # the placeholder attention layer's geometry: one head of a size every backend takes


def _geometry(config: Any, prefix: str, heads: str, head_dim: str, groups: str, state: str) -> Mamba2Geometry:
    """Bamba and Granite 4 name the fields mamba_*; Mamba-2 and Nemotron-H their own way."""
    get = lambda name, default=None: getattr(config, name, default)        # noqa: E731
    limit = get("time_step_limit") or (0.0, float("inf"))
    return Mamba2Geometry(
        hidden=int(config.hidden_size), heads=int(get(heads)), head_dim=int(get(head_dim)), groups=int(get(groups)),
        state=int(get(state)), kernel=int(get(f"{prefix}d_conv") or get("conv_kernel")),
        chunk=int(get(f"{prefix}chunk_size") or get("chunk_size")),
        eps=float(get("rms_norm_eps") or get("layer_norm_epsilon")),
        proj_bias=bool(get(f"{prefix}proj_bias", get("use_bias", False))),
        conv_bias=bool(get(f"{prefix}conv_bias", get("use_conv_bias", True))),
        dt_limit=(float(limit[0]), float(limit[1])))


def _check_mamba_act(config: Any, name: str) -> None:
    act = getattr(config, name, "silu")
    if act not in ("silu", "swish"):
        raise ValueError(f"Mamba-2 layers with activation {act!r} are not supported (silu only)")


class MambaHybridMixin:
    """What the decoder-network families with Mamba-2 layers share: the mixer on mamba layers, the
    layer structure saying so, the recurrent layers listed for the state cache, the refusals."""
    features = MAMBA_FEATURES
    check_engine_config = classmethod(Qwen3NextForCausalLM.check_engine_config.__func__)
    caches_prefix_state: ClassVar[bool] = True      # prefix caching through state checkpoints (core/state_cache.py)
    mamba_fields: ClassVar[tuple[str, ...]] = ("mamba_", "mamba_n_heads", "mamba_d_head", "mamba_n_groups",
                                               "mamba_d_state")

    @classmethod
    def is_mamba_layer(cls, config: Any, layer_idx: int) -> bool:
        return layer_type(config, layer_idx) in MAMBA_TYPES

    @classmethod
    def attention_cls(cls, config: Any, layer_idx: int, family: Any, rotary: Any, attn_backend_cls: type,
                      dtype: torch.dtype, kv_cache_dtype: str, quant_method: QuantizationMethod) -> nn.Module:
        if cls.is_mamba_layer(config, layer_idx):
            _check_mamba_act(config, "hidden_act")
            return Mamba2Mixer(_geometry(config, *cls.mamba_fields), dtype, quant_method)
        return DecoderAttention(config, layer_idx, family, rotary, attn_backend_cls, dtype, kv_cache_dtype,
                                quant_method)

    @classmethod
    def layer_structure(cls, config: Any, layer_idx: int) -> LayerStructure:
        structure = super().layer_structure(config, layer_idx)
        if cls.is_mamba_layer(config, layer_idx):       # no rotary, no KV: a recurrent state instead
            return dataclasses.replace(structure, attention="mamba2", rotary="none", rotary_dim=None)
        return structure

    def __init__(self, hf_config: Any, *args: Any, **kwargs: Any) -> None:
        if distributed.tp_size() > 1 or distributed.get_state().pp_size > 1:
            raise ValueError(f"{type(self).__name__}: recurrent layers run on one rank only")
        super().__init__(hf_config, *args, **kwargs)
        mixers = list(self.model.layers.modules())       # in layer order (Falcon-H1: both in one layer)
        self.attention_layers: list[Attention] = [m.attn for m in mixers if isinstance(m, DecoderAttention)]
        # The layers with a per-sequence state: the model runner gives them their slots.
        self.recurrent_layers: list[Mamba2Mixer] = [m for m in mixers if isinstance(m, Mamba2Mixer)]
        if not self.attention_layers:
            raise ValueError(f"{type(self).__name__}: a configuration without attention layers is not supported")

    def checkpoint_name(self, name: str) -> Optional[str]:
        return super().checkpoint_name(name.replace(".mamba.", ".self_attn.", 1))

    def decoder_stack(self) -> Any:
        raise NotImplementedError(f"{type(self).__name__}: Mamba-2 layers are outside the decode programs' "
                                  "layer vocabulary")


class BambaForCausalLM(MambaHybridMixin, LlamaForCausalLM):
    """Bamba: Llama's layers (partial rotary attention, SwiGLU `feed_forward`, `pre_ff_layernorm`) with
    Mamba-2 in place of attention outside attn_layer_indices."""
    norm_names = {"ffn_in": "pre_ff_layernorm"}

    def checkpoint_name(self, name: str) -> Optional[str]:
        name = name.replace(".feed_forward.", ".mlp.", 1).replace("model.final_layernorm.", "model.norm.", 1)
        return super().checkpoint_name(name)


class GraniteMoeHybridForCausalLM(MambaHybridMixin, GraniteMoeForCausalLM):
    """Granite 4 (`granitemoehybrid`): Granite 3 MoE's layers (multipliers, top-k-then-softmax router,
    fused experts, ungated-sum shared MLP) with Mamba-2 on the mamba layers; attention with rope or
    none (position_embedding_type); with num_local_experts 0 the shared MLP alone."""
    renames = {**GraniteMoeForCausalLM.renames,
               ".block_sparse_moe.router.weight": ".mlp.gate.weight",
               ".block_sparse_moe.experts.gate_up_proj": ".mlp.experts.gate_up_proj",
               ".block_sparse_moe.experts.down_proj": ".mlp.experts.down_proj"}

    @classmethod
    def uses_rope(cls, config: Any, layer_idx: int) -> bool:
        return getattr(config, "position_embedding_type", None) == "rope"

    @classmethod
    def is_moe_layer(cls, config: Any, layer_idx: int) -> bool:
        return True          # dense configs too: make_moe gives the shared MLP alone

    @classmethod
    def make_moe(cls, config: Any, layer_idx: int, dtype: torch.dtype, quant_method: QuantizationMethod) -> nn.Module:
        if int(getattr(config, "num_local_experts", 0) or 0) > 0:
            return super().make_moe(config, layer_idx, dtype, quant_method)
        return _shared_mlp(cls, config, int(config.shared_intermediate_size), dtype, quant_method)

    def checkpoint_name(self, name: str) -> Optional[str]:
        if int(getattr(self.config, "num_local_experts", 0) or 0) == 0:
            name = name.replace(".shared_mlp.input_linear.", ".mlp.gate_up_proj.", 1)
            name = name.replace(".shared_mlp.output_linear.", ".mlp.down_proj.", 1)
        return super().checkpoint_name(name)


class MixerBlock(nn.Module):
    """One layer of a `BlockStack`: an RMSNorm and one mixer, added to the residual stream."""

    def __init__(self, norm: nn.Module, mixer: nn.Module) -> None:
        super().__init__()
        self.norm, self.mixer = norm, mixer

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, attn_metadata: Any) -> torch.Tensor:
        if isinstance(self.mixer, DecoderMLP):
            return self.mixer(self.norm(hidden))
        return self.mixer(positions, self.norm(hidden), attn_metadata)


class BlockStack(nn.Module):
    """embeddings -> per layer stream += mixer(norm(stream)) -> norm_f (Mamba2Model, NemotronHModel).
    With residual_in_fp32 the stream is kept in float32, each block reading it in the model dtype."""

    def __init__(self, config: Any, blocks: list[MixerBlock], dtype: torch.dtype) -> None:
        super().__init__()
        self.embeddings = VocabEmbedding(config.vocab_size, config.hidden_size, dtype)
        self.layers = nn.ModuleList(blocks)
        self.norm_f = RMSNorm(config.hidden_size, float(config.layer_norm_epsilon), dtype)
        self.fp32_stream = bool(getattr(config, "residual_in_fp32", False))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn_metadata: Any) -> torch.Tensor:
        hidden = self.embeddings(input_ids)
        dtype = hidden.dtype
        stream = hidden.float() if self.fp32_stream else hidden
        for layer in self.layers:
            stream = stream + layer(positions, stream.to(dtype), attn_metadata)
        return self.norm_f(stream.to(dtype))


class Mamba2ForCausalLM(LlamaForCausalLM):
    """Mamba-2 alone: every layer a Mamba-2 mixer (`backbone.layers.N.mixer`)."""
    features = {**MAMBA_FEATURES, "sliding_window": (False, "no attention layers")}
    check_engine_config = classmethod(Qwen3NextForCausalLM.check_engine_config.__func__)
    caches_prefix_state: ClassVar[bool] = True
    # Only attention's q/k/v are fused here (Nemotron-H's MLP is a plain up_proj / down_proj).
    packed_modules_mapping: ClassVar[dict[str, list[tuple[str, int]]]] = {
        "qkv_proj": [("q_proj", 0), ("k_proj", 1), ("v_proj", 2)]}
    norm_names: ClassVar[dict[str, str]] = {}

    @classmethod
    def geometry(cls, config: Any) -> Mamba2Geometry:
        _check_mamba_act(config, "hidden_act")
        return _geometry(config, "", "num_heads", "head_dim", "n_groups", "state_size")

    @classmethod
    def make_mixer(cls, config: Any, kind: str, attn_backend_cls: type, dtype: torch.dtype, kv_cache_dtype: str,
                   quant_method: QuantizationMethod) -> nn.Module:
        if kind in MAMBA_TYPES:
            return Mamba2Mixer(cls.geometry(config), dtype, quant_method)
        raise ValueError(f"{cls.__name__}: layer kind {kind!r} is not supported")

    @classmethod
    def block_kinds(cls, config: Any) -> list[str]:
        return ["mamba"] * config.num_hidden_layers

    @classmethod
    def attention_config(cls, hf_config: Any, dtype: torch.dtype, kv_cache_dtype: str = "auto",
                         block_size: int = 16, graph_capture: str = "none", device: str = "cpu") -> AttentionConfig:
        if any(kind == "attention" for kind in cls.block_kinds(hf_config)):
            return super().attention_config(hf_config, dtype, kv_cache_dtype, block_size, graph_capture, device)
        return AttentionConfig(head_size=PLACEHOLDER_HEAD, num_heads=1, num_kv_heads=1, dtype=dtype,
                               kv_cache_dtype=kv_cache_dtype, block_size=block_size, graph_capture=graph_capture,
                               device=device)

    def __init__(self, hf_config: Any, attn_backend_cls: type, dtype: torch.dtype, kv_cache_dtype: str = "auto",
                 quant_method: Optional[QuantizationMethod] = None) -> None:
        nn.Module.__init__(self)
        if distributed.tp_size() > 1 or distributed.get_state().pp_size > 1:
            raise ValueError(f"{type(self).__name__}: recurrent layers run on one rank only")
        self.config, self.dtype = hf_config, dtype
        quant_method = quant_method or UnquantizedLinearMethod()
        blocks = [MixerBlock(RMSNorm(hf_config.hidden_size, float(hf_config.layer_norm_epsilon), dtype),
                             self.make_mixer(hf_config, kind, attn_backend_cls, dtype, kv_cache_dtype, quant_method))
                  for kind in self.block_kinds(hf_config)]
        self.backbone = BlockStack(hf_config, blocks, dtype)
        self.tie_word_embeddings = bool(getattr(hf_config, "tie_word_embeddings", False))
        self.lm_head = LMHead(hf_config.vocab_size, hf_config.hidden_size, dtype,
                              tied_to=self.backbone.embeddings if self.tie_word_embeddings else None,
                              quant_method=quant_method.lm_head_method())
        self.final_softcap, self.output_scale = None, 1.0
        mixers = [block.mixer for block in blocks]
        self.attention_layers: list[Attention] = [m.attn for m in mixers if isinstance(m, DecoderAttention)]
        self.recurrent_layers: list[Mamba2Mixer] = [m for m in mixers if isinstance(m, Mamba2Mixer)]
        if not self.attention_layers:       # see the module docstring: a layer nothing calls
            self.kv_placeholder = Attention(1, PLACEHOLDER_HEAD, 1.0, 1, attn_backend_cls,
                                            kv_cache_dtype=kv_cache_dtype)
            self.attention_layers = [self.kv_placeholder]

    def forward(self, input_ids: torch.LongTensor, positions: torch.LongTensor, attn_metadata,
                intermediate: Optional[torch.Tensor] = None) -> torch.Tensor:
        return self.backbone(input_ids, positions, attn_metadata)

    def checkpoint_name(self, name: str) -> Optional[str]:
        if name.startswith("model."):         # transformers 5 may store backbone.* as model.*
            name = "backbone." + name[len("model."):]
        return name

    def decoder_stack(self) -> Any:
        raise NotImplementedError(f"{type(self).__name__}: Mamba-2 layers are outside the decode programs' "
                                  "layer vocabulary")


class NemotronHForCausalLM(Mamba2ForCausalLM):
    """Nemotron-H: a `BlockStack` of Mamba-2 (M), attention without position encoding (*) and
    squared-ReLU MLP (-) layers as hybrid_override_pattern / layers_block_type lays them out.
    Mixture-of-experts layers (E: Nemotron-H MoE / Nemotron 3) are not supported yet."""
    features = {**MAMBA_FEATURES, "sliding_window": (False, "no sliding windows in this family")}

    @classmethod
    def block_kinds(cls, config: Any) -> list[str]:
        names = {"linear_attention": "mamba", "mamba": "mamba", "M": "mamba", "full_attention": "attention",
                 "attention": "attention", "*": "attention", "mlp": "mlp", "-": "mlp", "moe": "moe", "E": "moe"}
        kinds = getattr(config, "layers_block_type", None) or list(config.hybrid_override_pattern)
        return [names.get(k, k) for k in kinds]

    @classmethod
    def activation(cls, config: Any) -> str:
        from ..layers.activation import activation_kind
        return activation_kind(config.mlp_hidden_act)

    @classmethod
    def uses_rope(cls, config: Any, layer_idx: int) -> bool:
        return False

    @classmethod
    def geometry(cls, config: Any) -> Mamba2Geometry:
        _check_mamba_act(config, "mamba_hidden_act")
        return _geometry(config, "mamba_", "mamba_num_heads", "mamba_head_dim", "n_groups", "ssm_state_size")

    @classmethod
    def make_mixer(cls, config: Any, kind: str, attn_backend_cls: type, dtype: torch.dtype, kv_cache_dtype: str,
                   quant_method: QuantizationMethod) -> nn.Module:
        if kind == "attention":
            if getattr(config, "sliding_window", None):
                raise ValueError(f"{cls.__name__}: sliding_window is not supported")
            return DecoderAttention(config, 0, cls, None, attn_backend_cls, dtype, kv_cache_dtype, quant_method)
        if kind == "mlp":
            return DecoderMLP(config, cls, LayerStructure(activation=cls.activation(config), ffn="plain"), dtype,
                              quant_method)
        if kind == "moe":
            raise ValueError(f"{cls.__name__}: mixture-of-experts layers (E in hybrid_override_pattern) are not "
                             "supported yet")
        return super().make_mixer(config, kind, attn_backend_cls, dtype, kv_cache_dtype, quant_method)

