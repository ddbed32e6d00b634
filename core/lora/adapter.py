"""Reading a PEFT LoRA adapter (adapter_config.json + adapter_model.safetensors) onto our layers.

PEFT names a weight after the transformers module it adapts, e.g.
`base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight`; our q/k/v and gate/up are fused
(`qkv_proj`, `gate_up_proj`, the model's `packed_modules_mapping`), so each PEFT module lands in one
output shard of one of our layers. The scale (alpha / r, or alpha / sqrt(r) with rsLoRA) is folded
into B here, once, so the batched op is a plain x A^T B^T.
"""
from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from .request import LoRARequest

PEFT_PREFIX = "base_model.model."
_WEIGHT_NAME = re.compile(r"^(?P<module>.+)\.lora_(?P<kind>A|B)(?:\.[A-Za-z0-9_]+)?\.weight$")


class LoRAAdapterError(ValueError):
    """An adapter that cannot be served; `param` names what is wrong (the server's 400)."""

    def __init__(self, message: str, param: str = "lora_path") -> None:
        super().__init__(message)
        self.param = param


@dataclass
class LoRAAdapter:
    """One adapter in host memory: per (our layer name) the A and scaled B of each output shard
    it adapts (None for a shard it leaves alone)."""
    request: LoRARequest
    rank: int
    scale: float
    # our module name -> per output shard: (A [r, in], B*scale [out_shard, r]) or None
    layers: dict[str, list[Optional[tuple[torch.Tensor, torch.Tensor]]]] = field(default_factory=dict)

    @property
    def num_bytes(self) -> int:
        return sum(a.numel() * a.element_size() + b.numel() * b.element_size()
                   for shards in self.layers.values() for pair in shards if pair is not None for a, b in [pair])


@dataclass(frozen=True)
class LoRATarget:
    """Where a PEFT module name lands here: our layer (by its suffix) and its output shard."""
    layer_suffix: str
    shard: int
    num_shards: int


def lora_targets(packed_modules_mapping: dict[str, list[tuple[str, int]]],
                 plain_modules: tuple[str, ...] = ("o_proj", "down_proj")) -> dict[str, LoRATarget]:
    """PEFT module leaf name -> our layer and shard, from the model's packed-modules mapping."""
    targets = {name: LoRATarget(name, 0, 1) for name in plain_modules}
    for fused, parts in packed_modules_mapping.items():
        for hf_name, shard in parts:
            targets[hf_name] = LoRATarget(fused, shard, len(parts))
    return targets


def _read_config(path: str) -> dict[str, Any]:
    config_path = os.path.join(path, "adapter_config.json")
    if not os.path.isfile(config_path):
        raise LoRAAdapterError(f"no adapter_config.json in LoRA adapter directory {path!r}")
    try:
        with open(config_path) as f:
            config = json.load(f)
    except ValueError as e:
        raise LoRAAdapterError(f"adapter_config.json of {path!r} is not valid JSON: {e}") from None
    if not isinstance(config, dict):
        raise LoRAAdapterError(f"adapter_config.json of {path!r} must be an object")
    return config


def _read_tensors(path: str) -> dict[str, torch.Tensor]:
    st = os.path.join(path, "adapter_model.safetensors")
    if os.path.isfile(st):
        from safetensors.torch import load_file
        return load_file(st, device="cpu")
    binary = os.path.join(path, "adapter_model.bin")
    if os.path.isfile(binary):
        return torch.load(binary, map_location="cpu", weights_only=True)
    raise LoRAAdapterError(f"no adapter_model.safetensors (or adapter_model.bin) in {path!r}")


def _check_config(config: dict[str, Any], path: str, max_rank: int,
                  targets: dict[str, LoRATarget]) -> tuple[int, float]:
    peft_type = str(config.get("peft_type", "LORA")).upper()
    if peft_type != "LORA":
        raise LoRAAdapterError(f"adapter {path!r} is a {peft_type} adapter; only LoRA adapters are supported")
    if config.get("modules_to_save"):
        raise LoRAAdapterError(
            f"adapter {path!r} has modules_to_save={config['modules_to_save']}: fully trained modules are not "
            f"supported, only LoRA's low-rank deltas", "modules_to_save")
    if config.get("use_dora"):
        raise LoRAAdapterError(f"adapter {path!r} uses DoRA (use_dora), which is not supported", "use_dora")
    if config.get("bias", "none") not in (None, "none"):
        raise LoRAAdapterError(f"adapter {path!r} trains biases (bias={config['bias']!r}), which is not supported",
                               "bias")
    for key in ("rank_pattern", "alpha_pattern"):
        if config.get(key):
            raise LoRAAdapterError(f"adapter {path!r} sets {key}; per-module ranks and alphas are not supported", key)
    rank = config.get("r")
    if not isinstance(rank, int) or rank < 1:
        raise LoRAAdapterError(f"adapter {path!r} has no valid rank r: {rank!r}", "r")
    if rank > max_rank:
        raise LoRAAdapterError(f"adapter {path!r} has rank {rank}, above max_lora_rank={max_rank}", "max_lora_rank")
    if config.get("target_parameters"):      # peft's LoRA on fused parameters: transformers' stacked experts
        raise LoRAAdapterError(f"adapter {path!r} sets target_parameters {config['target_parameters']}: LoRA on "
                               f"mixture-of-experts experts is not supported", "target_parameters")
    modules = config.get("target_modules") or []
    if isinstance(modules, str):    # a regex over full module names: checked against the tensors instead
        modules = []
    unknown = sorted(m for m in modules if m.rsplit(".", 1)[-1] not in targets)
    if unknown:
        raise LoRAAdapterError(f"adapter {path!r} targets modules {unknown} that this model does not have as LoRA "
                               f"targets; supported: {sorted(targets)}", "target_modules")
    alpha = float(config.get("lora_alpha", rank))
    scale = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    return rank, scale


def load_adapter(request: LoRARequest, targets: dict[str, LoRATarget], max_rank: int,
                 layer_names: set[str]) -> LoRAAdapter:
    """Read and validate `request`'s PEFT directory against this model (`layer_names`: our adaptable
    layers' full names). LoRAAdapterError (a ValueError naming the parameter) for what cannot run."""
    path = request.lora_path
    if not path or not os.path.isdir(path):
        raise LoRAAdapterError(f"LoRA adapter directory {path!r} does not exist")
    config = _read_config(path)
    rank, scale = _check_config(config, path, max_rank, targets)
    tensors = _read_tensors(path)
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in tensors.items():
        if "lora_embedding" in name or "lora_magnitude" in name:
            raise LoRAAdapterError(f"adapter {path!r} has {name}: embedding/DoRA adapters are not supported",
                                   "target_modules")
        m = _WEIGHT_NAME.match(name)
        if m is None:
            raise LoRAAdapterError(f"adapter {path!r} has tensor {name!r} that is not a LoRA A/B weight "
                                   f"(fully trained modules are not supported)", "modules_to_save")
        module = m.group("module")
        if module.startswith(PEFT_PREFIX):
            module = module[len(PEFT_PREFIX):]
        pairs.setdefault(module, {})[m.group("kind")] = tensor
    adapter = LoRAAdapter(request, rank, scale)
    for module, ab in pairs.items():
        parent, _, leaf = module.rpartition(".")
        target = targets.get(leaf)
        layer = f"{parent}.{target.layer_suffix}" if target is not None else None
        if target is None or layer not in layer_names:
            if ".experts." in f".{module}.":
                raise LoRAAdapterError(f"adapter {path!r} adapts expert weights ({module!r}): LoRA on "
                                       f"mixture-of-experts experts is not supported (attention and dense "
                                       f"layers are)", "target_modules")
            raise LoRAAdapterError(f"adapter {path!r} adapts module {module!r}, which this model does not have "
                                   f"as a LoRA target", "target_modules")
        if set(ab) != {"A", "B"}:
            raise LoRAAdapterError(f"adapter {path!r}: module {module!r} lacks lora_{'A' if 'A' not in ab else 'B'}")
        a, b = ab["A"].float(), ab["B"].float()
        if a.dim() != 2 or b.dim() != 2 or a.shape[0] != b.shape[1] or a.shape[0] > max_rank:
            raise LoRAAdapterError(f"adapter {path!r}: module {module!r} has A {tuple(a.shape)} and B "
                                   f"{tuple(b.shape)}, not a rank-r pair of at most max_lora_rank={max_rank}",
                                   "max_lora_rank")
        shards = adapter.layers.setdefault(layer, [None] * target.num_shards)
        shards[target.shard] = (a.contiguous(), (b * scale).contiguous())
    if not adapter.layers:
        raise LoRAAdapterError(f"adapter {path!r} has no LoRA weights")
    return adapter
