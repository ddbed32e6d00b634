"""The TPU platform: Google TPUs through torch_xla (PJRT).

* attention: Pallas paged attention from torch_xla when present, else reference;
* memory: profiling pass, then xm.get_memory_info -> KV blocks (platforms/memory.py);
* graph capture: XLA compilation over bucketed padded shapes, precompiled at start-up
  (platforms/xla_common.py); distributed: xla.
"""
from __future__ import annotations

import torch

from . import _probe
from .interface import Availability, DecodeProgram, MemoryProfiler
from .memory import XlaMemoryProfiler
from .xla_common import XlaBucketedProgram, XlaPlatform, openxla_compile, probe_xla_runtime, xla_mark_step

TPU_DEVICE_NODES = ("/dev/accel[0-9]*", "/dev/vfio/[0-9]*")


class TpuPlatform(XlaPlatform):
    """Google TPUs through torch_xla: Pallas attention, bucketed XLA compilation."""
    name = "tpu"
    priority = 90
    dispatch_key = "tpu"

    @classmethod
    def probe(cls) -> Availability:
        return probe_xla_runtime("tpu", "torch_xla", cls._probe_device)

    @classmethod
    def _probe_device(cls) -> Availability:
        tv = _probe.torch_version()
        xv = _probe.dist_version("torch_xla", "torch-xla") or "?"
        if xv != "?" and _probe.major_minor(xv) != _probe.major_minor(tv):
            return Availability.no(f"torch_xla {xv} does not match torch {tv} (major.minor must agree)")
        pjrt = _probe.env("PJRT_DEVICE")
        if pjrt and pjrt.upper() != "TPU":
            return Availability.no(f"PJRT_DEVICE={pjrt}: torch_xla is set up for {pjrt}, not a TPU")
        nodes = _probe.device_nodes(*TPU_DEVICE_NODES)
        if not nodes and not _probe.env("TPU_ACCELERATOR_TYPE"):
            return Availability.no(f"torch_xla {xv} is installed but no TPU device was found "
                                   f"(no /dev/accel* or /dev/vfio/* node, TPU_ACCELERATOR_TYPE unset)")
        try:
            import torch_xla.runtime as xr
            kind = xr.device_type()
        except Exception as exc:
            return Availability.no(f"torch_xla failed to initialise: {_probe.exc_text(exc)}")
        if kind and kind != "TPU":
            return Availability.no(f"torch_xla runtime device type is {kind}, not TPU")
        accel = _probe.env("TPU_ACCELERATOR_TYPE") or f"{len(nodes)} chip(s)"
        return Availability.yes(f"TPU {accel}, torch_xla {xv}")

    def attention_backends(self) -> list[str]:
        return ["pallas", "reference"]

    def memory_profiler(self) -> MemoryProfiler:
        return XlaMemoryProfiler(self.name)

    def decode_program(self, config) -> DecodeProgram:
        if config.device.graph_capture not in (None, "xla"):
            raise ValueError(f"graph_capture {config.device.graph_capture!r} is not offered by the tpu platform "
                             f"(offers ['xla']); XLA always compiles")
        eager = config.device.enforce_eager
        # --enforce-eager: no dynamo and no precompile, but still bucketed (lazy tensors compile per shape).
        return XlaBucketedProgram(min_bucket=16, precompile=not eager,
                                  compile_fn=None if eager else openxla_compile, step_fn=xla_mark_step,
                                  max_num_batched_tokens=config.scheduler.max_num_batched_tokens or 2048)

    def check_and_update_config(self, config) -> None:
        super().check_and_update_config(config)
        if config.model.dtype in ("float16", "fp16", "half"):
            raise ValueError("dtype float16 is not supported on TPU; use bfloat16 or float32")

    def set_seed(self, seed: int) -> None:
        import torch_xla.core.xla_model as xm
        torch.manual_seed(seed)
        xm.set_rng_state(seed)
