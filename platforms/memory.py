"""Memory profilers shared by the accelerator platforms, and the arithmetic they rest on.

The arithmetic is kept in pure functions (no device calls) so it is unit-tested on any
machine; the profilers only gather the figures a device reports and hand them over.

Accelerator recipe (CUDA, ROCm through HIP, XPU), the same as vLLM's:
  1. at `check_and_update_config` (before the model is loaded) remember how much device memory
     was already in use (`baseline_used`: other processes, plus our own driver context);
  2. after the model is loaded: reset the peak statistics, run one dummy forward pass at
     `max_num_batched_tokens`, synchronize;
  3. non-KV memory = peak allocated by torch (weights + largest activations)
                     + memory in use that torch's allocator does not own and that was not in
                       use at start-up (driver context growth, cuBLAS/NCCL workspaces);
  4. KV bytes = total * gpu_memory_utilization - non-KV - reserve (CUDA graphs), clamped to
     what is actually free now; block count = KV bytes // bytes_per_block.
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional

from .interface import MemoryProfiler, blocks_from_budget

logger = logging.getLogger("tokenmill.platforms.memory")

GiB = 1 << 30
MiB = 1 << 20


@dataclass(frozen=True)
class DeviceMemorySnapshot:
    """What a device reports after the profiling forward pass (all in bytes)."""
    total: int               # device memory in all
    free: int                # free now, as the driver sees it (mem_get_info)
    peak_allocated: int      # torch allocator peak since reset: weights + largest activations
    reserved: int            # held by torch's caching allocator now


@dataclass(frozen=True)
class KvBudget:
    """The result of the arithmetic, every term kept so it can be logged and checked."""
    requested: int           # total * utilization
    peak_allocated: int
    non_torch: int           # in use, not owned by torch, and not in use at start-up
    reserve: int             # held back for graph capture and the like
    free_now: int
    kv_bytes: int            # what the KV cache may take
    num_blocks: int
    bytes_per_block: int

    def summary(self) -> str:
        return (f"requested {self.requested / GiB:.2f} GiB (total x utilization) - peak torch "
                f"{self.peak_allocated / GiB:.2f} GiB - non-torch {self.non_torch / GiB:.2f} GiB - reserve "
                f"{self.reserve / GiB:.2f} GiB = {self.kv_bytes / GiB:.2f} GiB for the KV cache "
                f"(free now {self.free_now / GiB:.2f} GiB) -> {self.num_blocks} blocks of "
                f"{self.bytes_per_block} bytes")


def device_kv_budget(snapshot: DeviceMemorySnapshot, utilization: float, bytes_per_block: int,
                     baseline_used: int = 0, reserve: int = 0) -> KvBudget:
    """Pure arithmetic: how many KV blocks fit, given what the device reported.

    `baseline_used`: bytes in use on the device before this engine loaded anything (other
    processes); it is not charged to this engine, matching `gpu_memory_utilization`'s meaning
    ("the share of the device this engine may use").
    """
    if bytes_per_block <= 0:
        raise ValueError("bytes_per_block must be positive")
    if not 0.0 < utilization <= 1.0:
        raise ValueError(f"utilization must be in (0, 1], got {utilization}")
    requested = int(snapshot.total * utilization)
    used_now = snapshot.total - snapshot.free
    non_torch = max(0, used_now - snapshot.reserved - max(0, baseline_used))
    kv_bytes = requested - snapshot.peak_allocated - non_torch - max(0, reserve)
    # The KV cache cannot be larger than what the driver says is free now (snapshots are taken
    # after empty_cache, so torch's cached activation memory is already counted as free).
    free_now = snapshot.free
    kv_bytes = max(0, min(kv_bytes, free_now))
    return KvBudget(requested=requested, peak_allocated=snapshot.peak_allocated, non_torch=non_torch,
                    reserve=max(0, reserve), free_now=free_now, kv_bytes=kv_bytes,
                    num_blocks=blocks_from_budget(kv_bytes, bytes_per_block), bytes_per_block=bytes_per_block)


def _not_enough(platform: str, budget: KvBudget) -> ValueError:
    return ValueError(
        f"no memory left for the KV cache on {platform}: {budget.summary()}. Raise "
        f"--gpu-memory-utilization, lower --max-num-batched-tokens, or use a smaller model/dtype")


class TorchDeviceMemoryProfiler(MemoryProfiler):
    """Profiles a torch device module with the CUDA-style memory API (torch.cuda, torch.xpu).

    `device_module` is a zero-argument callable returning the module, so this class never
    names a device API at import time.
    """

    def __init__(self, platform_name: str, device_module: Callable[[], Any], baseline_used: int = 0,
                 reserve: int = 0) -> None:
        self.platform_name = platform_name
        self._device_module = device_module
        self.baseline_used = baseline_used
        self.reserve = reserve
        self.last_budget: Optional[KvBudget] = None

    def snapshot(self) -> DeviceMemorySnapshot:
        mod = self._device_module()
        mod.synchronize()
        peak = int(mod.max_memory_allocated())
        mod.empty_cache()            # activations of the profiling pass go back to the driver
        reserved = int(mod.memory_reserved())
        if hasattr(mod, "mem_get_info"):
            free, total = (int(x) for x in mod.mem_get_info())
        else:   # old IPEX builds: no driver figure, assume we are alone on the device
            total = int(mod.get_device_properties(mod.current_device()).total_memory)
            free = total - reserved
        return DeviceMemorySnapshot(total=total, free=free, peak_allocated=peak, reserved=reserved)

    def num_kv_blocks(self, config, bytes_per_block, profile_forward):
        override = config.cache.num_gpu_blocks_override
        if override:
            logger.info("%s: num_gpu_blocks_override=%d, skipping memory profiling", self.platform_name, override)
            return int(override)
        mod = self._device_module()
        mod.synchronize()
        mod.empty_cache()
        mod.reset_peak_memory_stats()
        profile_forward()
        snap = self.snapshot()
        budget = device_kv_budget(snap, config.cache.gpu_memory_utilization, bytes_per_block,
                                  baseline_used=self.baseline_used, reserve=self.reserve)
        self.last_budget = budget
        logger.info("%s memory profile: total %.2f GiB, free %.2f GiB, baseline used %.2f GiB; %s",
                    self.platform_name, snap.total / GiB, snap.free / GiB, self.baseline_used / GiB,
                    budget.summary())
        if budget.num_blocks <= 0:
            raise _not_enough(self.platform_name, budget)
        return budget.num_blocks


# ----------------------------------------------------------------------------------- XLA (TPU)

XLA_PEAK_MARGIN = 0.02   # when XLA reports no peak, charge the current use plus this share


def xla_kv_budget(info: Mapping[str, Any], utilization: float, bytes_per_block: int) -> KvBudget:
    """Pure arithmetic over `torch_xla.core.xla_model.get_memory_info(device)`.

    Newer torch_xla reports bytes_limit / bytes_used / peak_bytes_used; older kb_total / kb_free.
    XLA cannot reset its peak, so without `peak_bytes_used` the current use plus a margin is
    charged (the compile-time peak would overstate the model's needs).
    """
    if bytes_per_block <= 0:
        raise ValueError("bytes_per_block must be positive")
    if "bytes_limit" in info:
        total = int(info["bytes_limit"])
        used = int(info.get("bytes_used", 0))
    elif "kb_total" in info:
        total = int(info["kb_total"]) * 1024
        used = total - int(info.get("kb_free", info["kb_total"])) * 1024
    else:
        raise ValueError(f"unrecognised XLA memory info keys: {sorted(info)}")
    peak = info.get("peak_bytes_used")
    charged = int(peak) if peak is not None else int(math.ceil(used * (1 + XLA_PEAK_MARGIN)))
    requested = int(total * utilization)
    free_now = max(0, total - used)
    kv_bytes = max(0, min(requested - charged, free_now))
    return KvBudget(requested=requested, peak_allocated=charged, non_torch=0, reserve=0, free_now=free_now,
                    kv_bytes=kv_bytes, num_blocks=blocks_from_budget(kv_bytes, bytes_per_block),
                    bytes_per_block=bytes_per_block)


class XlaMemoryProfiler(MemoryProfiler):
    """Runs the profiling pass through XLA, then reads the device's memory info."""

    def __init__(self, platform_name: str = "tpu") -> None:
        self.platform_name = platform_name
        self.last_budget: Optional[KvBudget] = None

    def memory_info(self) -> Mapping[str, Any]:
        import torch_xla.core.xla_model as xm
        return xm.get_memory_info(xm.xla_device())

    def num_kv_blocks(self, config, bytes_per_block, profile_forward):
        override = config.cache.num_gpu_blocks_override
        if override:
            return int(override)
        import torch_xla.core.xla_model as xm
        profile_forward()
        xm.mark_step()
        xm.wait_device_ops()
        info = self.memory_info()
        budget = xla_kv_budget(info, config.cache.gpu_memory_utilization, bytes_per_block)
        self.last_budget = budget
        logger.info("%s memory profile (%s): %s", self.platform_name, dict(info), budget.summary())
        if budget.num_blocks <= 0:
            raise _not_enough(self.platform_name, budget)
        return budget.num_blocks


# ------------------------------------------------------------------------------- static (Neuron)

def static_kv_blocks(max_num_seqs: int, max_model_len: int, block_size: int, bytes_per_block: int,
                     device_bytes: int, utilization: float) -> int:
    """Pure arithmetic for static-shape devices: every sequence slot gets blocks for the whole
    context up front (plus one null block for padding), and that must fit the device share.
    """
    if bytes_per_block <= 0 or block_size <= 0:
        raise ValueError("bytes_per_block and block_size must be positive")
    per_seq = -(-max_model_len // block_size)
    blocks = max_num_seqs * per_seq + 1
    need = blocks * bytes_per_block
    have = int(device_bytes * utilization)
    if need > have:
        raise ValueError(
            f"static KV cache needs {blocks} blocks x {bytes_per_block} bytes = {need / GiB:.2f} GiB "
            f"(max_num_seqs {max_num_seqs} x {per_seq} blocks for max_model_len {max_model_len}, +1 null "
            f"block) but the device share is {have / GiB:.2f} GiB; lower --max-num-seqs or --max-model-len")
    return blocks
