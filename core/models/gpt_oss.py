"""GPT-OSS: the Llama network with attention sinks (a learned logit per head in each softmax's
denominator), q/k/v and o biases, sliding-window layers alternating with full ones (layer_types),
yarn rope, and a mixture-of-experts FFN in every layer: a biased router whose top-k logits are
softmaxed among themselves, biased experts with the clamped SwiGLU (core/layers/moe.py
"swiglu_oai").

transformers stores the experts fused and transposed: mlp.experts.gate_up_proj [E, H, 2 * I] with gate
and up interleaved along the last dim (gate at even columns), gate_up_proj_bias [E, 2 * I] likewise,
down_proj [E, I, H], down_proj_bias [E, H]; OpenAI's MXFP4 checkpoints keep gate_up_proj and down_proj
as `*_blocks` + `*_scales` [E, rows, ...] (quantization/mxfp4.py), dequantized here at load. Both
are laid out on loading as FusedMoE keeps every family's experts (w13 [E, 2 * I, H] gate rows then up
rows, w2 [E, H, I]).
"""
from __future__ import annotations

import dataclasses
import re
from typing import Any, Optional

import torch
from torch import nn

from tokenmill.attention_backends.interface import AttentionConfig
from tokenmill.platforms.interface import LayerStructure
from tokenmill.quantization.interface import QuantizationMethod
from tokenmill.quantization.mxfp4 import dequantize_mxfp4, is_mxfp4

from .. import distributed
from ..layers.moe import FusedMoE
from .moe_families import MOE_FEATURES, MoeForCausalLM

# transformers' expert tensor names: (module prefix, which of ours, suffix).
_EXPERTS = re.compile(r"^(.*)\.experts\.(gate_up_proj|down_proj)(_bias|_blocks|_scales)?$")
_PARAM = {("gate_up_proj", ""): "w13", ("down_proj", ""): "w2", ("gate_up_proj", "_bias"): "w13_bias",
          ("down_proj", "_bias"): "w2_bias", ("gate_up_proj", "_blocks"): "w13", ("down_proj", "_blocks"): "w2",
          ("gate_up_proj", "_scales"): "w13", ("down_proj", "_scales"): "w2"}


def _deinterleave(t: torch.Tensor, dim: int) -> torch.Tensor:
    """Gate at even, up at odd positions along `dim` -> all gates, then all ups."""
    index = torch.arange(t.shape[dim], device=t.device)
    return torch.cat((t.index_select(dim, index[0::2]), t.index_select(dim, index[1::2])), dim=dim)


class GptOssMoE(FusedMoE):
    """FusedMoE taking transformers' GPT-OSS expert tensors (shard id "hf": as stored, converted to
    the stacked layout) and MXFP4 pairs (shard ids "blocks" / "scales": joined once both arrived)."""

    def __init__(self, *args: Any, mxfp4: bool = False, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._pending: dict[tuple[str, str], torch.Tensor] = {}
        for name in ("w13", "w2", "w13_bias", "w2_bias"):
            stored_as = ("blocks", "scales") if mxfp4 and name in ("w13", "w2") else ("hf",)
            getattr(self, name).checkpoint_shards = list(stored_as)    # what a complete checkpoint fills

    def weight_loader(self, param: nn.Parameter, loaded: Any, shard_id: Optional[Any] = None) -> None:
        if shard_id not in ("hf", "blocks", "scales"):
            return super().weight_loader(param, loaded, shard_id)
        if hasattr(loaded, "materialize"):
            loaded = loaded.materialize()
        name = next(n for n in ("w13", "w2", "w13_bias", "w2_bias") if getattr(self, n) is param)
        if shard_id != "hf":
            self._pending[(name, shard_id)] = loaded
            if (name, "blocks") not in self._pending or (name, "scales") not in self._pending:
                return
            # [E, rows, K]: rows are output features, as FusedMoE keeps them (gate/up still interleaved)
            loaded = dequantize_mxfp4(self._pending.pop((name, "blocks")), self._pending.pop((name, "scales")),
                                      param.dtype)
            if name == "w13":
                loaded = _deinterleave(loaded, 1)
        elif name in ("w13", "w2"):
            loaded = loaded.transpose(1, 2)                                        # [E, K, N] -> [E, N, K]
            loaded = _deinterleave(loaded, 1) if name == "w13" else loaded
        elif name == "w13_bias":
            loaded = _deinterleave(loaded, 1)
        super().weight_loader(param, loaded.contiguous(), None)


class GptOssForCausalLM(MoeForCausalLM):
    """OpenAI's GPT-OSS (gpt-oss-20b / 120b)."""
    weights_in_hidden_dtype = True         # transformers softmaxes the top-k logits in their own dtype
    features = {**MOE_FEATURES,
                "sliding_window": (True, "alternating sliding / full layers (layer_types), hybrid KV groups"),
                "fast_path": (False, "decode steps run every layer eagerly (attention sinks and the expert FFN "
                                     "are outside the cpu native step)"),
                "quantization": (True, "MXFP4 checkpoints load (experts dequantized to the model dtype); int4 / "
                                       "int8 quantize the experts too, run by the cpu native MoE op (biases and "
                                       "the clamped SwiGLU included)")}

    @classmethod
    def layer_structure(cls, config: Any, layer_idx: int) -> LayerStructure:
        return dataclasses.replace(super().layer_structure(config, layer_idx), attention_sinks=True)

    @classmethod
    def attention_config(cls, hf_config: Any, dtype: torch.dtype, kv_cache_dtype: str = "auto",
                         block_size: int = 16, graph_capture: str = "none", device: str = "cpu") -> AttentionConfig:
        return dataclasses.replace(super().attention_config(hf_config, dtype, kv_cache_dtype, block_size,
                                                            graph_capture, device), attention_sinks=True)

    @classmethod
    def make_moe(cls, config: Any, layer_idx: int, dtype: torch.dtype, quant_method: QuantizationMethod) -> FusedMoE:
        return GptOssMoE(config.hidden_size, config.intermediate_size, cls.num_experts(config),
                         int(config.num_experts_per_tok), dtype, quant_method, activation="swiglu_oai",
                         scoring="topk_softmax", weights_in_hidden_dtype=cls.weights_in_hidden_dtype,
                         router_bias=True, expert_bias=True, swiglu_alpha=float(config.swiglu_alpha),
                         swiglu_limit=float(config.swiglu_limit),
                         mxfp4=is_mxfp4(getattr(config, "quantization_config", None) or {}))

    def __init__(self, hf_config: Any, *args: Any, **kwargs: Any) -> None:
        super().__init__(hf_config, *args, **kwargs)
        # Each attention block's sinks (checkpoint self_attn.sinks [heads]), this rank's heads, in
        # float32 as the softmax reads them; the backend reads the parameter itself.
        rank = distributed.tp_rank()
        for layer in self.model.layers[self.model.start_layer:self.model.end_layer]:
            attn = layer.self_attn
            sinks = nn.Parameter(torch.empty(attn.num_heads, dtype=torch.float32), requires_grad=False)
            sinks.weight_loader = _heads_loader(rank * attn.num_heads, attn.num_heads)
            attn.sinks = sinks
            attn.attn.impl.sinks = sinks

    def checkpoint_name(self, name: str) -> Optional[str]:
        return super().checkpoint_name(name.replace(".mlp.router.", ".mlp.gate.", 1))

    def stacked_target(self, name: str) -> Optional[tuple[str, Any]]:
        return expert_target(name)


def expert_target(name: str) -> Optional[tuple[str, str]]:
    """(GptOssMoE parameter, shard id) of a checkpoint's expert tensor, None for any other tensor:
    `...mlp.experts.gate_up_proj_blocks` -> (`...mlp.w13`, "blocks")."""
    found = _EXPERTS.match(name)
    if found is None:
        return None
    suffix = found.group(3) or ""
    shard = {"_blocks": "blocks", "_scales": "scales"}.get(suffix, "hf")
    return f"{found.group(1)}.{_PARAM[(found.group(2), suffix)]}", shard


def _heads_loader(first: int, count: int) -> Any:
    def load(param: nn.Parameter, loaded: Any, shard_id: Optional[Any] = None) -> None:
        if shard_id is not None:
            raise ValueError(f"shard {shard_id} given for attention sinks")
        if loaded.dim() != 1 or loaded.shape[0] < first + count:
            raise ValueError(f"attention sinks {tuple(loaded.shape)}: expected [{first + count}] or more heads")
        param.data.copy_(loaded.narrow(0, first, count))
    return load
