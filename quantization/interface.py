"""What a quantization method is: how one linear layer's weights are created, loaded,
post-processed and applied (vLLM's linear-method idea).

A leaf module: it imports nothing else of tokenmill's, so a plugin can implement a method
without pulling in the engine. Methods are found by name through the entry-point group
`tokenmill.quantization_methods` (plugins/discovery.py); a platform lists the names it can run
(`Platform.quantization_methods()`) and may hand a method native kernels
(`Platform.quantization_kernels(name)` -> `use_kernels`, a typed `QuantKernels`). What a method
keeps is offered to a platform's other programs (a fused decode step) as declared weight forms
(`weight_form(layer, AffineGroups | Int8Channels | PlatformPacked)`), never by probing attributes.
Bump QUANTIZATION_API_VERSION on any incompatible change.

The layer contract (core/layers/linear.py keeps it): a linear layer offers `weight_loader(param,
loaded, shard_id=None)`, which copies one checkpoint tensor (or the output shard `shard_id` of a
fused q/k/v or gate/up layer) into the rows of `param` it belongs to; `create_weights` attaches it
to every parameter that keeps the checkpoint's layout.
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Callable, ClassVar, Mapping, Optional, Sequence, TypeVar, Union

import torch
from torch import nn

QUANTIZATION_API_VERSION = 2

Kernel = Optional[Callable[..., Any]]


@dataclass(frozen=True)
class QuantKernels:
    """The native kernels a platform may hand a quantization method. Every one is optional: a method
    runs its torch path for any that is None, so a plugin platform supplies what it has."""
    # Per-token int8 GEMMs (int4's batches, int8, compressed-tensors W8A8): x -> (int8 rows, scales),
    # and the int32 product -> float with both scales.
    quantize_rows_int8: Kernel = None
    dequantize_int32: Kernel = None
    # int8 per-channel weights in the platform's packed form (q [N, K], scale [N]) -> PlatformPacked
    # parts or None, and x times those parts (+ bias).
    pack_s8: Kernel = None
    matmul_s8: Kernel = None
    # GGUF blocks kept as stored: whether a (type, rows, k) fits the platform's blocks, the packers
    # per block family (-> the platform's parts), and the matmul / row lookup over those parts.
    fits: Kernel = None
    pack_affine4: Kernel = None
    pack_int8_groups: Kernel = None
    pack_q4k: Kernel = None
    pack_q6k: Kernel = None
    matmul: Kernel = None
    dequantize_rows: Kernel = None

    @classmethod
    def of(cls, kernels: Union["QuantKernels", Mapping[str, Callable[..., Any]], None]) -> "QuantKernels":
        """From a mapping by kernel name (unknown names are a ValueError, so a misspelt one cannot
        silently leave the torch path on)."""
        if isinstance(kernels, QuantKernels):
            return kernels
        given = dict(kernels or {})
        unknown = sorted(set(given) - {f.name for f in fields(cls)})
        if unknown:
            raise ValueError(f"unknown quantization kernels {unknown}; known: {sorted(f.name for f in fields(cls))}")
        return cls(**given)

    def offered(self) -> list[str]:
        return [f.name for f in fields(self) if getattr(self, f.name) is not None]

    def __bool__(self) -> bool:      # "were any kernels given"
        return bool(self.offered())


@dataclass(frozen=True)
class AffineGroups:
    """A weight [N, K] as w = scale * q + low in groups of `group_size` inputs: q uint8 [N, K] in
    0..15, scale and low float32 [N, K / group_size] (the 4-bit grids: int4, GPTQ, AWQ, W4A16)."""
    q: torch.Tensor
    scale: torch.Tensor
    low: torch.Tensor
    group_size: int


@dataclass(frozen=True)
class Int8Channels:
    """A weight [N, K] as w = scale[n] * q[n, k]: q int8 [N, K], scale float32 [N]."""
    q: torch.Tensor
    scale: torch.Tensor


@dataclass(frozen=True)
class PlatformPacked:
    """A weight the method keeps in a platform kernel's own packed form (what the platform's pack_*
    kernel returned): the platform's other programs read `parts` in place instead of packing again."""
    parts: Any


WeightForm = Union[AffineGroups, Int8Channels, PlatformPacked]
FormT = TypeVar("FormT", AffineGroups, Int8Channels, PlatformPacked)


@dataclass(frozen=True)
class ExpertForms:
    """A mixture-of-experts layer's stacked experts (w13 [E, 2I, H], w2 [E, H, I]) as its experts
    method keeps them: each matrix as one weight form over the E * N rows of all its experts (expert
    e's rows are e * N .. (e + 1) * N), or None for a matrix kept dense."""
    w13: Optional[WeightForm]
    w2: Optional[WeightForm]


class ExpertsMethod:
    """How a mixture-of-experts layer keeps its stacked experts (vLLM's fused-MoE method idea). The
    layer's `w13` / `w2` parameters hold the values the torch op multiplies by (dequantized where the
    method quantizes; a method keeping the checkpoint's blocks returns them from `weights`); `forms`
    offers what a platform's moe kernel packs from. This default keeps them dense."""
    name: ClassVar[str] = "unquantized"
    # The layer's parameters hold the experts (False: `weights` builds them from another form, so
    # the torch op asks for the experts a call routes to only).
    resident: ClassVar[bool] = True

    def __init__(self) -> None:
        self.kernels = QuantKernels()

    def create_weights(self, layer: nn.Module) -> None:
        """After the layer made its dense `w13` / `w2` parameters (each with its weight_loader and
        checkpoint_shards): replace them where the method loads the checkpoint's own form."""

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        """Once every expert is loaded: quantize `layer.w13` / `layer.w2` (the layer's parameters)."""

    def weights(self, layer: nn.Module, experts: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The dense (w13, w2) the torch op multiplies by when no platform kernel runs the layer:
        of the experts `experts` (int64 ids, stacked in that order), or of all (None)."""
        w13, w2 = layer.w13, layer.w2
        assert isinstance(w13, torch.Tensor) and isinstance(w2, torch.Tensor)
        return (w13, w2) if experts is None else (w13[experts], w2[experts])

    def forms(self, layer: nn.Module) -> Optional[ExpertForms]:
        """The layer's experts as this method keeps them; None: dense."""
        return None


class QuantizationMethod:
    """One way of storing and multiplying linear-layer weights. One instance serves every
    linear layer of a model, so per-layer state lives on the layer, not here."""
    name: ClassVar[str] = ""
    api_version: ClassVar[int] = QUANTIZATION_API_VERSION

    def __init__(self) -> None:
        self.kernels = QuantKernels()

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

    def use_kernels(self, kernels: Union[QuantKernels, Mapping[str, Callable[..., Any]]]) -> None:
        """Native kernels the platform hands over; a method runs its torch path for any it is not given."""
        self.kernels = QuantKernels.of(kernels)

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

    def weight_form(self, layer: nn.Module, form: type[FormT]) -> Optional[FormT]:
        """The layer's weight in `form` as this method keeps it (no copy where it can be helped), for
        a platform program that multiplies from it (a fused decode step); None (the default): the
        method keeps no such form, or this layer is not stored in it."""
        return None

    def experts_method(self) -> Optional[ExpertsMethod]:
        """The method for mixture-of-experts layers' stacked experts; None (the default): this
        method does not cover experts, and such a layer refuses it."""
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
