"""What a platform must answer. Small and versioned: a third-party platform is one class.

A platform plugin is a subclass of `Platform`, registered under the entry-point group
`tokenmill.platforms`. The core never calls device APIs directly; it asks the platform.
Bump PLATFORM_API_VERSION on any incompatible change; plugins built for another version
are reported and skipped.
"""
from __future__ import annotations

import logging
import os
import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, ClassVar, Mapping, Optional

import torch

from tokenmill.quantization.interface import QuantKernels

from .layer_spec import LLAMA_LAYER, DecoderLayerSpec, DecoderStackSpec, LayerStructure, MoeSpec  # noqa: F401 (re-exported)

if TYPE_CHECKING:  # the core's config, only for type hints: platforms import nothing upward
    from tokenmill.core.config import EngineConfig

PLATFORM_API_VERSION = 2
logger = logging.getLogger("tokenmill.platforms")


@dataclass(frozen=True)
class Availability:
    available: bool
    reason: str = ""      # why not, in words a user can act on

    @classmethod
    def yes(cls, detail: str = "") -> "Availability":
        return cls(True, detail)

    @classmethod
    def no(cls, reason: str) -> "Availability":
        return cls(False, reason)


class MemoryProfiler:
    """Decides how many KV blocks fit."""

    def num_kv_blocks(self, config: "EngineConfig", bytes_per_block: int,
                      profile_forward: Callable[[], None]) -> int:
        """`profile_forward` runs one dummy forward pass at max_num_batched_tokens."""
        raise NotImplementedError


# A platform whose memory is the host's RAM shares it with everything else on the machine, so
# gpu_memory_utilization (a share of a device this engine owns) does not apply: the KV pool then
# takes what the cpu platform takes, a quarter of what is available, at most 4 GiB.
HOST_KV_SHARE = 0.25
HOST_KV_CAP = 4 << 30


def host_memory() -> tuple[int, int]:
    """(total, available) bytes of host RAM, from /proc/meminfo (sysconf where it is missing)."""
    fields: dict[str, int] = {}
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                key, _, rest = line.partition(":")
                fields[key] = int(rest.split()[0]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    page = os.sysconf("SC_PAGE_SIZE")
    total = fields.get("MemTotal") or page * os.sysconf("SC_PHYS_PAGES")
    return total, fields.get("MemAvailable") or page * os.sysconf("SC_AVPHYS_PAGES")


class DefaultMemoryProfiler(MemoryProfiler):
    """Sizes the KV pool from nothing but the platform's total and free memory.

    kv_cache_memory, when given, is the budget. Otherwise, after the profiling forward pass
    (weights and peak activations are then resident), the KV cache takes what is free less the
    share of the device that gpu_memory_utilization leaves to others; on host RAM, see
    HOST_KV_SHARE.
    """

    def __init__(self, total_memory: Callable[[], int], free_memory: Callable[[], int],
                 host_ram: bool = False, name: str = "") -> None:
        self._total, self._free, self.host_ram, self.name = total_memory, free_memory, host_ram, name

    def budget_bytes(self, config: "EngineConfig", profile_forward: Callable[[], None]) -> int:
        if config.cache.kv_cache_memory is not None:
            return int(config.cache.kv_cache_memory)
        if self.host_ram:
            return min(HOST_KV_CAP, int(self._free() * HOST_KV_SHARE))
        profile_forward()
        headroom = int(self._total() * (1.0 - config.cache.gpu_memory_utilization))
        return max(0, int(self._free()) - headroom)

    def num_kv_blocks(self, config: "EngineConfig", bytes_per_block: int,
                      profile_forward: Callable[[], None]) -> int:
        blocks = blocks_from_budget(self.budget_bytes(config, profile_forward), bytes_per_block)
        if blocks <= 0:
            raise ValueError(f"{self.name or 'platform'}: no memory left for the KV cache (free "
                             f"{self._free() / 2**30:.2f} GiB of {self._total() / 2**30:.2f} GiB); "
                             f"lower the model size or raise gpu_memory_utilization / kv_cache_memory")
        return blocks


@dataclass
class LayerKernels:
    """The op kernels a platform offers the core's layers, by op kind; every one optional.

    Elementwise ops are callables that may return NotImplemented for an input they do not take (the
    layer then runs torch): rms_norm(x, residual, weight, eps, offset=0.0) (offset: Gemma's 1 in
    (1 + w), scaled in float32), rotary(positions, x, cos_sin_cache, rotary_dim=None, interleaved=False)
    (partial or GPT-J rotary), silu_and_mul(x),
    gelu_tanh_and_mul(x), moe(hidden, w13, w2, topk_weights, topk_ids, activation) (a mixture-of-experts
    layer's experts; core/layers/moe.py moe_reference is the contract), gated_delta_rule(q, k, v, g, beta,
    state, chunked) (a Gated DeltaNet layer's recurrence; core/layers/gated_deltanet.py
    gated_delta_rule_reference is the contract), ssd_scan(x, dt, A, B, C, D, dt_bias, dt_limit, state,
    chunked, chunk_size) (a Mamba-2 layer's scan; core/layers/mamba2.py ssd_scan_reference is the
    contract), kimi_delta_rule(q, k, v, g, beta, state, chunked) (Kimi Delta Attention's recurrence, the
    decay per key channel; core/layers/kimi_delta.py kimi_delta_rule_reference is the contract). Dense
    matmuls are objects
    with `prepare(weight) -> prepared` (once, after loading) and `__call__(x, prepared, bias)`:
    `linear` for the layers kept unquantized, `lm_head` for the vocabulary projection. A quantized
    layer's matmul is its quantization method's `apply` (with the platform's QuantKernels);
    attention is the attention backend's."""
    rms_norm: Optional[Callable[..., Any]] = None
    rotary: Optional[Callable[..., Any]] = None
    silu_and_mul: Optional[Callable[..., Any]] = None
    gelu_tanh_and_mul: Optional[Callable[..., Any]] = None
    moe: Optional[Callable[..., Any]] = None
    gated_delta_rule: Optional[Callable[..., Any]] = None
    kimi_delta_rule: Optional[Callable[..., Any]] = None
    ssd_scan: Optional[Callable[..., Any]] = None
    linear: Any = None
    lm_head: Any = None

    @classmethod
    def of(cls, kernels: "LayerKernels | Mapping[str, Any] | None") -> "LayerKernels":
        """From a mapping by op kind (an unknown kind is a ValueError, so a misspelt name cannot
        silently leave the torch path on)."""
        if isinstance(kernels, LayerKernels):
            return kernels
        given = dict(kernels or {})
        known = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(set(given) - set(known))
        if unknown:
            raise ValueError(f"unknown layer kinds {unknown} in the platform's kernels; known: {sorted(known)}")
        return cls(**given)

    def offered(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if getattr(self, f.name) is not None}

    def __bool__(self) -> bool:      # "were any kernels given"
        return bool(self.offered())


@dataclass
class ModelView:
    """What a decode program may read of the loaded model and its KV pool (the model runner builds
    it): the network, its attention layers (each with `impl`, the backend instance, `kv_cache`,
    `scale`, `sliding_window`) and the pool's geometry."""
    model: torch.nn.Module           # offers decoder_stack() -> DecoderStackSpec when its layers compose
    attention_layers: list[Any]
    attention_backend: type          # the backend class every attention layer uses
    num_blocks: int
    block_size: int
    max_blocks_per_seq: int
    max_num_seqs: int
    device: torch.device
    world_size: int = 1              # tensor x pipeline parallel ranks
    pad_slot_id: Optional[int] = None   # a slot padded rows may write to (None: the backend's choice)


class DecodeProgram:
    """How a platform runs steps faster than the eager forward: the cpu platform's native decode
    step composed from the model's layer spec, CUDA graphs, XLA's compiled buckets, torch.compile.
    The base class is the eager forward itself."""
    name: ClassVar[str] = "none"
    # What attention backends must support (`supported_graph_modes`): a program that never puts
    # the backend's forward inside a graph says "none".
    attention_mode: ClassVar[Optional[str]] = None     # None: `name`
    # Whether it runs layers whose attention reads their own KV group's block tables
    # (attn_metadata.groups: hybrid KV, core/kv_groups.py); one that does not gets one table per model.
    reads_kv_groups: ClassVar[bool] = False

    # Why `build` returned the eager forward, when it did (`tokenmill bench throughput --profile`).
    eager_reason: Optional[str] = None

    @classmethod
    def backend_mode(cls) -> str:
        return cls.attention_mode or cls.name

    def build(self, forward: Callable[..., torch.Tensor], model: ModelView) -> Callable[..., torch.Tensor]:
        """The callable the model runner invokes each step, same signature as `forward`:
        forward(input_ids, positions, attn_metadata) -> hidden states. Whatever the program cannot
        run goes to `forward` (said once in the log), never to a wrong answer."""
        return forward


class Platform:
    api_version: ClassVar[int] = PLATFORM_API_VERSION
    name: ClassVar[str] = ""
    torch_device: ClassVar[str] = "cpu"
    priority: ClassVar[int] = 0          # auto-detection: highest available wins
    dispatch_key: ClassVar[str] = "cpu"  # which attention backends' `supported_devices` apply
                                         # ("reference" supports every key)

    @classmethod
    def probe(cls) -> Availability:
        """Is this platform usable here? Never raises."""
        raise NotImplementedError

    def attention_backends(self) -> list[str]:
        """Backend names in preference order."""
        return ["reference"]

    def memory_profiler(self) -> MemoryProfiler:
        """How many KV blocks fit. The default needs only total_memory() and free_memory()."""
        return DefaultMemoryProfiler(self.total_memory, self.free_memory,
                                     host_ram=type(self).free_memory is Platform.free_memory, name=self.name)

    def total_memory(self) -> int:
        """Bytes of memory the device has (default: the host's RAM, for devices that use it)."""
        return host_memory()[0]

    def free_memory(self) -> int:
        """Bytes free on the device now (default: the host's available RAM)."""
        return host_memory()[1]

    def decode_program(self, config: "EngineConfig") -> DecodeProgram:
        return DecodeProgram()

    def decode_program_name(self, config: "EngineConfig") -> str:
        """The program `decode_program(config)` will use ("none", "fused_decode", "torch.compile",
        "cuda_graphs", "xla"): what the runner puts in AttentionConfig.graph_capture."""
        return self.decode_program(config).name

    def decode_programs(self) -> list[str]:
        """Names of the decode programs this platform offers, default first (for `tokenmill platforms`;
        `--graph-capture NAME` picks one)."""
        return ["none"]

    def distributed_backend(self) -> str:
        return "gloo"

    def set_device_for_rank(self, local_rank: int) -> None:
        """Bind this worker process to its accelerator (rank `local_rank` on this machine) before
        anything is built; host-only platforms have nothing to bind."""

    def check_and_update_config(self, config: "EngineConfig") -> None:
        """Fill platform defaults (dtype, block size) and refuse what cannot run here (ValueError)."""

    def activation_dtype(self, dtype: torch.dtype) -> torch.dtype:
        """The dtype activations and the KV cache use when weights are `dtype`."""
        return dtype

    def quantization_methods(self) -> list[str]:
        """Names of the quantization methods (quantization/, entry-point group
        `tokenmill.quantization_methods`) this platform runs for `quantization=` (optional).
        Checkpoint formats (GGUF, dequantized at load) need no entry here."""
        return []

    def native_quantization_formats(self) -> dict[str, str]:
        """Checkpoint quantization formats this platform runs without a float copy of the
        weights, by format name ("gguf:Q4_0", "gguf:Q4_K", ..., "awq", "gptq", "fp8", ...) ->
        "native" (a kernel multiplies the stored form) or "dequantized-per-tile" (kept in its
        stored form, dequantized a tile at a time inside the matmul). A format absent here is
        refused when the checkpoint asks for it (ValueError naming `quantization`, the format and
        the platforms that list it); `tokenmill platforms` shows this table."""
        return {}

    def quantization_kernels(self, name: str) -> QuantKernels:
        """Native kernels for quantization method `name` (its `use_kernels`); any left None, the
        method runs its torch path for."""
        return QuantKernels()

    def layer_kernels(self, config: "EngineConfig") -> LayerKernels:
        """Kernels the core swaps into its layers after loading (core/layers/kernels.py); any left
        None runs torch."""
        return LayerKernels()

    def lora_kernels(self) -> Optional[Callable[..., None]]:
        """The batched LoRA op, `add_lora(y, x, lora_a, lora_b, mapping, output_sizes)` (core/lora/punica.py has
        the contract and the torch implementation): y[row] += x[row] A[slot]^T B[slot]^T for each
        row the mapping adapts, lora_a = A^T [slots, in, R], lora_b = B^T [slots, R, out]. None: the
        torch one."""
        return None

    # Device services the core needs without naming a device API.
    def device(self) -> torch.device:
        return torch.device(self.torch_device)

    def zeros(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A zero-filled tensor on the device (the KV pool: gigabytes, allocated once)."""
        return torch.zeros(shape, dtype=dtype, device=self.device())

    def synchronize(self) -> None:
        pass

    def device_name(self) -> str:
        """The accelerator's model name for reports ("" when the device is the host CPU)."""
        return ""

    def set_seed(self, seed: int) -> None:
        torch.manual_seed(seed)

    def describe(self) -> dict[str, Any]:
        """What `tokenmill platforms` shows. Must not touch the device (it runs for unavailable ones)."""
        return {
            "name": self.name, "api_version": self.api_version, "torch_device": self.torch_device,
            "priority": self.priority, "dispatch_key": self.dispatch_key,
            "attention_backends": self.attention_backends(),
            "decode_programs": self.decode_programs(),
            "distributed_backend": self.distributed_backend(),
            "quantization": self.quantization_methods(),
            "quantization_formats": self.native_quantization_formats(),
            "description": (type(self).__doc__ or "").strip().splitlines()[0] if type(self).__doc__ else "",
        }


def resolve_dtype(name: str, default: torch.dtype) -> torch.dtype:
    table = {"float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
             "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
             "float16": torch.float16, "fp16": torch.float16, "half": torch.float16}
    if name == "auto":
        return default
    if name not in table:
        raise ValueError(f"dtype must be one of auto, {', '.join(sorted(table))}; got {name!r}")
    return table[name]


def blocks_from_budget(budget_bytes: int, bytes_per_block: int) -> int:
    """Whole blocks that fit in a byte budget; the shared arithmetic of every profiler."""
    if bytes_per_block <= 0:
        raise ValueError("bytes_per_block must be positive")
    return max(0, int(budget_bytes) // bytes_per_block)


def choose_decode_program(config: "EngineConfig", platform_name: str, offered: list[str], default: str) -> str:
    """The strategy name to use: "none" under enforce_eager, else the requested one (ValueError if
    the platform does not offer it), else the platform's default."""
    if config.device.enforce_eager:
        return "none"
    choice = config.device.graph_capture or default
    if choice not in offered:
        raise ValueError(f"graph_capture {choice!r} is not offered by the {platform_name} platform "
                         f"(offers {offered})")
    return choice


def graph_capturing(tensor: torch.Tensor) -> bool:
    """Whether `tensor`'s device is recording a graph now (CUDA graph capture): a layer then takes a
    form without host synchronisation (no data-dependent shapes)."""
    return tensor.is_cuda and torch.cuda.is_current_stream_capturing()
