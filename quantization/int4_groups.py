"""What the 4-bit checkpoint formats (AWQ, GPTQ, compressed-tensors W4A16) share once loaded:
one grid, w = scale * (q - zero) in groups of G input channels, kept 4-bit.

Each format's method registers the tensors its files store (create_weights, with a weight loader
that places a fused q/k/v or gate/up layer's shards along its packed dimension), then unpacks
them once into this layout (`Int4Groups`), dropping the stored ones:
  nibbles uint8 [N, K/2] (input channel 2i in the low nibble), zeros uint8 [N, K/G], scales
  [N, K/G] in the checkpoint's float dtype, and for GPTQ act-order an input permutation that
  makes the groups contiguous (the activations are permuted instead of the weight's groups).
That is the file's size (zeros take a byte instead of half of one), with no float copy.

`apply` dequantizes a tile of output rows at a time into the activation dtype and multiplies
it (exact: (q - zero) is a small integer and scale is the stored value, so the product is the
checkpoint's dequantized weight rounded once). The grid is also offered as `affine_groups`
(scale, low = -scale * zero) for a platform kernel that multiplies 4-bit groups.
"""
from __future__ import annotations

from typing import Callable, NamedTuple, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from .interface import AffineGroups, FormT, QuantizationMethod

# Output rows dequantized per step of `apply`: 2048 x K floats (32 MB at K=4096) at a time.
TILE_ROWS = 2048

Loader = Callable[[nn.Parameter, torch.Tensor, Optional[int]], None]


class Int4Groups(NamedTuple):
    nibbles: torch.Tensor               # uint8 [N, K/2]
    zeros: torch.Tensor                 # uint8 [N, K/G], 0..15
    scales: torch.Tensor                # [N, K/G], as stored
    group_size: int
    perm: Optional[torch.Tensor]        # int32 [K] or None: x[..., perm] meets the weight's inputs


def _adopt_dtype(param: nn.Parameter, loaded: torch.Tensor) -> None:
    """Scales keep the checkpoint's float dtype (fp16, bf16, fp32): it is only known once the
    first shard arrives, and every shard of a layer shares it."""
    if param.dtype != loaded.dtype and param.is_floating_point() and loaded.is_floating_point():
        param.data = torch.empty(param.shape, dtype=loaded.dtype, device=param.device)


def shard_loader(output_sizes: Sequence[int], dim: int, pack: int = 1, name: str = "",
                 as_stored: bool = False) -> Loader:
    """A weight loader for a stored tensor whose dimension `dim` runs over output channels,
    `pack` of them per element (AWQ's qweight: 8 per int32). Shard `shard_id` of a fused layer
    lands at its output offset / pack. `as_stored`: a float parameter takes the checkpoint's dtype."""
    def load(param: nn.Parameter, loaded: torch.Tensor, shard_id: Optional[int] = None) -> None:
        if as_stored:
            _adopt_dtype(param, loaded)
        target = param.data
        if shard_id is not None:
            if not 0 <= shard_id < len(output_sizes):
                raise ValueError(f"shard {shard_id} of a layer with {len(output_sizes)} output shards")
            start, size = sum(output_sizes[:shard_id]), output_sizes[shard_id]
            if start % pack or size % pack:
                raise ValueError(f"{name}: output shard of {size} channels at {start} does not split "
                                 f"{pack}-per-element packing")
            target = target.narrow(dim, start // pack, size // pack)
        if tuple(target.shape) != tuple(loaded.shape):
            where = "" if shard_id is None else f" (shard {shard_id})"
            raise ValueError(f"{name} shape mismatch{where}: checkpoint {tuple(loaded.shape)} "
                             f"vs model {tuple(target.shape)}")
        target.copy_(loaded)
    return load


def per_shard_loader(num_shards: int, name: str = "", as_stored: bool = False) -> Loader:
    """A loader for a tensor every shard stores whole (GPTQ's g_idx, a per-tensor scale,
    compressed-tensors' weight_shape): the parameter holds one row per shard."""
    def load(param: nn.Parameter, loaded: torch.Tensor, shard_id: Optional[int] = None) -> None:
        if as_stored:
            _adopt_dtype(param, loaded)
        row = 0 if shard_id is None else shard_id
        if not 0 <= row < num_shards:
            raise ValueError(f"shard {row} of a layer with {num_shards} output shards")
        target = param.data[row]
        if loaded.numel() != target.numel():
            raise ValueError(f"{name} shape mismatch: checkpoint {tuple(loaded.shape)} vs model {tuple(target.shape)}")
        target.copy_(loaded.reshape(target.shape))
    return load


def add_param(layer: nn.Module, name: str, shape: Sequence[int], dtype: torch.dtype, loader: Loader) -> None:
    param = nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)
    param.weight_loader = loader
    layer.register_parameter(name, param)


def add_bias(layer: nn.Module, output_sizes: Sequence[int], bias: bool, dtype: Optional[torch.dtype]) -> None:
    if bias:
        add_param(layer, "bias", [sum(output_sizes)], dtype or torch.float32,
                  shard_loader(output_sizes, 0, name="bias"))
    else:
        layer.register_parameter("bias", None)


def unpack_int32(packed: torch.Tensor, dim: int, order: Sequence[int] = range(8)) -> torch.Tensor:
    """int32 words holding eight 4-bit values each -> uint8 values, eight per word along `dim`;
    nibble j (bits 4j..4j+3) is element order[j] of its word's eight."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=packed.device)
    values = (packed.unsqueeze(-1) >> shifts).bitwise_and_(0xF).to(torch.uint8)      # [..., 8] by nibble
    inverse = sorted(range(8), key=lambda j: order[j])
    values = values[..., inverse]                                                   # [..., 8] by element
    values = values.movedim(-1, dim + 1) if dim < packed.dim() - 1 else values
    shape = list(packed.shape)
    shape[dim] *= 8
    return values.reshape(shape)


def groups_from_values(q: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor,
                       perm: Optional[torch.Tensor] = None) -> Int4Groups:
    """q [N, K] (0..15), zeros [N, K/G] (0..15), scales [N, K/G] -> the kept layout."""
    n, k = q.shape
    if k % 2 or zeros.shape != scales.shape or k % scales.shape[1]:
        raise ValueError(f"4-bit weight [{n}, {k}] with {tuple(scales.shape)} group scales "
                         "is not a whole number of groups")
    q = q.to(torch.uint8)
    nibbles = (q[:, 0::2] | (q[:, 1::2] << 4)).contiguous()
    return Int4Groups(nibbles, zeros.to(torch.uint8).contiguous(), scales.contiguous(), k // scales.shape[1],
                      None if perm is None else perm.to(torch.int32).contiguous())


def dequantize_rows(groups: Int4Groups, start: int, stop: int, dtype: torch.dtype) -> torch.Tensor:
    """Output rows start..stop of the weight, [rows, K] in `dtype`."""
    nib = groups.nibbles[start:stop]
    rows, half = nib.shape
    # In place on one float buffer: no temporaries, unlike out-of-place broadcasting.
    w = torch.stack((nib & 0xF, nib >> 4), dim=-1).view(rows, -1, groups.group_size).float()
    w.sub_(groups.zeros[start:stop].unsqueeze(-1)).mul_(groups.scales[start:stop].unsqueeze(-1))
    return w.view(rows, 2 * half).to(dtype)


def dequantize(groups: Int4Groups, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The whole weight [N, K] in the checkpoint's input order (tests, exports)."""
    w = dequantize_rows(groups, 0, groups.nibbles.shape[0], dtype)
    if groups.perm is not None:
        w = torch.empty_like(w).index_copy_(1, groups.perm.long(), w)
    return w


def int4_groups_linear(groups: Int4Groups, x: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    if groups.perm is not None:
        x = x.index_select(-1, groups.perm)
    n = groups.nibbles.shape[0]
    if n <= TILE_ROWS:
        return F.linear(x, dequantize_rows(groups, 0, n, x.dtype), bias)
    out = torch.cat([F.linear(x, dequantize_rows(groups, i, min(i + TILE_ROWS, n), x.dtype))
                     for i in range(0, n, TILE_ROWS)], dim=-1)
    return out + bias if bias is not None else out


def layer_groups(layer: nn.Module) -> Optional[Int4Groups]:
    """The 4-bit grid a processed layer keeps (None before processing)."""
    if getattr(layer, "int4_nibbles", None) is None:
        return None
    return Int4Groups(layer.int4_nibbles, layer.int4_zeros, layer.int4_scales, layer.int4_group_size, layer.int4_perm)


class Int4GroupsMethod(QuantizationMethod):
    """Base of the 4-bit checkpoint formats: a subclass registers its stored tensors and says
    how to unpack them (`unpack`); loading them into `Int4Groups`, `apply` and `affine_groups`
    are here."""
    stored_names: tuple[str, ...] = ()
    # Checkpoint module names left in float (AWQ's modules_to_not_convert), matched as substrings
    # the way transformers matches them; core/loaders/quant_config.py rebuilds those layers.
    not_converted: tuple[str, ...] = ()

    def ignores(self, module_name: str) -> bool:
        return any(key in module_name for key in self.not_converted)

    def unpack(self, layer: nn.Module) -> Int4Groups:
        raise NotImplementedError

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        groups = self.unpack(layer)
        for name in self.stored_names:          # the stored form goes: no second copy
            if name in layer._parameters:
                delattr(layer, name)
        # Buffers, so that module.to() moves them and a memory report counts them.
        layer.register_buffer("int4_nibbles", groups.nibbles, persistent=False)
        layer.register_buffer("int4_zeros", groups.zeros, persistent=False)
        layer.register_buffer("int4_scales", groups.scales, persistent=False)
        layer.register_buffer("int4_perm", groups.perm, persistent=False)
        layer.int4_group_size = groups.group_size

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
        return int4_groups_linear(layer_groups(layer), x, bias)

    def weight_form(self, layer: nn.Module, form: type[FormT]) -> Optional[FormT]:
        """AffineGroups: the stored 4-bit grid (in groups of 32 where the group size allows)."""
        groups = layer_groups(layer)
        if form is not AffineGroups or groups is None or groups.perm is not None:
            return None          # act-order: its inputs are permuted, which a plain grid cannot say
        q = torch.stack((groups.nibbles & 0xF, groups.nibbles >> 4), dim=-1).reshape(groups.nibbles.shape[0], -1)
        scale = groups.scales.float()
        low = -scale * groups.zeros.float()
        if groups.group_size % 32 == 0:     # the same grid in groups of 32 (GGUF Q4_1's, the kernels')
            repeat = groups.group_size // 32
            return AffineGroups(q, scale.repeat_interleave(repeat, dim=1), low.repeat_interleave(repeat, dim=1), 32)
        return AffineGroups(q, scale, low, groups.group_size)

    def lm_head_method(self) -> Optional[QuantizationMethod]:
        return None              # these formats leave the LM head in float
