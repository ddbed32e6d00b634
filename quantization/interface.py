"""What a quantization method is: how one linear layer's weights are created, loaded,
post-processed and applied (vLLM's linear-method idea).

A leaf module: it imports nothing else of tokenmill's, so a plugin can implement a method
without pulling in the engine. Methods are found by name through the entry-point group
`tokenmill.quantization_methods` (plugins/discovery.py); a platform lists the names it can run
(`Platform.quantization_methods()`) and may hand a method native kernels
(`Platform.quantization_kernels(name)` -> `use_kernels`). Bump QUANTIZATION_API_VERSION on any
incompatible change.

The layer contract (core/layers/linear.py keeps it): a linear layer offers `weight_loader(param,
loaded, shard_id=None)`, which copies one checkpoint tensor (or the output shard `shard_id` of a
fused q/k/v or gate/up layer) into the rows of `param` it belongs to; `create_weights` attaches it
to every parameter that keeps the checkpoint's layout.
"""
from __future__ import annotations

from typing import Any, Callable, ClassVar, Mapping, Optional, Sequence

import torch
from torch import nn

QUANTIZATION_API_VERSION = 1


class QuantizationMethod:
    """One way of storing and multiplying linear-layer weights. One instance serves every
    linear layer of a model, so per-layer state lives on the layer, not here."""
    name: ClassVar[str] = ""
    api_version: ClassVar[int] = QUANTIZATION_API_VERSION

    def __init__(self) -> None:
        self.kernels: dict[str, Callable[..., Any]] = {}

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> "QuantizationMethod":
        """The method for a checkpoint that config.json's `quantization_config` (`config`)
        says is stored in this format; ValueError naming `quantization` for a variant the method
        cannot run. The default: the method takes no settings."""
        return cls()

    @classmethod
    def available(cls) -> Optional[str]:
        """None when this torch build can run the method, else why not."""
        return None

    def use_kernels(self, kernels: Mapping[str, Callable[..., Any]]) -> None:
        """Native kernels the platform hands over (names are the method's own); a method runs
        its torch path for any it is not given."""
        self.kernels = dict(kernels)

    def create_weights(self, layer: nn.Module, input_size: int, output_sizes: Sequence[int], bias: bool,
                       dtype: Optional[torch.dtype]) -> None:
        """Register the layer's parameters (`weight`, and `bias` or None), each with a
        `weight_loader` attribute."""
        raise NotImplementedError

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        """Once every weight is loaded: re-lay out or quantize them for `apply`."""

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
        """x [..., input_size] -> [..., output_size] (+ bias)."""
        raise NotImplementedError

    def affine_groups(self, layer: nn.Module) -> Optional[tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]]:
        """For a platform kernel that multiplies from the method's own grid (a fused decode
        step): the layer's weight [N, K] as (q uint8 [N, K], scale float32 [N, K/G], low float32
        [N, K/G], G) with w = scale * q + low in groups of G inputs. None (the default): the
        method has no such form, or this layer is not stored in it."""
        return None

    def lm_head_method(self) -> Optional["QuantizationMethod"]:
        """The method for the LM head, which is often tied to the embedding (so its weight must
        stay as loaded) and more sensitive to precision than the other layers. The head keeps
        its own (or the embedding's) dense weight: only process_weights_after_loading and apply
        are called. None: plain matmul."""
        return None

    def load_tensor(self, stored: Any) -> torch.Tensor:
        """A checkpoint-format method's part: one tensor as the checkpoint stores it -> the dense
        tensor a parameter's weight loader copies in. The default takes torch tensors as they are."""
        return stored
