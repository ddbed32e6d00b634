"""The one weight loader for every architecture and checkpoint kind (nano-vllm's utils/loader.py).

A checkpoint is an iterable of (HF name, stored tensor). Each name goes to a parameter, through
the model's `packed_modules_mapping` when our module fuses several HF tensors (q/k/v, gate/up),
and that parameter's own `weight_loader(param, tensor, shard_id)` copies it in: the parameter
knows its layout (a fused shard, a quantized packing), so neither the model nor this loader has
to. A checkpoint-format method (quantization/gguf.py) turns stored tensors into dense ones first.
"""
from __future__ import annotations

from typing import Any, Iterable, Mapping, Optional, Sequence

import torch
from torch import nn

from tokenmill.quantization.interface import QuantizationMethod

from ..layers.params import default_weight_loader

PackedMapping = Mapping[str, Sequence[tuple[str, Any]]]


def _target(name: str, packed: PackedMapping) -> tuple[str, Optional[Any]]:
    """(our parameter name, shard id) for an HF tensor name."""
    for fused, parts in packed.items():
        for hf_module, shard_id in parts:
            if f".{hf_module}." in name:
                return name.replace(f".{hf_module}.", f".{fused}.", 1), shard_id
    return name, None


def _expected(params: Mapping[str, nn.Parameter], packed: PackedMapping) -> list[tuple[str, Optional[Any]]]:
    """Every (parameter, shard id) a complete checkpoint fills (a parameter stacking several
    checkpoint tensors, a mixture-of-experts layer's, lists its own `checkpoint_shards`)."""
    out = []
    for name, param in params.items():
        module = name.rpartition(".")[0].rpartition(".")[2]
        shards = [shard_id for _, shard_id in packed[module]] if module in packed else [None]
        shards = getattr(param, "checkpoint_shards", None) or shards
        out += [(name, shard_id) for shard_id in shards]
    return out


@torch.no_grad()
def load_weights(model: nn.Module, weights: Iterable[tuple[str, Any]],
                 checkpoint_format: Optional[QuantizationMethod] = None) -> None:
    """Load every checkpoint tensor into `model`; ValueError naming the tensor when one has no
    place or the wrong shape, and naming the parameters a checkpoint leaves unfilled."""
    packed: PackedMapping = getattr(model, "packed_modules_mapping", {})
    ignored: Sequence[str] = getattr(model, "ignored_weights", ())
    params = dict(model.named_parameters())
    # A tied parameter is listed once, under its first name; checkpoints may store the other
    # copy too (lm_head.weight of a tied embedding), which adds nothing.
    aliases = {name for name, _ in model.named_parameters(remove_duplicate=False)} - set(params)
    modules = dict(model.named_modules())
    loaded: set[tuple[str, Optional[Any]]] = set()
    # A model may name checkpoint tensors its own way (a prefix the checkpoint lacks; None: not a weight here).
    rename = getattr(model, "checkpoint_name", None)
    # Stacked parameters (the experts of a mixture-of-experts layer) name their tensors' places themselves.
    stacked = getattr(model, "stacked_target", None)
    for name, stored in weights:
        if rename is not None and (name := rename(name)) is None:
            continue
        if name in aliases or any(pattern in name for pattern in ignored):
            continue
        found = stacked(name) if stacked is not None else None
        target, shard_id = found if found is not None else _target(name, packed)
        param = params.get(target)
        if param is None:
            raise ValueError(f"checkpoint tensor {name!r} has no place in {type(model).__name__}")
        # A parameter that keeps the checkpoint's own form (quantization="gguf") takes it as stored.
        keep = checkpoint_format is None or getattr(param, "loads_stored", False)
        tensor = stored if keep else checkpoint_format.load_tensor(stored)
        loader = getattr(param, "weight_loader", default_weight_loader)
        if hasattr(tensor, "materialize") and not getattr(loader, "narrows_lazily", False):
            tensor = tensor.materialize()         # a lazy checkpoint slice (hf.LazySlice): read it whole
        for part, part_id in _shards(modules.get(target.rpartition(".")[0]), tensor, shard_id):
            try:
                loader(param, part, part_id)
            except ValueError as exc:
                raise ValueError(f"checkpoint tensor {name!r}: {exc}") from exc
            loaded.add((target, part_id))
    missing = [name if shard_id is None else f"{name}[{shard_id}]"
               for name, shard_id in _expected(params, packed)
               if (name, shard_id) not in loaded and (name, None) not in loaded]     # or loaded whole
    if missing:
        raise ValueError(f"checkpoint lacks weights for: {', '.join(missing[:8])}"
                         + (f" (and {len(missing) - 8} more)" if len(missing) > 8 else ""))


def _shards(module: Optional[nn.Module], tensor: Any, shard_id: Optional[Any]) -> list[tuple[Any, Optional[Any]]]:
    """A checkpoint that stores a fused module whole (Phi-3's qkv_proj and gate_up_proj, GLM-4's
    gate_up_proj) is split into the module's output shards, so each lands where tensor parallelism
    and quantized packings expect it."""
    sizes = getattr(module, "checkpoint_sizes", None)
    if shard_id is not None or not sizes or len(sizes) < 2 or getattr(tensor, "shape", (0,))[0] != sum(sizes):
        return [(tensor, shard_id)]
    if hasattr(tensor, "materialize"):
        tensor = tensor.materialize()
    return [(part, i) for i, part in enumerate(torch.split(tensor, sizes, dim=0))]


@torch.no_grad()
def process_weights_after_loading(model: nn.Module) -> None:
    """Let each layer's quantization method re-lay out or quantize what was loaded."""
    for module in model.modules():
        method: Optional[QuantizationMethod] = getattr(module, "quant_method", None)
        if method is not None:
            method.process_weights_after_loading(module)
