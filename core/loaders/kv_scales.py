"""Per-tensor fp8 KV-cache scales a checkpoint carries (vLLM's k_scale / v_scale).

llm-compressor / compressed-tensors and vLLM name them `model.layers.N.self_attn.k_scale` and
`.v_scale` (vLLM's own modules: `self_attn.attn.k_scale`); older llm-compressor and AutoFP8
files `self_attn.k_proj.output_scale` / `v_proj.output_scale`, or one `self_attn.kv_scale` for
both. They are not weights of our network: taken out of the checkpoint stream and, when the
KV cache is fp8, set on each layer's attention backend (which stores x / scale, reads x * scale).
A scale given per head or per channel is reduced to its maximum (the per-tensor scale that
saturates none of them).
"""
from __future__ import annotations

import logging
import re
from typing import Any, Iterable, Iterator

from torch import nn

from ..layers.attention import Attention

logger = logging.getLogger("tokenmill.loaders")

_NAMES = re.compile(r"layers\.(\d+)\.self_attn\.(?:attn\.)?(?:(k|v|kv)_scale|(k|v)_proj\.output_scale)$")
FP8_KV_DTYPES = ("fp8", "fp8_e4m3", "fp8_e5m2")


class KVScales:
    def __init__(self) -> None:
        self.scales: dict[int, dict[str, float]] = {}      # layer index -> {"k": s, "v": s}

    def filter(self, weights: Iterable[tuple[str, Any]]) -> Iterator[tuple[str, Any]]:
        """The checkpoint stream less the KV scales, which are kept here."""
        for name, tensor in weights:
            m = _NAMES.search(name)
            if m is None:
                yield name, tensor
                continue
            which = m.group(2) or m.group(3)
            value = float(tensor.float().max())
            if not value > 0:
                raise ValueError(f"checkpoint tensor {name!r}: a KV-cache scale must be positive, got {value}")
            for kind in ("k", "v") if which == "kv" else (which,):
                self.scales.setdefault(int(m.group(1)), {})[kind] = value

    def apply(self, model: nn.Module, kv_cache_dtype: str) -> int:
        """Set the scales on the attention layers when the cache is fp8; returns how many layers took one."""
        if not self.scales:
            return 0
        if kv_cache_dtype not in FP8_KV_DTYPES:
            logger.info("checkpoint carries fp8 KV-cache scales; unused with kv_cache_dtype %r", kv_cache_dtype)
            return 0
        count = 0
        for name, module in model.named_modules():
            m = re.search(r"layers\.(\d+)\.", name)
            if isinstance(module, Attention) and m and int(m.group(1)) in self.scales:
                layer = self.scales[int(m.group(1))]
                module.impl.k_scale = layer.get("k", module.impl.k_scale)
                module.impl.v_scale = layer.get("v", module.impl.v_scale)
                count += 1
        logger.info("fp8 KV cache: per-tensor k/v scales from the checkpoint for %d layers", count)
        return count
