"""Swapping a platform's kernels into the core's layers (`Platform.layer_kernels(config)`).

The platform names what it offers by layer kind and knows nothing of these classes; the
core maps each kind to its layer class here. Every layer takes its kernel through `use_kernel`.
"""
from __future__ import annotations

from typing import Any, Mapping

from torch import nn

from .activation import SiluAndMul
from .embedding import LMHead
from .linear import Linear
from .norm import RMSNorm
from .rotary import RotaryEmbedding

LAYER_KINDS: dict[str, type[nn.Module]] = {
    "rms_norm": RMSNorm,
    "rotary": RotaryEmbedding,
    "silu_and_mul": SiluAndMul,
    "linear": Linear,
    "lm_head": LMHead,
}


def apply_layer_kernels(model: nn.Module, kernels: Mapping[str, Any]) -> int:
    """Give every layer of a kind in `kernels` that kernel (once per module, however often it is
    shared: the rotary table serves all layers); returns how many layers took one. A kind the core
    does not know is a ValueError, so a misspelt name cannot silently leave the torch path on."""
    unknown = sorted(set(kernels) - set(LAYER_KINDS))
    if unknown:
        raise ValueError(f"unknown layer kinds {unknown} in the platform's kernels; known: {sorted(LAYER_KINDS)}")
    targets = [(LAYER_KINDS[kind], kernel) for kind, kernel in kernels.items()]
    count = 0
    for module in model.modules():
        for cls, kernel in targets:
            if isinstance(module, cls):
                module.use_kernel(kernel)
                count += 1
    return count
