"""The cpu platform's "fused_decode" graph-capture strategy: a step of a few tokens (decodes,
verified drafts, short prompt chunks: up to MAX_FUSED_TOKENS in all) or of decodes only (up to
MAX_FUSED_DECODES sequences) runs the whole decoder in one native call
(platforms/csrc/cpu_decode_step.cpp) instead of ~45 torch ops per layer; other steps (prompt
chunks) run the eager model.

It asks the model for `decoder_stack()` (platforms/interface.py DecoderStackSpec), re-lays out
the weights once into the kernel's blocks (4-bit groups from the quantization method's
`affine_groups`, or bf16 pairs) or, for weights the quantization method already keeps in this
library's packed form (quantization="gguf": "native"), takes its `native_linear` parts as they
are (no copy; an embedding kept quantized is looked up by the model's own `embed` in torch and
handed in as rows), and calls each layer's attention through the backend's
`native_decode_fn` (attention_backends/interface.py NATIVE_DECODE_ABI). When any of that is
missing — a model without `decoder_stack`, a backend without a native decode, weights in
another form, a CPU without AVX512-VNNI / AVX512-BF16, no compiler — `wrap` says why in the log
and returns the eager forward.

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
from pathlib import Path
from typing import Any, Callable, NamedTuple, Optional

import torch

from .interface import DecoderStackSpec, GraphCapture
from .native_build import NativeLibrary

logger = logging.getLogger("tokenmill.platforms.cpu")

ABI_VERSION = 3
ROWS = 16                  # output rows per weight block (one 512-bit register of float32)
# Any step of up to MAX_FUSED_TOKENS tokens runs fused; a step of one token per sequence (decodes
# only) up to MAX_FUSED_DECODES: its attention reads each context once per row either way, and
# the fused step's GEMMs run at oneDNN's rate from 8 rows up (docs/benchmarks.md) while the eager
# step pays ~30 torch ops a layer around them. Prompt chunks above 32 tokens stay eager: their
# rows attend to each other, which the eager path's flash attention does in one pass.
MAX_FUSED_TOKENS = 32
MAX_FUSED_DECODES = 256
# Under "q4", steps of this many tokens and more run S8 (int8 per-channel weights, 2 blocks x 6
# tokens a tile): 3072 x 576 at 8 rows 934 vs 728 GOP/s for Q4, at 64 rows 1290 vs 816 (bf16
# 818); at 4 rows Q4 still wins (718 vs 649), its weights being a quarter of the bytes.
BATCH_ROWS = 8
Q4, BF16, Q8, S8 = 0, 1, 2, 5


class _Linear(ctypes.Structure):
    _fields_ = [("kind", ctypes.c_int64), ("n", ctypes.c_int64), ("k", ctypes.c_int64),
                ("weight", ctypes.c_void_p), ("scales", ctypes.c_void_p), ("lows", ctypes.c_void_p),
                ("bias", ctypes.c_void_p)]


class _Layer(ctypes.Structure):
    _fields_ = [("input_norm", ctypes.c_void_p), ("post_norm", ctypes.c_void_p), ("q_norm", ctypes.c_void_p),
                ("k_norm", ctypes.c_void_p), ("qkv", _Linear), ("o", _Linear), ("gate_up", _Linear),
                ("down", _Linear), ("kv_cache", ctypes.c_void_p), ("window", ctypes.c_int64)]


class _Model(ctypes.Structure):
    _fields_ = [(name, ctypes.c_int64) for name in ("num_layers", "hidden", "intermediate", "num_heads",
                                                    "num_kv_heads", "head_size", "num_blocks", "block_size")] + [
        ("eps", ctypes.c_float), ("attn_scale", ctypes.c_float), ("embedding", ctypes.c_void_p),
        ("embedding_bf16", ctypes.c_int64), ("final_norm", ctypes.c_void_p), ("cos_sin", ctypes.c_void_p),
        ("layers", ctypes.POINTER(_Layer)), ("attend", ctypes.c_void_p)]


def _declare(lib: ctypes.CDLL) -> None:
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    lib.fused_decode_caps.restype = i64
    lib.fused_decode_caps.argtypes = []
    lib.fused_decode_step.restype = None
    lib.fused_decode_step.argtypes = [ctypes.POINTER(_Model), p, p, p, p, i64, p, i64, p, i64, p]
    lib.vnni_peak_loop.restype = i64
    lib.vnni_peak_loop.argtypes = [i64]
    lib.fused_matmul.restype = None
    lib.fused_matmul.argtypes = [ctypes.POINTER(_Linear), p, i64, p]


LIBRARY = NativeLibrary(Path(__file__).with_name("csrc") / "cpu_decode_step.cpp", ABI_VERSION, _declare)


def vnni_peak_gops(iterations: int = 2_000_000) -> float:
    """Measured int8 peak of this CPU's AVX512-VNNI units over the intra-op threads, in GOP/s
    (a multiply-add counts 2): register-only dot products, no memory traffic."""
    import time

    lib = LIBRARY.require()
    lib.vnni_peak_loop(iterations // 20)                  # wake the threads, settle the clock
    start = time.perf_counter()
    threads = lib.vnni_peak_loop(iterations)
    return 2 * 64 * 16 * iterations * threads / (time.perf_counter() - start) / 1e9


def pack_q4(q: torch.Tensor, scale: torch.Tensor, low: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q uint8 [N, K] in 0..15, scale/low [N, K/32]) -> the kernel's blocks: nibbles
    [N/16, K/32, 4, 16, 4] (vector j: chunk 2j low, 2j + 1 high), scales/lows fp16 [N/16, K/32, 16]."""
    n, k = q.shape
    chunks = q.reshape(n // ROWS, ROWS, k // 32, 4, 2, 4)              # block, row, group, j, lo/hi, byte
    nibbles = (chunks[..., 0, :] | (chunks[..., 1, :] << 4)).permute(0, 2, 3, 1, 4).contiguous()
    def blocked(t: torch.Tensor) -> torch.Tensor:
        return t.reshape(n // ROWS, ROWS, k // 32).permute(0, 2, 1).to(torch.float16).contiguous()
    return nibbles, blocked(scale), blocked(low)


def pack_q8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """weight [N, K] -> int8 per group of 32 inputs: w8 [N/16, K/32, 8, 16, 4], scales fp16
    [N/16, K/32, 16] and the u8-operand correction 128 * scale * sum(w8), float32, same shape."""
    n, k = weight.shape
    groups = weight.detach().float().reshape(n, k // 32, 32)
    scale = (groups.abs().amax(dim=-1) / 127).to(torch.float16).float()
    w8 = torch.round(groups / torch.where(scale > 0, scale, torch.ones_like(scale)).unsqueeze(-1)).clamp_(-127, 127)
    corr = 128 * scale * w8.sum(dim=-1)
    packed = w8.to(torch.int8).reshape(n // ROWS, ROWS, k // 32, 8, 4).permute(0, 2, 3, 1, 4).contiguous()
    def blocked(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return t.reshape(n // ROWS, ROWS, k // 32).permute(0, 2, 1).to(dtype).contiguous()
    return packed, blocked(scale, torch.float16), blocked(corr, torch.float32)


def pack_s8(q: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(int8 [N, K], float scale [N]: w = scale[n] * q[n, k]) -> the kernel's S8 parts: q as
    [N/16, K/4, 16, 4], the scales float32 [N], and per group of 32 inputs the int32
    -128 * sum(q) of each row, [N/16, K/32, 16] (it cancels the u8 activation's +128)."""
    n, k = q.shape
    packed = q.reshape(n // ROWS, ROWS, k // 4, 4).permute(0, 2, 1, 3).contiguous()
    corr = (-128 * q.to(torch.int32).reshape(n, k // 32, 32).sum(dim=-1)).to(torch.int32)
    corr = corr.reshape(n // ROWS, ROWS, k // 32).permute(0, 2, 1).contiguous()
    return packed, scale.float().contiguous(), corr


def s8_linear(tensors: tuple[torch.Tensor, torch.Tensor, torch.Tensor], n: int, k: int) -> "_Linear":
    return _Linear(kind=S8, n=n, k=k, weight=tensors[0].data_ptr(), scales=tensors[1].data_ptr(),
                   lows=tensors[2].data_ptr())


class S8Weight(NamedTuple):
    """A weight in S8, as the int4 method keeps it for batches (quantization_kernels "pack_s8"):
    the structure the native matmul reads and the tensors it points into."""
    linear: _Linear
    tensors: tuple[torch.Tensor, ...]


def pack_s8_weight(q: torch.Tensor, scale: torch.Tensor) -> Optional[S8Weight]:
    """int8 [N, K] with float scales [N] -> S8Weight; None for shapes outside its blocks."""
    n, k = q.shape
    if n % ROWS or k % 32:
        return None
    tensors = pack_s8(q, scale)
    return S8Weight(s8_linear(tensors, n, k), tensors)


def matmul_s8(x: torch.Tensor, weight: S8Weight, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """x [M, K] float32 times an S8Weight -> float32 [M, N] (+ bias): activations quantized to
    int8 per 32 inputs, int8 x int8 dot products, one native call (threads over row blocks)."""
    x = x.float().contiguous()
    y = torch.empty((x.shape[0], weight.linear.n), dtype=torch.float32)
    LIBRARY.require().fused_matmul(ctypes.byref(weight.linear), x.data_ptr(), x.shape[0], y.data_ptr())
    return y.add_(bias) if bias is not None else y


class NativeHeadKernel:
    """The LM head of a decode step as a layer kernel ("lm_head", core/layers/kernels.py), one
    native call: under quantization="int4" ("q8") int8 weights per group of 32 (28 MB for
    SmolLM2's 49152 x 576 head, like the file's Q8_0) times activations quantized per 32 inputs
    (the per-token int8 GEMM with its outlier channels spent ~1 ms a step at one row gathering
    the outlier rows alone); under dtype=bfloat16 ("bf16") the bf16 weight in the fused step's
    pair layout. Inputs it does not take (more than `max_rows` rows: prompt logprobs, large q8
    decode batches, where the int8 GEMM does better; shapes outside its blocks) return
    NotImplemented, and the layer runs its own method. The bf16 head takes whole decode batches:
    at 64 rows it measured 8.3 ms against oneDNN's 9.7 (2 threads, 49152 x 576), and its float32
    logits need no conversion before sampling."""
    name = "native_head"

    def __init__(self, weight_format: str) -> None:
        if weight_format not in ("q8", "bf16"):
            raise ValueError(f"native head format must be 'q8' or 'bf16', got {weight_format!r}")
        self.weight_format = weight_format
        self.max_rows = 16 if weight_format == "q8" else 256

    @staticmethod
    def available(weight_format: str = "q8") -> Optional[str]:
        lib, why = LIBRARY.load()
        if lib is None:
            return why
        need, what = (1, "AVX512-VNNI") if weight_format == "q8" else (2, "AVX512-BF16")
        return None if lib.fused_decode_caps() & need else f"this CPU has no {what}"

    def prepare(self, weight: torch.Tensor) -> Any:
        n, k = weight.shape
        if n % ROWS or k % 32:
            return None, ()
        if self.weight_format == "q8":
            tensors = pack_q8(weight)
            linear = _Linear(kind=Q8, n=n, k=k, weight=tensors[0].data_ptr(), scales=tensors[1].data_ptr(),
                             lows=tensors[2].data_ptr(), bias=None)
        else:
            tensors = (pack_bf16(weight.detach()),)
            linear = _Linear(kind=BF16, n=n, k=k, weight=tensors[0].data_ptr())
        return linear, tensors

    def __call__(self, x: torch.Tensor, prepared: Any, bias: Optional[torch.Tensor]) -> Any:
        linear, _ = prepared
        if (linear is None or x.dim() != 2 or bias is not None or x.shape[0] > self.max_rows
                or x.dtype not in ((torch.float32,) if self.weight_format == "q8" else (torch.float32, torch.bfloat16))):
            return NotImplemented
        x = x.float().contiguous()
        y = torch.empty((x.shape[0], linear.n), dtype=torch.float32)
        LIBRARY.require().fused_matmul(ctypes.byref(linear), x.data_ptr(), x.shape[0], y.data_ptr())
        return y


def pack_bf16(weight: torch.Tensor) -> torch.Tensor:
    """weight [N, K] -> bf16 pairs [N/16, K/2, 16, 2]."""
    n, k = weight.shape
    return weight.to(torch.bfloat16).reshape(n // ROWS, ROWS, k // 2, 2).permute(0, 2, 1, 3).contiguous()


# native: the quantization method's packed parts as they are; s8: its int8 per-channel weights.
WEIGHT_FORMATS = ("q4", "bf16", "native", "s8")


class FusedDecodeCapture(GraphCapture):
    name = "fused_decode"
    attention_mode = "none"     # the backend runs eagerly or through its native entry, never traced

    def __init__(self, weight_format: str) -> None:
        if weight_format not in WEIGHT_FORMATS:
            raise ValueError(f"fused_decode weight format must be one of {WEIGHT_FORMATS}, got {weight_format!r}")
        self.weight_format = weight_format

    def wrap(self, forward: Callable[..., torch.Tensor], runner: Any) -> Callable[..., torch.Tensor]:
        why = self.unavailable(runner)
        if why:
            logger.info("fused_decode: running the model eagerly: %s", why)
            return forward
        try:
            step = _FusedStep(self._spec, runner.layers, self.weight_format, runner.num_blocks,
                              runner.block_size)
        except _Unsupported as e:
            logger.info("fused_decode: running the model eagerly: %s", e)
            return forward
        logger.info("fused_decode: steps of up to %d tokens (%d decodes) run as one native call (%s)",
                    MAX_FUSED_TOKENS, MAX_FUSED_DECODES,
                    "the quantization method's packed weights in place" if self.weight_format == "native"
                    else f"{self.weight_format} weights")

        def fused_or_eager(input_ids: torch.Tensor, positions: torch.Tensor, meta: Any) -> torch.Tensor:
            tokens = input_ids.shape[0]
            if tokens <= MAX_FUSED_TOKENS or (tokens <= MAX_FUSED_DECODES and meta.num_decodes == tokens):
                return step(input_ids, positions, meta)
            return forward(input_ids, positions, meta)

        fused_or_eager.fused_step = step        # for tests and profiling
        return fused_or_eager

    def unavailable(self, runner: Any) -> Optional[str]:
        """Why the fused step cannot run this model here, or None."""
        parallel = getattr(getattr(runner, "config", None), "parallel", None)
        if parallel is not None and parallel.tensor_parallel_size * parallel.pipeline_parallel_size > 1:
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
        if not hasattr(runner.model, "decoder_stack"):
            return f"{type(runner.model).__name__} offers no decoder_stack()"
        spec: DecoderStackSpec = runner.model.decoder_stack()
        self._spec = spec             # what wrap() packs
        if spec.head_size % 2 or spec.hidden_size % 32 or spec.intermediate_size % 32:
            return "hidden, intermediate and head sizes must be multiples of 32 (head size even)"
        for i, layer in enumerate(spec.layers):
            impl = layer.attention.impl
            if impl.native_decode_fn(layer.attention.kv_cache) is None:
                return f"attention backend {impl.name!r} has no native decode for this cache"
            for name in ("qkv", "o", "gate_up", "down"):
                shape = tuple(getattr(layer, name).weight.shape)
                if shape[0] % ROWS or shape[1] % 32:
                    return f"layer {i} {name}: {shape} is not in blocks of 16 x 32"
        return None


class _Unsupported(Exception):
    """A layer's weights are not in a form the fused step reads."""


class _FusedStep:
    """The packed weights and the ctypes structures of one model; called per decode step."""

    def __init__(self, spec: DecoderStackSpec, attention_layers: list, weight_format: str, num_blocks: int,
                 block_size: int) -> None:
        self._lib = LIBRARY.require()
        self._keep: list[torch.Tensor] = []          # everything the structures point into
        self._attention = attention_layers
        self._layers = (_Layer * len(spec.layers))()
        for i, (slot, layer) in enumerate(zip(self._layers, spec.layers)):
            slot.input_norm, slot.post_norm = self._f32(layer.input_norm), self._f32(layer.post_norm)
            slot.q_norm = self._f32(layer.q_norm) if layer.q_norm is not None else None
            slot.k_norm = self._f32(layer.k_norm) if layer.k_norm is not None else None
            for name in ("qkv", "o", "gate_up", "down"):
                setattr(slot, name, self._linear(getattr(layer, name), weight_format, f"layer {i} {name}"))
            slot.window = int(layer.attention.sliding_window or 0)
        # Batches (BATCH_ROWS tokens and more) under "q4": the same layers over the method's int8
        # per-channel weights (what its own eager matmuls take for batches) in S8.
        self._batch_layers = self._s8_variant(spec) if weight_format == "q4" else None
        self._kv_caches: list[Optional[torch.Tensor]] = [None] * len(spec.layers)
        attn = spec.layers[0].attention
        embedding = spec.embedding.detach()
        self.out_dtype = embedding.dtype if embedding.dtype == torch.bfloat16 else torch.float32
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
        self._model = _Model(
            num_layers=len(spec.layers), hidden=spec.hidden_size, intermediate=spec.intermediate_size,
            num_heads=spec.num_heads, num_kv_heads=spec.num_kv_heads, head_size=spec.head_size,
            num_blocks=num_blocks, block_size=block_size, eps=spec.eps, attn_scale=float(attn.scale),
            embedding=embedding.data_ptr(), embedding_bf16=int(embedding.dtype == torch.bfloat16),
            final_norm=self._f32(spec.final_norm), cos_sin=self._f32(spec.cos_sin), layers=self._layers,
            attend=attn.impl.native_decode_fn(attn.kv_cache))
        self._batch_model = None
        if self._batch_layers is not None:
            self._batch_model = _Model.from_buffer_copy(self._model)
            self._batch_model.layers = self._batch_layers
        self._hidden = spec.hidden_size

    def _s8_variant(self, spec: DecoderStackSpec) -> Optional[ctypes.Array]:
        """A copy of the layer structures with every linear in S8, or None where a layer's
        quantization method keeps no int8 per-channel weights."""
        parts = []
        for layer in spec.layers:
            for name in ("qkv", "o", "gate_up", "down"):
                linear = getattr(layer, name)
                kept = getattr(linear.quant_method, "batch_weight", None)       # S8Weight, used in place
                found = kept(linear) if kept is not None else None
                if not isinstance(found, S8Weight):
                    channels = getattr(linear.quant_method, "int8_channels", None)
                    found = channels(linear) if channels is not None else None
                    found = pack_s8_weight(*found) if found is not None else None
                if found is None:
                    return None
                parts.append(found)
        layers = (_Layer * len(spec.layers))()
        for i, slot in enumerate(self._layers):
            layers[i] = _Layer.from_buffer_copy(slot)
            for j, name in enumerate(("qkv", "o", "gate_up", "down")):
                weight = parts[4 * i + j]
                self._keep.extend(weight.tensors)
                packed = _Linear.from_buffer_copy(weight.linear)
                packed.bias = getattr(slot, name).bias
                setattr(layers[i], name, packed)
        return layers

    def _f32(self, t: torch.Tensor) -> int:
        t = t.detach().float().contiguous()
        self._keep.append(t)
        return t.data_ptr()

    def _linear(self, linear: Any, weight_format: str, where: str) -> _Linear:
        n, k = linear.weight.shape
        out = _Linear(kind=Q4 if weight_format == "q4" else BF16, n=n, k=k)
        if weight_format == "native":
            native = getattr(linear.quant_method, "native_linear", None)
            packed = native(linear) if native is not None else None
            if packed is None or not isinstance(getattr(packed, "linear", None), _Linear):
                raise _Unsupported(f"{where}: its quantization method keeps no single native part "
                                   f"(tiled, float or mixed formats)")
            if (packed.linear.n, packed.linear.k) != (n, k):
                raise _Unsupported(f"{where}: native part is {packed.linear.n} x {packed.linear.k}, not {n} x {k}")
            out = _Linear.from_buffer_copy(packed.linear)          # the struct; the bytes stay the method's
            tensors = tuple(packed.tensors)
        elif weight_format == "s8":
            channels = getattr(linear.quant_method, "int8_channels", None)
            found = channels(linear) if channels is not None else None
            if found is None:
                raise _Unsupported(f"{where}: its quantization method keeps no int8 per-channel weights")
            tensors = pack_s8(*found)
            out = s8_linear(tensors, n, k)
        elif weight_format == "q4":
            groups = linear.quant_method.affine_groups(linear)
            if groups is None or groups[3] != 32:
                raise _Unsupported(f"{where}: its quantization method has no 4-bit groups of 32")
            tensors = pack_q4(*groups[:3])
            out.weight, out.scales, out.lows = (t.data_ptr() for t in tensors)
        else:
            tensors = (pack_bf16(linear.weight.detach()),)
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
        rows' K/V are written before any row attends, so row i sees exactly positions <= its own."""
        self._refresh_kv_caches()
        tokens = input_ids.shape[0]
        ids = input_ids.contiguous()
        pos = positions.contiguous()
        slots = meta.slot_mapping.contiguous()
        tables = meta.block_tables if meta.block_tables.dtype == torch.int32 else meta.block_tables.to(torch.int32)
        if meta.num_decodes == tokens:            # one token per sequence: rows are the sequences
            lens = meta.seq_lens.to(torch.int32)
        else:
            query_lens = meta.query_start_loc[1:] - meta.query_start_loc[:-1]
            tables = tables.index_select(0, torch.repeat_interleave(query_lens.long()))
            lens = (pos + 1).to(torch.int32)
        tables = tables.contiguous()
        lens = lens.contiguous()
        embedded = None
        if self._embed is not None:
            embedded = self._embed(ids).float().contiguous()
        out = torch.empty((tokens, self._hidden), dtype=self.out_dtype)
        model = self._batch_model if self._batch_model is not None and tokens >= BATCH_ROWS else self._model
        self._lib.fused_decode_step(ctypes.byref(model), ids.data_ptr(), pos.data_ptr(), slots.data_ptr(),
                                    tables.data_ptr(), tables.shape[1], lens.data_ptr(), tokens, out.data_ptr(),
                                    int(self.out_dtype == torch.bfloat16),
                                    embedded.data_ptr() if embedded is not None else None)
        return out


def _dense(table: torch.Tensor) -> bool:
    """Whether `table` holds its own values (not one element expanded to the shape)."""
    return table.is_contiguous() and table.untyped_storage().nbytes() >= table.numel() * table.element_size()
