"""The CUDA platform (NVIDIA GPUs through torch.cuda; a HIP build of torch is the rocm platform).

* probe: torch built with CUDA (not HIP), a driver, a visible device;
* attention: FlashAttention, FlashInfer, Triton paged attention, reference (first that validates);
* memory: a profiling forward pass at max_num_batched_tokens, peak allocated and mem_get_info,
  `gpu_memory_utilization` of the device -> KV block count (platforms/memory.py);
* graph capture: CUDA graphs of decode steps at padded batch sizes (platforms/cuda_graphs.py),
  skipped with --enforce-eager; distributed: nccl.
"""
from __future__ import annotations

import logging

import torch

from . import _probe
from .cpu import TorchCompileProgram
from .cuda_graphs import CudaGraphProgram
from .interface import (Availability, DecodeProgram, LayerKernels, MemoryProfiler, Platform,
                        choose_decode_program, resolve_dtype)
from .memory import GiB, MiB, TorchDeviceMemoryProfiler

logger = logging.getLogger("tokenmill.platforms.cuda")

# Held back from the KV cache for the CUDA-graph memory pool when graphs are on.
CUDA_GRAPH_RESERVE_BYTES = 256 * MiB


def _cuda_module():
    return torch.cuda


def _describe_devices() -> str:
    """Device count, plus names once CUDA is initialised: probing must not initialise CUDA (a process
    that forks after probing, like a server starting its engine process, would break)."""
    n = torch.cuda.device_count()
    if not torch.cuda.is_initialized():
        return f"{n} device(s)"
    props = torch.cuda.get_device_properties(0)
    arch = getattr(props, "gcnArchName", None) or f"sm_{props.major}{props.minor}"
    return f"{n} x {props.name} ({arch}, {props.total_memory / GiB:.0f} GiB)"


class CudaPlatform(Platform):
    """NVIDIA GPUs through torch.cuda: CUDA graphs, nccl."""
    name = "cuda"
    torch_device = "cuda"
    priority = 100
    dispatch_key = "cuda"
    visible_devices_env = "CUDA_VISIBLE_DEVICES"

    def __init__(self) -> None:
        self._baseline_used = 0
        self._graphs_on = False

    # ------------------------------------------------------------------------------ probe
    @classmethod
    def probe(cls) -> Availability:
        try:
            return cls._probe()
        except Exception as exc:   # never raise
            return Availability.no(f"probing {cls.name} failed: {_probe.exc_text(exc)}")

    @classmethod
    def _probe(cls) -> Availability:
        tv = _probe.torch_version()
        if getattr(torch.version, "hip", None):
            return Availability.no(f"torch {tv} is a ROCm/HIP build, not CUDA (use --device rocm)")
        if not getattr(torch.version, "cuda", None) or not torch.backends.cuda.is_built():
            return Availability.no(f"torch {tv} was built without CUDA")
        reason = cls._no_device_reason(tv)
        if reason:
            return Availability.no(reason)
        return Availability.yes(f"{_describe_devices()}, CUDA {torch.version.cuda}, torch {tv}")

    @classmethod
    def _no_device_reason(cls, tv: str) -> str:
        if torch.cuda.is_available() and torch.cuda.device_count() > 0:
            return ""
        visible = _probe.env(cls.visible_devices_env)
        if visible is not None and visible.strip() in ("", "-1", "none", "NoDevFiles"):
            return f"{cls.visible_devices_env}={visible!r} hides every GPU"
        if not _probe.shared_library("cuda") and not _probe.device_nodes("/dev/nvidia[0-9]*", "/dev/nvidiactl"):
            return (f"no NVIDIA driver found (libcuda is not on the library path and there is no "
                    f"/dev/nvidia* device node); torch {tv} needs one for CUDA {torch.version.cuda}")
        return (f"no CUDA device visible: torch.cuda.device_count() == 0 although a driver is present "
                f"(is it older than CUDA {torch.version.cuda} needs?)")

    # -------------------------------------------------------------------------- services
    def attention_backends(self) -> list[str]:
        return ["flash_attn", "flashinfer", "triton_paged", "reference"]

    def memory_profiler(self) -> MemoryProfiler:
        return TorchDeviceMemoryProfiler(self.name, _cuda_module, baseline_used=self._baseline_used,
                                         reserve=CUDA_GRAPH_RESERVE_BYTES if self._graphs_on else 0)

    def decode_programs(self) -> list[str]:
        return ["cuda_graphs", "none", "torch.compile"]

    def decode_program(self, config) -> DecodeProgram:
        choice = choose_decode_program(config, self.name, self.decode_programs(), "cuda_graphs")
        if choice == "cuda_graphs":
            return CudaGraphProgram(_cuda_module)
        if choice == "torch.compile":
            return TorchCompileProgram()
        return DecodeProgram()

    def distributed_backend(self) -> str:
        return "nccl"

    def set_device_for_rank(self, local_rank: int) -> None:
        torch.cuda.set_device(local_rank % max(1, torch.cuda.device_count()))

    def check_and_update_config(self, config) -> None:
        resolve_dtype(config.model.dtype, torch.float16)     # validates the name
        bf16 = torch.cuda.is_bf16_supported()
        if config.model.dtype == "auto":
            config.model.dtype = "bfloat16" if bf16 else "float16"
        elif config.model.dtype in ("bfloat16", "bf16") and not bf16:
            raise ValueError(f"dtype bfloat16 is not supported by {torch.cuda.get_device_name(0)}; use float16")
        self._graphs_on = choose_decode_program(config, self.name, self.decode_programs(),
                                               "cuda_graphs") == "cuda_graphs"
        # What was in use before this engine loaded anything is not charged to it.
        free, total = torch.cuda.mem_get_info()
        self._baseline_used = int(total - free)
        logger.info("%s: %.2f GiB of %.2f GiB in use before loading (not charged to this engine)",
                    self.name, self._baseline_used / GiB, total / GiB)

    def device(self) -> torch.device:
        return torch.device(self.torch_device, torch.cuda.current_device())

    def synchronize(self) -> None:
        torch.cuda.synchronize()

    def layer_kernels(self, config) -> LayerKernels:
        """The Triton mixture-of-experts op (platforms/triton_moe.py) when triton is installed."""
        import importlib.util
        if importlib.util.find_spec("triton") is None:
            return LayerKernels()
        from .triton_moe import fused_moe
        return LayerKernels(moe=fused_moe)

    def lora_kernels(self):
        """Triton's SGMV shrink/expand (platforms/triton_lora.py) when triton is installed."""
        import importlib.util
        if importlib.util.find_spec("triton") is None:
            return None
        from .triton_lora import add_lora
        return add_lora

    def device_name(self) -> str:
        return f"{torch.cuda.get_device_name(0)} (CUDA {torch.version.cuda})"

    def set_seed(self, seed: int) -> None:
        torch.manual_seed(seed)
        torch.cuda.manual_seed_all(seed)
