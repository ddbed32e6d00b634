"""The CPU platform: always available; KV pool sized from a RAM budget."""
from __future__ import annotations

import functools
import logging
import os
import time
from typing import Callable

import torch

from tokenmill.quantization.interface import QuantKernels

from .interface import (Availability, DecodeProgram, LayerKernels, MemoryProfiler, Platform, blocks_from_budget,
                        resolve_dtype)

logger = logging.getLogger("tokenmill.platforms.cpu")

DEFAULT_KV_SHARE = 0.25          # of available RAM, when kv_cache_memory is not given
DEFAULT_KV_CAP = 4 << 30         # vLLM's CPU default (VLLM_CPU_KVCACHE_SPACE=4 GiB)


def available_ram_bytes() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


def cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def cpu_has_fast_bf16() -> bool:
    flags = cpu_flags()
    return "avx512_bf16" in flags or "amx_bf16" in flags


def cpu_has_amx() -> bool:
    return "amx_bf16" in cpu_flags()


@functools.lru_cache(maxsize=None)
def bf16_gemm_is_faster(threads: int) -> bool:
    """Whether oneDNN's bf16 GEMM beats its fp32 one here, measured once per process (a few tens
    of ms; asked only when bf16 is requested: a float32 or quantized run never pays it).

    The flags do not tell: AMX always wins, and with AVX512_BF16 alone bf16 has come out well
    behind fp32 on one CPU family and several times ahead on another (2048x576 @ 576x1536). bf16
    then runs activations, the KV cache and large GEMMs too."""
    if cpu_has_amx():
        return True
    if "avx512_bf16" not in cpu_flags():
        return False
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        seconds = {}
        for dtype in (torch.float32, torch.bfloat16):
            x, w = torch.ones(512, 576, dtype=dtype), torch.ones(1536, 576, dtype=dtype)
            torch.nn.functional.linear(x, w)                     # oneDNN's first call builds its kernel
            start = time.perf_counter()
            for _ in range(4):
                torch.nn.functional.linear(x, w)
            seconds[dtype] = time.perf_counter() - start
    finally:
        torch.set_num_threads(previous)
    return seconds[torch.bfloat16] < 0.8 * seconds[torch.float32]


class CpuMemoryProfiler(MemoryProfiler):
    def __init__(self, available_bytes: Callable[[], int] = available_ram_bytes) -> None:
        self._available_bytes = available_bytes

    def budget_bytes(self, kv_cache_memory: int | None) -> int:
        if kv_cache_memory is not None:
            return kv_cache_memory
        return min(DEFAULT_KV_CAP, int(self._available_bytes() * DEFAULT_KV_SHARE))

    def num_kv_blocks(self, config, bytes_per_block, profile_forward):
        return blocks_from_budget(self.budget_bytes(config.cache.kv_cache_memory), bytes_per_block)


class TorchCompileProgram(DecodeProgram):
    name = "torch.compile"

    def build(self, forward, model):
        return torch.compile(forward, dynamic=True)


class CpuPlatform(Platform):
    name = "cpu"
    torch_device = "cpu"
    priority = 0
    dispatch_key = "cpu"

    @classmethod
    def probe(cls) -> Availability:
        return Availability.yes(f"{os.cpu_count()} cores")

    def attention_backends(self) -> list[str]:
        return ["cpu_sdpa", "cpu_mla", "reference"]     # cpu_mla: multi-head latent attention only

    def memory_profiler(self) -> MemoryProfiler:
        return CpuMemoryProfiler()

    def decode_programs(self) -> list[str]:
        return ["fused_decode", "none", "torch.compile"]

    def decode_program(self, config) -> DecodeProgram:
        """Default: "fused_decode" (decode steps as one native call, platforms/cpu_fused_decode.py)
        for quantization="int4", "gguf" (its natively packed GGUF parts, multiplied in place: the
        same kernels and int8 activations as its eager matmuls), "int8" (its int8 per-channel
        weights in S8, activations per 32 inputs instead of per token) and dtype bfloat16; float32 stays
        eager, token-identical to transformers. enforce_eager or TOKENMILL_CPU_KERNELS=0: eager.
        Where the step cannot take a model (tiled GGUF formats, no VNNI, ...) it says why in the
        log and the model runs eagerly."""
        from .cpu_fused_decode import FusedDecodeProgram
        from .native_build import disabled

        choice = config.device.graph_capture
        quantization = config.model.quantization
        weight_format = ("q4" if quantization == "int4" else "native" if quantization == "gguf"
                         else "s8" if quantization == "int8"
                         else "bf16" if config.model.dtype == "bfloat16" and not quantization else None)
        if config.device.enforce_eager or choice == "none":
            return DecodeProgram()
        if choice is None:
            return FusedDecodeProgram(weight_format) if weight_format and not disabled() else DecodeProgram()
        if choice == "torch.compile":
            return TorchCompileProgram()
        if choice == "fused_decode":
            if weight_format is None:
                raise ValueError("graph_capture 'fused_decode' needs quantization 'int4', 'gguf' or 'int8' "
                                 "or dtype 'bfloat16' on the cpu platform "
                                 "(float32 runs eagerly, matching transformers)")
            return FusedDecodeProgram(weight_format)
        raise ValueError(f"graph_capture {choice!r} is not offered by the cpu platform "
                         f"(offers {self.decode_programs()})")

    def distributed_backend(self) -> str:
        return "gloo"

    def zeros(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """Through calloc (numpy's zeros): the kernel hands out zero pages as they are first
        touched, so a 4 GiB KV pool costs nothing at start-up (torch.zeros writes every byte, seconds
        of start-up) and only the blocks in use ever take RAM."""
        import numpy as np

        count = 1
        for size in shape:
            count *= size
        element = torch.empty((), dtype=dtype).element_size()
        raw = torch.from_numpy(np.zeros(count * element, dtype=np.uint8))
        _advise_huge_pages(raw.data_ptr(), raw.numel())
        return raw.view(dtype).view(shape)

    def activation_dtype(self, dtype: torch.dtype) -> torch.dtype:
        # Where bf16 GEMMs are slower than fp32 (measured, bf16_gemm_is_faster), bf16 pays only
        # where memory bandwidth binds (reading weights); activations, the KV cache and large
        # GEMMs then stay in fp32.
        if dtype == torch.bfloat16 and not bf16_gemm_is_faster(torch.get_num_threads()):
            return torch.float32
        return dtype

    def layer_kernels(self, config) -> LayerKernels:
        """The per-op kernels (_op_kernels) and, where the experts' weights are in a form it
        multiplies (int4 / int8 experts, bf16 weights), the native mixture-of-experts op
        (platforms/cpu_moe.py); the native Gated DeltaNet decode step (platforms/cpu_recurrent.py)
        where it builds."""
        from .cpu_linear import Bf16WeightLinear
        from .cpu_moe import moe_kernel
        from .cpu_recurrent import gated_delta_rule_kernel

        kernels = self._op_kernels(config)
        if kernels.moe is None:
            kernels.moe = moe_kernel(config.model.quantization, config.model.dtype,
                                     round_weights=isinstance(kernels.linear, Bf16WeightLinear))
        if kernels.gated_delta_rule is None:
            kernels.gated_delta_rule = gated_delta_rule_kernel()
        return kernels

    def _op_kernels(self, config) -> LayerKernels:
        """quantization="int4": the fused native norm/rope/SiLU kernels (platforms/cpu_layer_kernels.py)
        when they build here (they agree with torch only to rounding, so only where exact parity
        with transformers is not promised) and the native int8 LM head for decode steps
        (NativeHeadKernel). bf16 activations: the same norm/rope/SiLU kernels in bf16 and, with
        fused_decode, the native bf16 LM head for decode steps, and where AMX exists the eager
        steps' smaller dense matmuls on its tiles (NativeBf16Linear). bf16 weights with fp32 activations
        (a CPU whose bf16 GEMMs lose): bf16 weights times fp32 activations for every dense matmul
        (Bf16WeightLinear), unless TOKENMILL_CPU_PACKED_LINEAR=0."""
        from . import cpu_kernels
        from .cpu_layer_kernels import native_layer_kernels
        from .cpu_decode_kernels import NativeBf16Linear, NativeHeadKernel
        from .cpu_fused_decode import FusedDecodeProgram
        from .cpu_linear import Bf16WeightLinear

        if config.model.quantization == "gguf":
            # Weights stay in GGUF blocks (quantization/gguf_linear.py): no dense-weight kernels.
            return native_layer_kernels() if cpu_kernels.available() is None else LayerKernels()
        fused = isinstance(self.decode_program(config), FusedDecodeProgram)
        if config.model.quantization == "int4":
            kernels = native_layer_kernels() if cpu_kernels.available() is None else LayerKernels()
            if NativeHeadKernel.available("q8") is None:
                kernels.lm_head = NativeHeadKernel("q8")
            return kernels
        if config.model.quantization is not None:
            # awq/gptq/compressed-tensors/fp8/int8 keep their own stored weights: no dense-weight kernels.
            return LayerKernels()
        if config.model.dtype == "bfloat16" and self.activation_dtype(torch.bfloat16) == torch.bfloat16:
            # bf16 activations: the native norm/rope/SiLU in bf16 (torch's roundings; those torch ops
            # were a large share of a long prompt's step) and, for decode steps, the head in the fused
            # step's bf16 form (the weights are bf16 already).
            kernels = native_layer_kernels() if cpu_kernels.available() is None else LayerKernels()
            if fused and NativeHeadKernel.available("bf16") is None:
                kernels.lm_head = NativeHeadKernel("bf16")
            if NativeBf16Linear.available() is None:
                # AMX tiles for the eager steps' smaller matmuls; the fused step reads the same
                # packed weights instead of packing its own copy.
                kernels.linear = NativeBf16Linear()
            return kernels
        if (os.environ.get("TOKENMILL_CPU_PACKED_LINEAR", "1") == "0" or Bf16WeightLinear.available()
                or config.model.dtype != "bfloat16" or self.activation_dtype(torch.bfloat16) != torch.float32
                or (config.device.graph_capture or "none") != "none"):
            return LayerKernels()
        kernel = Bf16WeightLinear()
        return LayerKernels(linear=kernel, lm_head=kernel)

    def quantization_methods(self) -> list[str]:
        # awq/gptq/compressed-tensors: checkpoint formats (detected from config.json); fp8/int8:
        # run-time modes like int4 (quantization/fp8.py, int8.py).
        return ["int4", "gguf", "awq", "gptq", "compressed-tensors", "fp8", "int8"]

    def native_quantization_formats(self) -> dict[str, str]:
        """GGUF kept quantized (quantization="gguf"): Q4_0/Q4_1/Q4_K/Q8_0/Q6_K on the AVX512-VNNI
        matmul (platforms/cpu_gguf_kernels.py), the other block formats dequantized a tile at a
        time. Read from the CPU flags: listing must not build the kernels."""
        native = "native" if {"avx512_vnni", "avx512bw"} <= cpu_flags() else "dequantized-per-tile"
        formats = {f"gguf:{name}": native for name in ("Q4_0", "Q4_1", "Q4_K", "Q8_0", "Q6_K")}
        formats.update({f"gguf:{name}": "dequantized-per-tile" for name in ("Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q5_K")})
        # 4-bit AWQ/GPTQ/W4A16 and FP8 weights: kept packed, upcast a tile of rows per matmul;
        # INT8 W8A8 (compressed-tensors, quantization="int8"): int8 x int8 GEMMs (torch._int_mm).
        formats.update({name: "dequantized-per-tile" for name in (
            "awq", "gptq", "compressed-tensors:w4a16", "compressed-tensors:fp8", "fp8")})
        formats.update({"compressed-tensors:int8": "native", "int8": "native"})
        return formats

    def quantization_kernels(self, name: str) -> QuantKernels:
        """int4: the native ends of its int8 GEMMs (platforms/cpu_kernels.py), when they build here."""
        from . import cpu_kernels

        if name == "gguf":
            from . import cpu_gguf_kernels as g
            if g.available() is not None:
                return QuantKernels()
            return QuantKernels(fits=g.fits, pack_affine4=g.pack_affine4, pack_int8_groups=g.pack_int8_groups,
                                pack_q4k=g.pack_q4k, pack_q6k=g.pack_q6k, matmul=g.matmul,
                                dequantize_rows=g.dequantize_rows)
        # int8 and compressed-tensors' W8A8 run the same per-token int8 GEMMs as int4's batches.
        if name not in ("int4", "int8", "compressed-tensors") or cpu_kernels.available() is not None:
            return QuantKernels()
        kernels = {"quantize_rows_int8": cpu_kernels.quantize_rows_int8,
                   "dequantize_int32": cpu_kernels.dequantize_int32}
        if name == "int4":
            from . import cpu_decode_kernels as native

            # With AMX, torch._int_mm's tiles beat S8 at the GEMM itself but not end to end (W1 and
            # W4 came out even: the step's float32 elementwise work dominates there), so S8 everywhere.
            if native.NativeHeadKernel.available("q8") is None:
                # Batches in S8 (int8 per-channel weights, activations per 32 inputs, one native
                # call), faster than torch._int_mm with its separate quantize, outlier and dequantize
                # passes (platforms/cpu_decode_kernels.py).
                kernels.update(pack_s8=native.pack_s8_weight, matmul_s8=native.matmul_s8)
        return QuantKernels(**kernels)

    def lora_kernels(self) -> Callable[..., None] | None:
        """The native batched LoRA op (platforms/cpu_lora.py: one shrink + expand pass per adapted
        linear instead of ~5 torch ops) when the kernels build here; None: the torch op."""
        from . import cpu_lora

        return cpu_lora.add_lora if cpu_lora.available() is None else None

    def check_and_update_config(self, config) -> None:
        resolve_dtype(config.model.dtype, torch.float32)  # validates the name
        if config.model.quantization == "int4":
            # Its kernels take float32 activations (int8 GEMMs quantize from them); with bf16
            # activations every matmul would fall back to dense and the mode would buy nothing.
            if config.model.dtype not in ("auto", "float32"):
                raise ValueError(f"dtype {config.model.dtype!r} cannot be combined with quantization 'int4' "
                                 f"on the cpu platform; use dtype auto or float32")
            config.model.dtype = "float32"
        if config.model.quantization == "gguf" and config.model.dtype == "auto":
            config.model.dtype = "float32"      # the GGUF kernels take float32 activations
        threads = config.device.num_threads or os.cpu_count() or 1
        if config.model.dtype == "auto":
            # bf16 only with AMX. Where AVX512_BF16 alone wins (bf16_gemm_is_faster; --dtype bfloat16
            # is then several times float32's speed: docs/benchmarks.md) it is still not the
            # default: a greedy request repeated on a cached
            # prefix re-runs its last prompt token through the fused bf16 step, whose rounding differs
            # from the bf16 prefill's, and can answer differently; float32 answers the same every time.
            config.model.dtype = "bfloat16" if cpu_has_amx() else "float32"
        if config.model.dtype == "float16":
            raise ValueError("dtype float16 is not supported on the cpu platform; use bfloat16 or float32")
        torch.set_num_threads(threads)


def _advise_huge_pages(address: int, length: int) -> None:
    """Ask for transparent huge pages on a large zero-page mapping (the KV pool): a prefill then
    first-touches its blocks 2 MiB at a time instead of 4 KiB (with 4 KiB pages, writing a long
    prompt's K/V was mostly page faults). A no-op where THP is off or the
    call fails; memory still comes only as blocks are used (in 2 MiB steps)."""
    huge = 2 << 20
    start = (address + huge - 1) // huge * huge
    end = (address + length) // huge * huge
    if end - start < huge:
        return
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        libc.madvise(start, end - start, 14)        # MADV_HUGEPAGE
    except (OSError, AttributeError):
        pass
