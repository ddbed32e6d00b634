"""The XPU platform: Intel GPUs through torch.xpu (native in torch >= 2.5, or via IPEX).

* attention: IPEX paged attention when intel_extension_for_pytorch imports, else the portable
  reference backend;
* memory: the CUDA-style recipe on torch.xpu (mem_get_info, peak allocated);
* graph capture: none or torch.compile; distributed: xccl (torch >= 2.8) or oneCCL's "ccl".
"""
from __future__ import annotations

import logging

import torch

from . import _probe
from .cpu import TorchCompileProgram
from .interface import (Availability, DecodeProgram, MemoryProfiler, Platform, choose_decode_program,
                        resolve_dtype)
from .memory import GiB, TorchDeviceMemoryProfiler

logger = logging.getLogger("tokenmill.platforms.xpu")
IPEX = "intel_extension_for_pytorch"


def _xpu_module():
    return torch.xpu


def _xpu_compiled() -> bool:
    xpu = getattr(torch, "xpu", None)
    try:
        return bool(xpu is not None and xpu._is_compiled())
    except Exception:
        return False


class XpuPlatform(Platform):
    """Intel GPUs through torch.xpu: IPEX paged attention, xccl/ccl."""
    name = "xpu"
    torch_device = "xpu"
    priority = 80
    dispatch_key = "xpu"

    def __init__(self) -> None:
        self._baseline_used = 0

    @classmethod
    def probe(cls) -> Availability:
        try:
            return cls._probe()
        except Exception as exc:
            return Availability.no(f"probing xpu failed: {_probe.exc_text(exc)}")

    @classmethod
    def _probe(cls) -> Availability:
        tv = _probe.torch_version()
        has_ipex = _probe.module_present(IPEX)
        if not _xpu_compiled():
            if not has_ipex:
                return Availability.no(f"{IPEX} is not installed and torch {tv} was built without XPU "
                                       f"support (torch.xpu has no devices)")
            try:
                import intel_extension_for_pytorch  # noqa: F401  (registers the xpu device on old torch)
            except Exception as exc:
                return Availability.no(f"{IPEX} failed to import: {_probe.exc_text(exc)}")
        count = torch.xpu.device_count() if torch.xpu.is_available() else 0
        if count == 0:
            nodes = _probe.device_nodes("/dev/dri/renderD*")
            where = ("/dev/dri/renderD* exists; is the Level Zero runtime (intel-level-zero-gpu) installed?"
                     if nodes else "no /dev/dri/renderD* node: no Intel GPU driver loaded")
            return Availability.no(f"torch.xpu has no devices ({where})")
        extra = f", IPEX {_probe.dist_version(IPEX, 'intel-extension-for-pytorch')}" if has_ipex else ""
        return Availability.yes(f"{count} x {torch.xpu.get_device_name(0)}, torch {tv}{extra}")

    def attention_backends(self) -> list[str]:
        return (["ipex"] if _probe.module_present(IPEX) else []) + ["reference"]

    def memory_profiler(self) -> MemoryProfiler:
        return TorchDeviceMemoryProfiler(self.name, _xpu_module, baseline_used=self._baseline_used)

    def decode_programs(self) -> list[str]:
        return ["none", "torch.compile"]

    def decode_program(self, config) -> DecodeProgram:
        choice = choose_decode_program(config, self.name, self.decode_programs(), "none")
        return TorchCompileProgram() if choice == "torch.compile" else DecodeProgram()

    def distributed_backend(self) -> str:
        try:
            import torch.distributed as dist
            if getattr(dist, "is_xccl_available", None) and dist.is_xccl_available():
                return "xccl"
        except Exception:
            pass
        return "ccl"    # oneccl_bindings_for_pytorch

    def check_and_update_config(self, config) -> None:
        resolve_dtype(config.model.dtype, torch.float16)
        if config.model.dtype == "auto":
            config.model.dtype = "bfloat16"
        if hasattr(torch.xpu, "mem_get_info"):
            free, total = torch.xpu.mem_get_info()
            self._baseline_used = int(total - free)
            logger.info("xpu: %.2f GiB of %.2f GiB in use before loading", self._baseline_used / GiB, total / GiB)

    def synchronize(self) -> None:
        torch.xpu.synchronize()

    def set_seed(self, seed: int) -> None:
        torch.manual_seed(seed)
        torch.xpu.manual_seed_all(seed)
