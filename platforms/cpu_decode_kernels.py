"""The cpu platform's native decode library (platforms/csrc/cpu_decode_step.cpp) seen from Python:
its ctypes structures, the weight layouts its matmuls read (Q4 x Q8 groups, Q8 groups, bf16 pairs,
S8 int8 per-channel) and the entries other modules call on their own: `matmul_s8` (the int4
method's batches), `NativeHeadKernel` (the LM head of decode steps), `vnni_peak_gops`. The whole
decoder step built on them is platforms/cpu_fused_decode.py.
"""
from __future__ import annotations

import ctypes
from typing import Any, NamedTuple, Optional

import torch

from .native_build import NativeLibrary, source

ABI_VERSION = 8
ROWS = 16                  # output rows per weight block (one 512-bit register of float32)
Q4, BF16, Q8, S8 = 0, 1, 2, 5


class NativeLinear(ctypes.Structure):
    _fields_ = [("kind", ctypes.c_int64), ("n", ctypes.c_int64), ("k", ctypes.c_int64),
                ("weight", ctypes.c_void_p), ("scales", ctypes.c_void_p), ("lows", ctypes.c_void_p),
                ("bias", ctypes.c_void_p)]


_P, _I, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float


class NativeLayer(ctypes.Structure):
    """platforms/csrc/cpu_decode_step.cpp FusedLayer: one layer in the layer vocabulary."""
    _fields_ = ([(name, _P) for name in ("input_norm", "post_norm", "attn_out_norm", "ffn_out_norm",
                                         "input_norm_bias", "post_norm_bias", "attn_out_norm_bias",
                                         "ffn_out_norm_bias", "q_norm", "k_norm")]
                + [(name, NativeLinear) for name in ("qkv", "o", "gate_up", "down")]
                + [("kv_cache", _P), ("cos_sin", _P)]
                + [(name, _I) for name in ("window", "group", "norm_kind", "qk_norm", "rope_gptj", "rotary_dim",
                                           "activation", "gated", "parallel_block")]
                + [(name, _F) for name in ("residual_scale", "attn_scale", "k_scale", "v_scale", "act_alpha_p",
                                           "act_alpha_n", "act_beta", "act_eps", "attn_softcap")]
                + [("moe", _P)])       # FusedMoeFfn (platforms/cpu_fused_moe.py) or null


class NativeModel(ctypes.Structure):
    _fields_ = [(name, _I) for name in ("num_layers", "hidden", "intermediate", "num_heads",
                                        "num_kv_heads", "head_size", "num_blocks", "block_size")] + [
        ("eps", _F), ("embedding_scale", _F), ("embedding", _P), ("embedding_bf16", _I), ("final_norm", _P),
        ("final_norm_bias", _P), ("final_norm_kind", _I), ("layers", ctypes.POINTER(NativeLayer)),
        ("attend", _P)]


class NativeStep(ctypes.Structure):
    """FusedStep: one call's rows and layer range; slots / tables / table_strides one per KV group."""
    _fields_ = [("ids", _P), ("positions", _P), ("slots", ctypes.POINTER(_P)), ("tables", ctypes.POINTER(_P)),
                ("table_strides", ctypes.POINTER(_I)), ("lens", _P), ("tokens", _I), ("first_layer", _I),
                ("last_layer", _I), ("stream", _P), ("embedded", _P), ("out", _P), ("out_bf16", _I)]


def _declare(lib: ctypes.CDLL) -> None:
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    lib.fused_decode_caps.restype = i64
    lib.fused_decode_caps.argtypes = []
    lib.fused_decode_step.restype = None
    lib.fused_decode_step.argtypes = [ctypes.POINTER(NativeModel), ctypes.POINTER(NativeStep)]
    lib.vnni_peak_loop.restype = i64
    lib.vnni_peak_loop.argtypes = [i64]
    lib.fused_matmul.restype = None
    lib.fused_matmul.argtypes = [ctypes.POINTER(NativeLinear), p, i64, p]
    lib.bf16_linear.restype = i64
    lib.bf16_linear.argtypes = [ctypes.POINTER(NativeLinear), p, i64, p, p]


LIBRARY = NativeLibrary(source("cpu_decode_step.cpp"), ABI_VERSION, _declare)


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


def s8_linear(tensors: tuple[torch.Tensor, torch.Tensor, torch.Tensor], n: int, k: int) -> "NativeLinear":
    return NativeLinear(kind=S8, n=n, k=k, weight=tensors[0].data_ptr(), scales=tensors[1].data_ptr(),
                   lows=tensors[2].data_ptr())


class S8Weight(NamedTuple):
    """A weight in S8, as the int4 method keeps it for batches (quantization_kernels "pack_s8"):
    the structure the native matmul reads and the tensors it points into."""
    linear: NativeLinear
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
    (the per-token int8 GEMM with its outlier channels spent more time gathering the outlier
    rows than multiplying at one row); under dtype=bfloat16 ("bf16") the bf16 weight in the fused step's
    pair layout. Inputs it does not take (more than `max_rows` rows: prompt logprobs, large q8
    decode batches, where the int8 GEMM does better; shapes outside its blocks) return
    NotImplemented, and the layer runs its own method. The bf16 head takes whole decode batches
    (it keeps up with oneDNN at 64 rows), and its float32 logits need no conversion before
    sampling."""
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
            linear = NativeLinear(kind=Q8, n=n, k=k, weight=tensors[0].data_ptr(), scales=tensors[1].data_ptr(),
                             lows=tensors[2].data_ptr(), bias=None)
        else:
            form = packed_bf16(weight)
            linear, tensors = form.linear, (form.packed,)
        return linear, tensors

    def __call__(self, x: torch.Tensor, prepared: Any, bias: Optional[torch.Tensor]) -> Any:
        linear, _ = prepared
        if (linear is None or x.dim() != 2 or bias is not None or x.shape[0] > self.max_rows
                or x.dtype not in ((torch.float32,) if self.weight_format == "q8"
                                   else (torch.float32, torch.bfloat16))):
            return NotImplemented
        x = x.float().contiguous()
        y = torch.empty((x.shape[0], linear.n), dtype=torch.float32)
        LIBRARY.require().fused_matmul(ctypes.byref(linear), x.data_ptr(), x.shape[0], y.data_ptr())
        return y


class PackedBf16(NamedTuple):
    """A dense weight in the BF16 pair layout (pack_bf16), as NativeBf16Linear prepares it; the
    fused decode step reads the same bytes (platforms/cpu_fused_decode.py)."""
    linear: NativeLinear
    packed: torch.Tensor


def packed_bf16(weight: torch.Tensor) -> PackedBf16:
    """weight [N, K] (N in blocks of 16, K of 32) in the BF16 pair layout with its structure."""
    n, k = weight.shape
    packed = pack_bf16(weight.detach())
    return PackedBf16(NativeLinear(kind=BF16, n=n, k=k, weight=packed.data_ptr()), packed)


class NativeBf16Linear:
    """The dense linears of the eager path under dtype=bfloat16 ("linear", core/layers/kernels.py)
    on AMX tiles, the fused step's bf16 matmul (platforms/csrc/cpu_decode_step.cpp bf16_linear):
    it beats oneDNN on short batches, ties around 512 rows and loses on long ones, so steps of
    more than `max_rows` rows (long prompt chunks) stay with oneDNN. Inputs it does not take (not
    bf16, shapes outside its blocks) return NotImplemented: the layer's own method runs."""
    name = "native_bf16"

    def __init__(self, max_rows: int = 256) -> None:
        self.max_rows = max_rows

    @staticmethod
    def available() -> Optional[str]:
        lib, why = LIBRARY.load()
        if lib is None:
            return why
        return None if lib.fused_decode_caps() & 4 else "this CPU (or the build) has no AMX-BF16 tiles"

    def prepare(self, weight: torch.Tensor) -> Optional[PackedBf16]:
        n, k = weight.shape
        if n % ROWS or k % 32 or weight.dtype != torch.bfloat16:
            return None
        return packed_bf16(weight)

    def __call__(self, x: torch.Tensor, prepared: Optional[PackedBf16], bias: Optional[torch.Tensor]) -> torch.Tensor:
        if prepared is None or x.dtype != torch.bfloat16 or x.shape[-1] != prepared.linear.k:
            return NotImplemented
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        if x2.shape[0] > self.max_rows:
            return NotImplemented
        x2 = x2.contiguous()
        y = torch.empty((x2.shape[0], prepared.linear.n), dtype=torch.bfloat16)
        b = bias.float().contiguous() if bias is not None else None
        if x2.shape[0] and not LIBRARY.require().bf16_linear(ctypes.byref(prepared.linear), x2.data_ptr(), x2.shape[0],
                                                             b.data_ptr() if b is not None else None, y.data_ptr()):
            return NotImplemented
        return y.view(*shape[:-1], prepared.linear.n)


def pack_bf16(weight: torch.Tensor) -> torch.Tensor:
    """weight [N, K] -> bf16 pairs [N/16, K/2, 16, 2]."""
    n, k = weight.shape
    return weight.to(torch.bfloat16).reshape(n // ROWS, ROWS, k // 2, 2).permute(0, 2, 1, 3).contiguous()
