"""The ROCm platform: AMD GPUs through a HIP build of torch (torch.cuda API on HIP).

Same mechanisms as CUDA (memory profiling through mem_get_info and peak allocated, HIP graphs
through torch.cuda.graph), Triton paged attention, RCCL through the "nccl" backend name.
"""
from __future__ import annotations

import os

import torch

from . import _probe
from .cuda import CudaPlatform, _describe_devices
from .interface import Availability


class RocmPlatform(CudaPlatform):
    """AMD GPUs through torch built with HIP: Triton attention, HIP graphs, RCCL."""
    name = "rocm"
    torch_device = "cuda"      # HIP builds of torch keep the "cuda" device type
    priority = 95
    dispatch_key = "rocm"
    visible_devices_env = "HIP_VISIBLE_DEVICES"

    @classmethod
    def _probe(cls) -> Availability:
        tv = _probe.torch_version()
        hip = getattr(torch.version, "hip", None)
        if not hip:
            extra = f" (it is a CUDA {torch.version.cuda} build)" if getattr(torch.version, "cuda", None) else ""
            return Availability.no(f"torch {tv} was built without ROCm/HIP{extra}")
        if torch.cuda.is_available() and torch.cuda.device_count() > 0:
            return Availability.yes(f"{_describe_devices()}, HIP {hip}, torch {tv}")
        for var in ("HIP_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES", "CUDA_VISIBLE_DEVICES"):
            value = os.environ.get(var)
            if value is not None and value.strip() in ("", "-1"):
                return Availability.no(f"{var}={value!r} hides every GPU")
        if not os.path.exists("/dev/kfd"):
            return Availability.no("no ROCm driver: /dev/kfd is missing (amdgpu kernel driver not loaded)")
        return Availability.no("no AMD GPU visible: torch.cuda.device_count() == 0 although /dev/kfd exists "
                               "(is this user in the render/video groups?)")

    def attention_backends(self) -> list[str]:
        return ["triton_paged", "reference"]

    def distributed_backend(self) -> str:
        return "nccl"   # RCCL, under torch.distributed's "nccl" name
