"""How much memory a loaded model's weights hold: what `tokenmill bench throughput` reports next
to the checkpoint's file size."""
from __future__ import annotations

from typing import Any, Iterator

import torch
from torch import nn

from ..layers.rotary import RotaryEmbedding


def _tensors(value: object) -> Iterator[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (tuple, list)):
        for item in value:
            yield from _tensors(item)


def resident_weight_bytes(model: nn.Module) -> int:
    """Bytes of every distinct storage behind the model's parameters, buffers and quantization
    state (tensors, or tuples of them, a method keeps on a layer as `*_state`): each storage
    once, however many parameters view it (tied embeddings, fused shards). Tables computed
    from the config rather than loaded (the rotary embedding's cos/sin) are not weights."""
    seen: dict[int, int] = {}
    for module in model.modules():
        tensors = list(module.parameters(recurse=False))
        if not isinstance(module, RotaryEmbedding):
            tensors += list(module.buffers(recurse=False))
        for name, value in vars(module).items():
            if name.endswith("_state"):
                tensors.extend(_tensors(value))
        for t in tensors:
            if t.device.type == "meta":
                continue
            storage = t.untyped_storage()
            seen[storage.data_ptr()] = max(seen.get(storage.data_ptr(), 0), storage.nbytes())
    return sum(seen.values())


def weight_memory(bundle: Any) -> dict[str, Any]:
    """The model's resident weight bytes (parameters, buffers, quantization state: each storage
    once, core/loaders/resident.py) next to the checkpoint's size on disk."""
    import os

    path = bundle.source.path
    if os.path.isdir(path):
        checkpoint = sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path)
                         if f.endswith((".safetensors", ".bin", ".gguf", ".pt")))
    else:
        checkpoint = os.path.getsize(path)
    resident = resident_weight_bytes(bundle.model) if bundle.model is not None else None
    if resident is None:
        text = f"weights: checkpoint {checkpoint / 2**20:.1f} MiB (resident in the workers, not measured here)"
    else:
        text = (f"weights: {resident / 2**20:.1f} MiB resident, checkpoint file {checkpoint / 2**20:.1f} MiB "
                f"({resident / max(checkpoint, 1):.2f}x), quantization {bundle.quantization or 'none'}")
    return {"resident_bytes": resident, "checkpoint_bytes": checkpoint, "text": text}
