"""quantization="gguf": GGUF weights kept in their block form (vLLM's `--quantization gguf`).

Each linear layer keeps the file's blocks, never a float copy of the whole weight:
  * natively (the platform hands over "pack_affine4" / "pack_int8_groups" / "pack_q4k" /
    "pack_q6k" / "matmul" / "dequantize_rows" through `Platform.quantization_kernels("gguf")`;
    the cpu platform's are platforms/cpu_gguf_kernels.py): Q4_0, Q4_1 as 4-bit affine groups of
    32, Q8_0 as 8-bit groups of 32, Q4_K and Q6_K in their own kinds (the file's codes and
    super-block scales, the file's values exactly), decoded straight from the stored blocks
    (quantization/gguf_blocks.py) and repacked once into the kernel's layout; a platform without
    the K-quant kinds gets Q4_K as affine groups and Q6_K re-expressed as 8-bit groups;
  * every other block format (Q5_0, Q5_1, Q2_K, Q3_K, Q5_K), and every format where the platform
    has no kernel or the shape does not fit its blocks, as the stored bytes, dequantized a tile
    of output rows at a time inside `apply` (gguf.quants' numerics);
  * float tensors (F32/F16/BF16) as stored.
A fused layer (q/k/v, gate/up) whose parts share a format is one matrix; mixed formats keep one
part per shard and concatenate the outputs. The token embedding and an LM head can be kept the
same way (`keep_stored`, used by the GGUF loader): rows are gathered and dequantized per lookup.
Memory (bytes per 32 weights, file -> resident): Q4_0 18 -> 18, Q4_1 20 -> 20, Q8_0 34 -> 34,
Q4_K 18 -> 18.5 (1.03x: its 6-bit scale and min codes one byte each), Q6_K 26.25 -> 26.25;
the tiled formats exactly the file's. (Without the K-quant kinds: Q4_K 20, Q6_K 34.)
"""
from __future__ import annotations

from functools import partial
from typing import Any, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from . import gguf_blocks
from .gguf import GGUFTensor, check_supported
from .interface import ExpertForms, ExpertsMethod, FormT, PlatformPacked, QuantizationMethod

TILE_ELEMENTS = 1 << 20      # a dequantized tile: at most this many floats (4 MiB) at a time


class StoredPart:
    """Some output rows of a weight in one stored form."""

    def __init__(self, qtype: int, n: int, k: int, tensors: Sequence[torch.Tensor], packed: Any = None) -> None:
        self.qtype, self.n, self.k, self.tensors, self.packed = qtype, n, k, tuple(tensors), packed

    @property
    def native(self) -> bool:
        return self.packed is not None


class GGUFLinearMethod(QuantizationMethod):
    """GGUF blocks kept quantized; see the module docstring."""
    name = "gguf"

    def create_weights(self, layer: nn.Module, input_size: int, output_sizes: Sequence[int], bias: bool,
                       dtype: Optional[torch.dtype]) -> None:
        # `weight` keeps the layer's shape for whoever reads it, over one element of storage.
        layer.register_parameter("weight", self._placeholder(sum(output_sizes), input_size, dtype, layer))
        layer.gguf_sizes = list(output_sizes)
        if bias:
            b = nn.Parameter(torch.empty(sum(output_sizes), dtype=dtype), requires_grad=False)
            b.weight_loader = layer.weight_loader
            layer.register_parameter("bias", b)
        else:
            layer.register_parameter("bias", None)

    def _placeholder(self, n: int, k: int, dtype: Optional[torch.dtype], layer: nn.Module) -> nn.Parameter:
        weight = nn.Parameter(torch.zeros(1, dtype=dtype).expand(n, k), requires_grad=False)
        weight.loads_stored = True           # core/loaders/weights.py hands the GGUFTensor as stored
        weight.weight_loader = partial(self._load_stored, layer)
        layer.gguf_shards = {}
        return weight

    def keep_stored(self, layer: nn.Module, param_name: str = "weight") -> None:
        """Make `layer.<param_name>` (an embedding's or LM head's dense weight) load as stored."""
        old = getattr(layer, param_name)
        setattr(layer, param_name, self._placeholder(old.shape[0], old.shape[1], old.dtype, layer))
        layer.gguf_sizes = [old.shape[0]]

    @staticmethod
    def _load_stored(layer: nn.Module, param: nn.Parameter, stored: Any, shard_id: Optional[int] = None) -> None:
        if not isinstance(stored, GGUFTensor):
            raise ValueError("quantization 'gguf' keeps GGUF blocks as stored; this checkpoint is not a GGUF file")
        sizes = layer.gguf_sizes
        rows = sizes[shard_id] if shard_id is not None else sum(sizes)
        if shard_id is not None and not 0 <= shard_id < len(sizes):
            raise ValueError(f"shard {shard_id} of a layer with {len(sizes)} output shards")
        if tuple(stored.shape) != (rows, param.shape[1]):
            raise ValueError(f"shape mismatch: checkpoint {tuple(stored.shape)} vs model {(rows, param.shape[1])}")
        check_supported(stored.qtype, stored.name)
        layer.gguf_shards[shard_id] = stored

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        shards = getattr(layer, "gguf_shards", None)
        if not shards:
            return
        order = sorted(shards, key=lambda s: -1 if s is None else s)
        tensors = [shards[s] for s in order]
        k = tensors[0].shape[1]
        groups: list[list[GGUFTensor]] = []            # consecutive shards of one format form one part
        for t in tensors:
            if groups and groups[-1][0].qtype == t.qtype:
                groups[-1].append(t)
            else:
                groups.append([t])
        layer.gguf_parts = [self._build_part(g, k) for g in groups]
        for i, part in enumerate(layer.gguf_parts):
            for j, t in enumerate(part.tensors):     # buffers: counted with the model's memory
                layer.register_buffer(f"gguf_{i}_{j}", t, persistent=False)
        layer.gguf_shards = {}

    def _build_part(self, tensors: list[GGUFTensor], k: int) -> StoredPart:
        qtype = tensors[0].qtype
        n = sum(t.shape[0] for t in tensors)
        if qtype in gguf_blocks.FLOAT:
            values = torch.cat([gguf_blocks.dequantize_rows(qtype, gguf_blocks.as_rows(t.data, t.shape[0]), k)
                                for t in tensors])
            return StoredPart(qtype, n, k, (values.to(gguf_blocks.FLOAT_DTYPES[qtype]),))
        rows = torch.cat([gguf_blocks.as_rows(t.data, t.shape[0]) for t in tensors])
        kernels = self.kernels
        if kernels.fits is not None and kernels.fits(n, k):
            # K-quants at the file's size when the platform has their kernels (k is whole 256-blocks).
            if qtype == gguf_blocks.QType.Q4_K and kernels.pack_q4k is not None:
                packed = kernels.pack_q4k(*gguf_blocks.q4k_fields(rows))
                return StoredPart(qtype, n, k, packed.tensors, packed)
            if qtype == gguf_blocks.QType.Q6_K and kernels.pack_q6k is not None:
                packed = kernels.pack_q6k(*gguf_blocks.q6k_fields(rows))
                return StoredPart(qtype, n, k, packed.tensors, packed)
            if qtype in gguf_blocks.AFFINE4 and kernels.pack_affine4 is not None:
                packed = kernels.pack_affine4(*gguf_blocks.affine4_groups(qtype, rows))
                return StoredPart(qtype, n, k, packed.tensors, packed)
            if qtype in gguf_blocks.INT8 and kernels.pack_int8_groups is not None:
                packed = kernels.pack_int8_groups(*gguf_blocks.int8_groups(qtype, rows))
                return StoredPart(qtype, n, k, packed.tensors, packed)
        return StoredPart(qtype, n, k, (rows,))

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        outs = [self._part_matmul(part, x2) for part in layer.gguf_parts]
        y = outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)
        if bias is not None:
            y = y + bias
        return y.reshape(*shape[:-1], y.shape[-1])

    def _part_matmul(self, part: StoredPart, x: torch.Tensor) -> torch.Tensor:
        if part.native:
            return self.kernels.matmul(part.packed, x).to(x.dtype)
        if part.qtype in gguf_blocks.FLOAT:
            return F.linear(x, part.tensors[0].to(x.dtype))
        rows = part.tensors[0]
        tile = max(16, TILE_ELEMENTS // part.k)
        y = torch.empty((x.shape[0], part.n), dtype=x.dtype)
        for start in range(0, part.n, tile):     # one tile of dequantized rows resident at a time
            w = gguf_blocks.dequantize_rows(part.qtype, rows[start:start + tile], part.k).to(x.dtype)
            y[:, start:start + w.shape[0]] = F.linear(x, w)
        return y

    def embed(self, layer: nn.Module, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Rows `ids` of a kept embedding, dequantized -> [..., K] in `dtype`."""
        flat = ids.reshape(-1)
        out = torch.empty((flat.numel(), layer.gguf_parts[0].k), dtype=dtype)
        start = 0
        for part in layer.gguf_parts:
            mask = (flat >= start) & (flat < start + part.n)
            if mask.any():
                local = flat[mask] - start
                if part.native:
                    values = self.kernels.dequantize_rows(part.packed, local)
                elif part.qtype in gguf_blocks.FLOAT:
                    values = part.tensors[0].index_select(0, local)
                else:
                    unique, inverse = torch.unique(local, return_inverse=True)
                    values = gguf_blocks.dequantize_rows(part.qtype, part.tensors[0].index_select(0, unique),
                                                         part.k)[inverse]
                out[mask] = values.to(dtype)
            start += part.n
        return out.reshape(*ids.shape, -1)

    def weight_form(self, layer: nn.Module, form: type[FormT]) -> Optional[FormT]:
        """PlatformPacked: the platform's packed form of the whole weight (what its pack_* kernel
        returned; it stays alive as the layer's buffers) when the layer is one natively packed part,
        for a platform step that multiplies through the same kernels (the cpu platform's fused
        decode); None for tiled, float or mixed-format layers, which only `apply` runs."""
        parts = getattr(layer, "gguf_parts", None)
        if form is not PlatformPacked or not parts or len(parts) != 1 or not parts[0].native:
            return None
        return PlatformPacked(parts[0].packed)

    def lm_head_method(self) -> Optional[QuantizationMethod]:
        return self      # the loader keeps the head (or the tied embedding) stored: see keep_stored

    def experts_method(self) -> Optional[ExpertsMethod]:
        return GGUFExperts(self)


class GGUFExperts(ExpertsMethod):
    """A mixture-of-experts layer's experts kept in the file's blocks: each expert's gate and up
    (one part when they share a format) and down built as a linear layer's parts (natively packed
    where the platform's kernels take them, else the stored rows). `forms`: PlatformPacked lists of
    the experts' packed parts when every one is native (the platform's moe kernel multiplies them in
    place); `weights`: the experts dequantized, for the torch op (no such kernel here)."""
    name = "gguf"
    resident = False

    def __init__(self, linear: GGUFLinearMethod) -> None:
        super().__init__()
        self.linear = linear
        self.kernels = linear.kernels

    def create_weights(self, layer: nn.Module) -> None:
        for name in ("w13", "w2"):
            old = getattr(layer, name)
            param = nn.Parameter(torch.zeros(1, dtype=old.dtype).expand(old.shape), requires_grad=False)
            param.loads_stored = True
            param.checkpoint_shards = old.checkpoint_shards
            param.weight_loader = partial(self._load_stored, layer)
            setattr(layer, name, param)
        layer.gguf_experts = {}

    @staticmethod
    def _load_stored(layer: nn.Module, param: nn.Parameter, stored: Any, shard_id: Any = None) -> None:
        if not isinstance(stored, GGUFTensor) or shard_id is None:
            raise ValueError("quantization 'gguf' keeps GGUF blocks as stored: one expert's tensor at a time "
                             "from a GGUF file")
        expert, part = shard_id
        rows = param.shape[1] // 2 if part in ("gate", "up") else param.shape[1]
        if tuple(stored.shape) != (rows, param.shape[2]):
            raise ValueError(f"shape mismatch (expert {expert} {part}): checkpoint {tuple(stored.shape)} "
                             f"vs model {(rows, param.shape[2])}")
        check_supported(stored.qtype, stored.name)
        layer.gguf_experts[(expert, part)] = stored

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        stored = layer.gguf_experts
        num = layer.w13.shape[0]
        layer.gguf_w13 = [self._parts([stored[(e, "gate")], stored[(e, "up")]]) for e in range(num)]
        layer.gguf_w2 = [self._parts([stored[(e, "down")]]) for e in range(num)]
        for name in ("gguf_w13", "gguf_w2"):
            for e, parts in enumerate(getattr(layer, name)):
                for i, part in enumerate(parts):
                    for j, t in enumerate(part.tensors):     # buffers: counted with the model's memory
                        layer.register_buffer(f"{name}_{e}_{i}_{j}", t, persistent=False)
        layer.gguf_experts = {}

    def _parts(self, tensors: list[GGUFTensor]) -> list[StoredPart]:
        if tensors[0].qtype == tensors[-1].qtype:
            return [self.linear._build_part(tensors, tensors[0].shape[1])]
        return [self.linear._build_part([t], t.shape[1]) for t in tensors]

    def forms(self, layer: nn.Module) -> Optional[ExpertForms]:
        def packed(experts: list[list[StoredPart]]) -> Optional[PlatformPacked]:
            if not all(len(parts) == 1 and parts[0].native for parts in experts):
                return None
            return PlatformPacked([parts[0].packed for parts in experts])
        w13, w2 = packed(layer.gguf_w13), packed(layer.gguf_w2)
        return ExpertForms(w13, w2) if w13 is not None and w2 is not None else None

    def weights(self, layer: nn.Module, experts: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The experts asked for dequantized, on each call (a platform without a moe kernel for these blocks)."""
        chosen = range(layer.w13.shape[0]) if experts is None else experts.tolist()

        def dense(stored: list[list[StoredPart]], dtype: torch.dtype) -> torch.Tensor:
            return torch.stack([torch.cat([self._dense(p) for p in stored[e]]) for e in chosen]).to(dtype)
        return dense(layer.gguf_w13, layer.w13.dtype), dense(layer.gguf_w2, layer.w2.dtype)

    def _dense(self, part: StoredPart) -> torch.Tensor:
        if part.native:
            return self.kernels.dequantize_rows(part.packed, torch.arange(part.n))
        if part.qtype in gguf_blocks.FLOAT:
            return part.tensors[0].float()
        return gguf_blocks.dequantize_rows(part.qtype, part.tensors[0], part.k)
