"""Swapping a platform's kernels into the core's layers (`Platform.layer_kernels(config)`, a
typed `LayerKernels`).

The platform offers kernels by op kind and knows nothing of these classes; the core maps each kind
to its layer class here. Every layer takes its kernel through `use_kernel`.
"""
from __future__ import annotations

from typing import Any, Mapping, Union

from torch import nn

from tokenmill.platforms.interface import LayerKernels

from .activation import GatedActivation, SiluAndMul
from .embedding import LMHead
from .gated_deltanet import GatedDeltaNet
from .kimi_delta import KimiDeltaAttention
from .linear import Linear
from .mamba2 import Mamba2Mixer
from .moe import FusedMoE
from .norm import RMSNorm
from .rotary import RotaryEmbedding

LAYER_KINDS: dict[str, type[nn.Module]] = {
    "rms_norm": RMSNorm,
    "rotary": RotaryEmbedding,
    "silu_and_mul": SiluAndMul,
    "gelu_tanh_and_mul": GatedActivation,
    "moe": FusedMoE,
    "gated_delta_rule": GatedDeltaNet,
    "kimi_delta_rule": KimiDeltaAttention,
    "ssd_scan": Mamba2Mixer,
    "linear": Linear,
    "lm_head": LMHead,
}


def apply_layer_kernels(model: nn.Module, kernels: Union[LayerKernels, Mapping[str, Any]]) -> int:
    """Give every layer of a kind the platform offers a kernel for that kernel (once per module,
    however often it is shared: the rotary table serves all layers); returns how many layers took one."""
    targets = [(LAYER_KINDS[kind], kernel) for kind, kernel in LayerKernels.of(kernels).offered().items()]
    count = 0
    for module in model.modules():
        for cls, kernel in targets:
            if isinstance(module, cls):
                module.use_kernel(kernel)
                count += 1
    return count
