"""The cpu platform's "fused_decode" decode program: a step of a few tokens (decodes,
verified drafts, short prompt chunks: up to MAX_FUSED_TOKENS in all) or of decodes only (up to
MAX_FUSED_DECODES sequences) runs the decoder's layers in native calls
(platforms/csrc/cpu_decode_step.cpp) instead of ~45 torch ops per layer; other steps (prompt
chunks) run the eager model. The native step is composed from each layer's LayerStructure
(platforms/interface.py): a layer using what it does not express (NATIVE_VALUES) runs eagerly
between native ranges, and the log says which, once.

It asks the model for `decoder_stack()` (platforms/interface.py DecoderStackSpec), re-lays out
the weights once into the kernel's blocks (4-bit groups from the quantization method's
`weight_form(layer, AffineGroups)`; int8 per-channel weights from its Int8Channels under
quantization="int8", "s8"; bf16 pairs) or, for weights the quantization method already keeps in
this library's packed form (quantization="gguf": "native"), takes its PlatformPacked parts as they
are (no copy; an embedding kept quantized is looked up by the model's own `embed` in torch and
handed in as rows), and calls each layer's attention through the backend's
`native_decode_fn` (attention_backends/interface.py NATIVE_DECODE_ABI). When any of that is
missing — a model without `decoder_stack`, weights in another form, a CPU without AVX512-VNNI /
AVX512-BF16, no compiler, or no layer the step expresses — `build` says why in the log and returns
the eager forward.

Numerics: 4-bit (or GGUF's) weights times activations quantized to int8 per 32 inputs
(llama.cpp's Q4 x Q8 scheme), or bf16 weights times bf16-rounded activations, float32
accumulation and float32 everything else. Not bit-identical to the eager path, which is why it
is not used for float32 (the mode that matches transformers token for token). Under "gguf" the
matmuls are the eager path's own kernels; only the norms', rope's and attention's float rounding
differ (and int8 rounding of activations can amplify that over many layers).
"""
from __future__ import annotations

import ctypes
import logging
from typing import Any, Callable, Optional

import torch

from tokenmill.quantization.interface import AffineGroups, Int8Channels, PlatformPacked

from .interface import DecoderLayerSpec, DecoderStackSpec, DecodeProgram, LayerStructure, ModelView
from .cpu_fused_moe import RoutingNotes, pack_moe
from .cpu_native_layers import (ACTIVATIONS, NORM_KINDS, QK_NORMS, dense_linears, layer_refusals, linear_shape,
                                outside_vocabulary, ranges)
from .cpu_decode_kernels import (BF16, LIBRARY, Q4, PackedBf16, S8Weight, NativeLayer, NativeLinear, NativeModel,
                                 NativeStep,
                                 pack_bf16, pack_q4, pack_s8, pack_s8_weight, s8_linear)

logger = logging.getLogger("tokenmill.platforms.cpu")

# Any step of up to MAX_FUSED_TOKENS tokens runs fused; a step of one token per sequence (decodes
# only) up to MAX_FUSED_DECODES: its attention reads each context once per row either way, and
# the fused step's GEMMs run at oneDNN's rate from 8 rows up (`tokenmill bench gemm`) while the eager
# step pays ~30 torch ops a layer around them. Prompt chunks above 32 tokens stay eager: their
# rows attend to each other, which the eager path's flash attention does in one pass.
MAX_FUSED_TOKENS = 32
MAX_FUSED_DECODES = 256
# Under "q4", steps of this many tokens and more run S8 (int8 per-channel weights, 2 blocks x 6
# tokens a tile), which outruns Q4 from 8 rows up (`tokenmill bench gemm`); below that Q4 wins,
# its weights being a quarter of the bytes.
BATCH_ROWS = 8

# native: the quantization method's packed parts as they are; s8: its int8 per-channel weights.
WEIGHT_FORMATS = ("q4", "bf16", "native", "s8")


class FusedDecodeProgram(DecodeProgram):
    name = "fused_decode"
    attention_mode = "none"     # the backend runs eagerly or through its native entry, never traced
    reads_kv_groups = True      # each layer's attention takes its own group's block tables

    def __init__(self, weight_format: str) -> None:
        if weight_format not in WEIGHT_FORMATS:
            raise ValueError(f"fused_decode weight format must be one of {WEIGHT_FORMATS}, got {weight_format!r}")
        self.weight_format = weight_format
        self.eager_layers: list[int] = []     # layers the native step does not express (run eagerly)

    def build(self, forward: Callable[..., torch.Tensor], model: ModelView) -> Callable[..., torch.Tensor]:
        why = self.unavailable(model)
        if not why:
            try:
                step = _FusedStep(self._spec, model.attention_layers, self.weight_format, model.num_blocks,
                                  model.block_size, set(self.eager_layers))
            except _Unsupported as e:
                why = str(e)
        if why:
            self.eager_reason = why
            logger.info("fused_decode: running the model eagerly: %s", why)
            return forward
        logger.info("fused_decode: steps of up to %d tokens (%d decodes) run as native calls (%s)",
                    MAX_FUSED_TOKENS, MAX_FUSED_DECODES,
                    "the quantization method's packed weights in place" if self.weight_format == "native"
                    else f"{self.weight_format} weights")
        if self.eager_layers:
            logger.info("fused_decode: layers %s run eagerly between native ranges: %s", ranges(self.eager_layers),
                        "; ".join(self._beyond))

        def fused_or_eager(input_ids: torch.Tensor, positions: torch.Tensor, meta: Any) -> torch.Tensor:
            tokens = input_ids.shape[0]
            if tokens <= MAX_FUSED_TOKENS or (tokens <= MAX_FUSED_DECODES and meta.num_decodes == tokens):
                fused_or_eager.last_path = self.name
                return step(input_ids, positions, meta)
            fused_or_eager.last_path = "eager"
            return forward(input_ids, positions, meta)

        fused_or_eager.fused_step = step        # for tests and profiling
        fused_or_eager.last_path = self.name    # which path the last step took (`bench --profile`)
        return fused_or_eager

    def unavailable(self, model: ModelView) -> Optional[str]:
        """Why the fused step cannot run this model here, or None (then `eager_layers` are the layers
        it leaves to the eager model)."""
        if model.world_size > 1:
            # One native call per decoder stack cannot all-reduce after its row-parallel layers
            # nor hand hidden states to another pipeline stage.
            return "tensor/pipeline parallelism needs collectives inside the step"
        lib, why = LIBRARY.load()
        if lib is None:
            return why
        caps = lib.fused_decode_caps()
        if self.weight_format in ("q4", "native", "s8") and not caps & 1:
            return "this CPU has no AVX512-VNNI"
        if self.weight_format == "bf16" and not caps & 2:
            return "this CPU has no AVX512-BF16"
        if not hasattr(model.model, "decoder_stack"):
            return f"{type(model.model).__name__} offers no decoder_stack()"
        spec: DecoderStackSpec = model.model.decoder_stack()
        self._spec = spec             # what build() packs
        if spec.head_size % 2 or spec.hidden_size % 32 or spec.intermediate_size % 32:
            return "hidden, intermediate and head sizes must be multiples of 32 (head size even)"
        self._beyond = outside_vocabulary(spec)
        self.eager_layers = [i for i, layer in enumerate(spec.layers) if layer_refusals(layer)]
        if len(self.eager_layers) == len(spec.layers):
            return "its layers use what the native step does not express: " + "; ".join(self._beyond)
        if self.eager_layers and any(layer.eager is None for layer in spec.layers):
            return ("its layers use what the native step does not express and the spec offers no eager "
                    "layers to run in between: " + "; ".join(self._beyond))
        return None


class _Unsupported(Exception):
    """A layer's weights are not in a form the fused step reads."""


class _FusedStep:
    """The packed weights and the ctypes structures of one model; called per decode step. Layers in
    `eager_layers` run through their own eager forward between the native ranges."""

    def __init__(self, spec: DecoderStackSpec, attention_layers: list, weight_format: str, num_blocks: int,
                 block_size: int, eager_layers: set[int]) -> None:
        self._lib = LIBRARY.require()
        self._keep: list[torch.Tensor] = []          # everything the structures point into
        self._attention = attention_layers
        self._native = [i not in eager_layers for i in range(len(spec.layers))]
        self._eager = [layer.eager for layer in spec.layers]
        # The step as ranges: (True, a, b) native layers a..b-1, (False, a, b) eager ones.
        self._ranges: list[tuple[bool, int, int]] = []
        for i, native in enumerate(self._native):
            if self._ranges and self._ranges[-1][0] == native:
                self._ranges[-1] = (native, self._ranges[-1][1], i + 1)
            else:
                self._ranges.append((native, i, i + 1))
        self._routing_notes = RoutingNotes()
        self._num_groups = 1 + max(int(getattr(layer.attention, "kv_group", 0)) for layer in spec.layers)
        self._layers = (NativeLayer * len(spec.layers))()
        for i, (slot, layer) in enumerate(zip(self._layers, spec.layers)):
            if self._native[i]:
                self._fill(slot, layer, spec, weight_format, i)
        # Batches (BATCH_ROWS tokens and more) under "q4": the same layers over the method's int8
        # per-channel weights (what its own eager matmuls take for batches) in S8.
        self._batch_layers = self._s8_variant(spec) if weight_format == "q4" else None
        self._kv_caches: list[Optional[torch.Tensor]] = [None] * len(spec.layers)
        embedding = spec.embedding.detach()
        self.out_dtype = embedding.dtype if embedding.dtype == torch.bfloat16 else torch.float32
        self._dtype = embedding.dtype if embedding.dtype.is_floating_point else torch.float32
        self._embed: Optional[Callable[[torch.Tensor], torch.Tensor]] = None
        if not _dense(embedding):
            # A weight that only carries the shape (quantization="gguf" keeps the table in blocks):
            # each step's rows come from the model's own lookup, never a float copy of the table.
            if spec.embed is None:
                raise _Unsupported("the embedding is no dense table and the model offers no embed()")
            self._embed = spec.embed
            embedding = torch.empty(0)                 # never read: the step gets the rows
        elif embedding.dtype not in (torch.float32, torch.bfloat16):
            embedding = embedding.float()
        self._keep.append(embedding)
        norm = spec.layers[0].structure.norm
        self._model = NativeModel(
            num_layers=len(spec.layers), hidden=spec.hidden_size, intermediate=spec.intermediate_size,
            num_heads=spec.num_heads, num_kv_heads=spec.num_kv_heads, head_size=spec.head_size,
            num_blocks=num_blocks, block_size=block_size, eps=spec.eps, embedding_scale=spec.embedding_scale,
            embedding=embedding.data_ptr(), embedding_bf16=int(embedding.dtype == torch.bfloat16),
            final_norm=self._norm(spec.final_norm, spec.layers[0].structure),
            final_norm_bias=self._f32(spec.final_norm_bias) if spec.final_norm_bias is not None else None,
            final_norm_kind=NORM_KINDS.get(norm, 0), layers=self._layers,
            attend=next(layer.attention.impl.native_decode_fn(layer.attention.kv_cache)
                        for i, layer in enumerate(spec.layers) if self._native[i]))
        self._batch_model = None
        if self._batch_layers is not None:
            self._batch_model = NativeModel.from_buffer_copy(self._model)
            self._batch_model.layers = self._batch_layers
        self._hidden = spec.hidden_size

    def _fill(self, slot: NativeLayer, layer: DecoderLayerSpec, spec: DecoderStackSpec, weight_format: str,
              i: int) -> None:
        s = layer.structure
        for name, bias_slot in (("input_norm", "attn_in"), ("post_norm", "ffn_in"), ("attn_out_norm", "attn_out"),
                                ("ffn_out_norm", "ffn_out")):
            weight = getattr(layer, name)
            setattr(slot, name, self._norm(weight, s) if weight is not None else None)
            bias = layer.norm_bias.get(bias_slot)
            setattr(slot, f"{name}_bias", self._f32(bias) if bias is not None else None)
        slot.q_norm = self._norm(layer.q_norm, s) if layer.q_norm is not None else None
        slot.k_norm = self._norm(layer.k_norm, s) if layer.k_norm is not None else None
        for name in dense_linears(layer):
            setattr(slot, name, self._linear(getattr(layer, name), weight_format, f"layer {i} {name}"))
        if layer.moe is not None:         # an expert FFN: its experts as the moe kernel packed them
            ffn = pack_moe(layer.moe, lambda linear, name: self._linear(linear, weight_format, f"layer {i} {name}"),
                           self._keep)
            slot.moe = ctypes.addressof(ffn)
            self._routing_notes.add(ffn, layer.moe)
        slot.window = int(layer.attention.sliding_window or 0)
        slot.group = int(getattr(layer.attention, "kv_group", 0))
        slot.norm_kind = NORM_KINDS[s.norm]
        slot.qk_norm = QK_NORMS[s.qk_norm]
        slot.rope_gptj = int(s.rotary == "gptj")
        slot.rotary_dim = s.rotary_dim or spec.head_size
        table = layer.cos_sin if layer.cos_sin is not None else spec.cos_sin
        slot.cos_sin = self._f32(table) if s.rotary != "none" else None
        slot.activation = ACTIVATIONS[s.activation]
        slot.gated = int(s.ffn == "dense")
        slot.parallel_block = int(s.parallel_block)
        slot.residual_scale = s.residual_scale
        slot.attn_scale = float(layer.attention.scale)
        slot.attn_softcap = float(s.attn_logit_softcap or 0.0)
        # An fp8 cache's per-tensor scales (set by the loader before the step is built).
        slot.k_scale = float(getattr(layer.attention.impl, "k_scale", 1.0))
        slot.v_scale = float(getattr(layer.attention.impl, "v_scale", 1.0))
        if layer.activation_constants:
            slot.act_alpha_p, slot.act_alpha_n, slot.act_beta, slot.act_eps = layer.activation_constants

    def _norm(self, weight: torch.Tensor, structure: LayerStructure) -> int:
        """An RMSNorm's weight as applied (offset + w: Gemma's 1 + w), float32."""
        w = weight.detach().float()
        return self._f32(w + structure.norm_offset if structure.norm == "rms" and structure.norm_offset else w)

    def _s8_variant(self, spec: DecoderStackSpec) -> Optional[ctypes.Array]:
        """A copy of the layer structures with every native layer's linears in S8, or None where a
        layer's quantization method keeps no int8 per-channel weights."""
        parts: dict[tuple[int, str], Any] = {}
        for i, layer in enumerate(spec.layers):
            if not self._native[i]:
                continue
            for name in dense_linears(layer):
                linear = getattr(layer, name)
                kept = linear.quant_method.weight_form(linear, PlatformPacked)       # S8Weight, used in place
                found = kept.parts if kept is not None else None
                if not isinstance(found, S8Weight):
                    channels = linear.quant_method.weight_form(linear, Int8Channels)
                    found = pack_s8_weight(channels.q, channels.scale) if channels is not None else None
                if found is None:
                    return None
                parts[i, name] = found
        layers = (NativeLayer * len(spec.layers))()
        for i, slot in enumerate(self._layers):
            layers[i] = NativeLayer.from_buffer_copy(slot)
            if not self._native[i]:
                continue
            for name in dense_linears(spec.layers[i]):
                weight = parts[i, name]
                self._keep.extend(weight.tensors)
                packed = NativeLinear.from_buffer_copy(weight.linear)
                packed.bias = getattr(slot, name).bias
                setattr(layers[i], name, packed)
        return layers

    def _f32(self, t: torch.Tensor) -> int:
        t = t.detach().float().contiguous()
        self._keep.append(t)
        return t.data_ptr()

    def _linear(self, linear: Any, weight_format: str, where: str) -> NativeLinear:
        n, k = linear_shape(linear)
        out = NativeLinear(kind=Q4 if weight_format == "q4" else BF16, n=n, k=k)
        if weight_format == "native":
            kept = linear.quant_method.weight_form(linear, PlatformPacked)
            packed = kept.parts if kept is not None else None
            if packed is None or not isinstance(getattr(packed, "linear", None), NativeLinear):
                raise _Unsupported(f"{where}: its quantization method keeps no single native part "
                                   f"(tiled, float or mixed formats)")
            if (packed.linear.n, packed.linear.k) != (n, k):
                raise _Unsupported(f"{where}: native part is {packed.linear.n} x {packed.linear.k}, not {n} x {k}")
            out = NativeLinear.from_buffer_copy(packed.linear)          # the struct; the bytes stay the method's
            tensors = tuple(packed.tensors)
        elif weight_format == "s8":
            channels = linear.quant_method.weight_form(linear, Int8Channels)
            if channels is None:
                raise _Unsupported(f"{where}: its quantization method keeps no int8 per-channel weights")
            tensors = pack_s8(channels.q, channels.scale)
            out = s8_linear(tensors, n, k)
        elif weight_format == "q4":
            groups = linear.quant_method.weight_form(linear, AffineGroups)
            if groups is None or groups.group_size != 32:
                raise _Unsupported(f"{where}: its quantization method has no 4-bit groups of 32")
            tensors = pack_q4(groups.q, groups.scale, groups.low)
            out.weight, out.scales, out.lows = (t.data_ptr() for t in tensors)
        else:
            prepared = getattr(linear, "prepared", None)       # NativeBf16Linear's packed form, shared
            tensors = (prepared.packed if isinstance(prepared, PackedBf16) else pack_bf16(linear.weight.detach()),)
            out.weight = tensors[0].data_ptr()
        self._keep.extend(tensors)
        if linear.bias is not None:
            out.bias = self._f32(linear.bias)
        return out

    def _refresh_kv_caches(self) -> None:
        # The runner may re-allocate the pool (profiling swaps it, always every layer's at once):
        # pointers are re-read when the first layer's tensor changed.
        if self._attention[0].kv_cache is self._kv_caches[0]:
            return
        for i, attention in enumerate(self._attention):
            cache = attention.kv_cache
            if cache is not self._kv_caches[i]:
                if not cache.is_contiguous():
                    raise RuntimeError("fused_decode needs contiguous KV caches")
                self._kv_caches[i] = cache
                self._layers[i].kv_cache = cache.data_ptr()
                self._model.num_blocks = cache.shape[1]
                if self._batch_model is not None:
                    self._batch_layers[i].kv_cache = cache.data_ptr()
                    self._batch_model.num_blocks = cache.shape[1]

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: Any) -> torch.Tensor:
        """Any few tokens: the native attention takes one query row per "sequence", so a sequence
        with several new tokens (verified drafts, a short prompt chunk) becomes one row per token,
        each with its sequence's block table and its own position + 1 as the context length. All
        rows' K/V are written before any row attends, so row i sees exactly positions <= its own.
        Expert layers' routing lands in their token counters (RoutingNotes)."""
        noted = self._routing_notes.point(input_ids.shape[0])
        out = self._run(input_ids, positions, meta)
        for counter, slot in noted:
            counter.mark(slot)
        return out

    def _run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: Any) -> torch.Tensor:
        self._refresh_kv_caches()
        tokens = input_ids.shape[0]
        ids = input_ids.contiguous()
        pos = positions.contiguous()
        # Without per-group metadata (a model with one group) every layer reads the step's own.
        groups = meta.groups or [meta] * self._num_groups
        decodes_only = meta.num_decodes == tokens      # one token per sequence: rows are the sequences
        rows = None if decodes_only else torch.repeat_interleave((meta.query_start_loc[1:]
                                                                  - meta.query_start_loc[:-1]).long())
        slots, tables = [], []
        for group in groups:
            table = group.block_tables.to(torch.int32)
            tables.append((table if rows is None else table.index_select(0, rows)).contiguous())
            slots.append(group.slot_mapping.contiguous())
        lens = (meta.seq_lens.to(torch.int32) if decodes_only else (pos + 1).to(torch.int32)).contiguous()
        embedded = self._embed(ids).float().contiguous() if self._embed is not None else None
        out = torch.empty((tokens, self._hidden), dtype=self.out_dtype)
        model = self._batch_model if self._batch_model is not None and tokens >= BATCH_ROWS else self._model
        n = len(groups)
        args = NativeStep(ids=ids.data_ptr(), positions=pos.data_ptr(),
                          slots=(ctypes.c_void_p * n)(*(s.data_ptr() for s in slots)),
                          tables=(ctypes.c_void_p * n)(*(t.data_ptr() for t in tables)),
                          table_strides=(ctypes.c_int64 * n)(*(t.shape[1] for t in tables)),
                          lens=lens.data_ptr(), tokens=tokens, out=out.data_ptr(),
                          out_bf16=int(self.out_dtype == torch.bfloat16),
                          embedded=embedded.data_ptr() if embedded is not None else None)
        if len(self._ranges) == 1:                        # every layer native: one call
            args.first_layer, args.last_layer = 0, len(self._native)
            self._lib.fused_decode_step(ctypes.byref(model), ctypes.byref(args))
            return out
        stream = torch.empty((tokens, self._hidden), dtype=torch.float32)
        args.stream = stream.data_ptr()
        if not self._ranges[0][0]:                        # the embedding, natively, before eager layers
            args.first_layer = args.last_layer = 0
            self._lib.fused_decode_step(ctypes.byref(model), ctypes.byref(args))
        for native, first, last in self._ranges:
            if native:
                args.first_layer, args.last_layer = first, last
                self._lib.fused_decode_step(ctypes.byref(model), ctypes.byref(args))
                continue
            hidden, residual = stream.to(self._dtype), None
            for layer in self._eager[first:last]:
                hidden, residual = layer(positions, hidden, residual, meta)
            stream = (hidden + residual).float().contiguous()
            args.stream = stream.data_ptr()
        if not self._ranges[-1][0]:                       # the final norm, natively, after eager layers
            args.first_layer = args.last_layer = len(self._native)
            self._lib.fused_decode_step(ctypes.byref(model), ctypes.byref(args))
        return out


def _dense(table: torch.Tensor) -> bool:
    """Whether `table` holds its own values (not one element expanded to the shape)."""
    return table.is_contiguous() and table.untyped_storage().nbytes() >= table.numel() * table.element_size()
