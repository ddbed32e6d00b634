"""The platforms: probes (true reasons here, every branch through monkeypatching), the memory
profilers' arithmetic (the default one a new device gets included), config checks (graph
capture: test_graph_capture.py). Nothing here needs an accelerator."""
from __future__ import annotations

import pytest
import torch

from tokenmill.core.config import EngineConfig
from tokenmill.platforms import _probe
from tokenmill.platforms import rocm as rocm_mod
from tokenmill.platforms import memory
from tokenmill.platforms.cpu import CpuMemoryProfiler, CpuPlatform
from tokenmill.platforms.cuda import CudaPlatform
from tokenmill.platforms.interface import (PLATFORM_API_VERSION, Availability, DefaultMemoryProfiler, Platform)
from tokenmill.platforms.memory import (GiB, MiB, DeviceMemorySnapshot, TorchDeviceMemoryProfiler,
                                        device_kv_budget, static_kv_blocks, xla_kv_budget)
from tokenmill.platforms.neuron import NeuronPlatform, NeuronStaticMemoryProfiler
from tokenmill.platforms.rocm import RocmPlatform
from tokenmill.platforms.tpu import TpuPlatform
from tokenmill.platforms.xpu import XpuPlatform

ALL = [CpuPlatform, CudaPlatform, RocmPlatform, XpuPlatform, TpuPlatform, NeuronPlatform]
TV = torch.__version__


# ------------------------------------------------------------------------------- probes, here

def test_cpu_always_available():
    assert CpuPlatform.probe().available


@pytest.mark.skipif(torch.version.cuda is not None, reason="this torch has CUDA")
def test_cuda_reason_here():
    assert CudaPlatform.probe() == Availability.no(f"torch {TV} was built without CUDA")


@pytest.mark.skipif(torch.version.hip is not None, reason="this torch has HIP")
def test_rocm_reason_here():
    reason = RocmPlatform.probe().reason
    assert not RocmPlatform.probe().available
    assert reason.startswith(f"torch {TV} was built without ROCm/HIP")


@pytest.mark.skipif(_probe.module_present("intel_extension_for_pytorch") or torch.xpu._is_compiled(),
                    reason="XPU support present")
def test_xpu_reason_here():
    assert XpuPlatform.probe() == Availability.no(
        f"intel_extension_for_pytorch is not installed and torch {TV} was built without XPU support "
        f"(torch.xpu has no devices)")


@pytest.mark.skipif(_probe.module_present("torch_xla"), reason="torch_xla installed")
def test_tpu_reason_here():
    assert TpuPlatform.probe() == Availability.no("torch_xla is not installed")


@pytest.mark.skipif(_probe.module_present("torch_neuronx"), reason="torch_neuronx installed")
def test_neuron_reason_here():
    assert NeuronPlatform.probe() == Availability.no("torch_neuronx is not installed")


@pytest.mark.parametrize("cls", ALL, ids=lambda c: c.name)
def test_interface_basics(cls):
    assert cls.api_version == PLATFORM_API_VERSION
    platform = cls()            # constructing must not touch the device
    desc = platform.describe()  # nor describing it
    assert desc["name"] == cls.name and desc["attention_backends"] and desc["decode_programs"]
    assert desc["distributed_backend"] in {"gloo", "nccl", "xccl", "ccl", "xla"}
    assert isinstance(cls.probe(), Availability)


# --------------------------------------------------------------------- probes, every branch

@pytest.fixture
def fake_cuda_build(monkeypatch):
    monkeypatch.setattr(torch.version, "cuda", "12.8", raising=False)
    monkeypatch.setattr(torch.version, "hip", None, raising=False)
    monkeypatch.setattr(torch.backends.cuda, "is_built", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)


def test_cuda_no_driver(fake_cuda_build, monkeypatch):
    monkeypatch.setattr(_probe, "shared_library", lambda name: None)
    monkeypatch.setattr(_probe, "device_nodes", lambda *p: [])
    reason = CudaPlatform.probe().reason
    assert reason.startswith("no NVIDIA driver found") and "CUDA 12.8" in reason


def test_cuda_driver_but_no_device(fake_cuda_build, monkeypatch):
    monkeypatch.setattr(_probe, "shared_library", lambda name: "libcuda.so.1")
    assert CudaPlatform.probe().reason.startswith("no CUDA device visible")


def test_cuda_hidden_by_env(fake_cuda_build, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert CudaPlatform.probe().reason == "CUDA_VISIBLE_DEVICES='' hides every GPU"


def test_cuda_refuses_hip_build(monkeypatch):
    monkeypatch.setattr(torch.version, "hip", "6.3.1", raising=False)
    assert "ROCm/HIP build" in CudaPlatform.probe().reason


def test_rocm_no_kfd(monkeypatch):
    monkeypatch.setattr(torch.version, "hip", "6.3.1", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for var in ("HIP_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES", "CUDA_VISIBLE_DEVICES"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(rocm_mod.os.path, "exists", lambda p: False)
    assert RocmPlatform.probe().reason == "no ROCm driver: /dev/kfd is missing (amdgpu kernel driver not loaded)"


def test_probe_never_raises(monkeypatch):
    def boom():
        raise RuntimeError("driver exploded")
    monkeypatch.setattr(torch.version, "cuda", "12.8", raising=False)
    monkeypatch.setattr(torch.version, "hip", None, raising=False)
    monkeypatch.setattr(torch.backends.cuda, "is_built", boom)
    availability = CudaPlatform.probe()
    assert not availability.available and "driver exploded" in availability.reason


def test_tpu_branches(monkeypatch):
    monkeypatch.setattr(_probe, "module_present", lambda name: name == "torch_xla")
    monkeypatch.delenv("PJRT_DEVICE", raising=False)
    monkeypatch.delenv("TPU_ACCELERATOR_TYPE", raising=False)
    monkeypatch.setattr(_probe, "dist_version", lambda *n: "2.5.1")
    assert "does not match torch" in TpuPlatform.probe().reason
    monkeypatch.setattr(_probe, "dist_version", lambda *n: TV.split("+")[0])
    monkeypatch.setattr(_probe, "device_nodes", lambda *p: [])
    assert "no TPU device was found" in TpuPlatform.probe().reason
    monkeypatch.setenv("PJRT_DEVICE", "CPU")
    assert TpuPlatform.probe().reason.startswith("PJRT_DEVICE=CPU")


def test_neuron_no_device(monkeypatch):
    monkeypatch.setattr(_probe, "module_present", lambda name: name == "torch_neuronx")
    monkeypatch.setattr(_probe, "device_nodes", lambda *p: [])
    assert "no Neuron device was found" in NeuronPlatform.probe().reason


def test_xpu_compiled_but_no_device(monkeypatch):
    from tokenmill.platforms import xpu
    monkeypatch.setattr(xpu, "_xpu_compiled", lambda: True)
    monkeypatch.setattr(torch.xpu, "is_available", lambda: False)
    monkeypatch.setattr(_probe, "device_nodes", lambda *p: [])
    assert XpuPlatform.probe().reason == ("torch.xpu has no devices "
                                          "(no /dev/dri/renderD* node: no Intel GPU driver loaded)")


def test_xpu_prefers_ipex_when_importable(monkeypatch):
    monkeypatch.setattr(_probe, "module_present", lambda name: name == "intel_extension_for_pytorch")
    assert XpuPlatform().attention_backends() == ["ipex", "reference"]
    monkeypatch.setattr(_probe, "module_present", lambda name: False)
    assert XpuPlatform().attention_backends() == ["reference"]


# -------------------------------------------------------------------- memory arithmetic

def test_device_kv_budget_arithmetic():
    # An 80 GiB device; 0.5 GiB in use before we started (another process); after profiling:
    # torch peak 10 GiB (weights + activations), torch reserves 12 GiB, driver says 64 GiB free.
    snap = DeviceMemorySnapshot(total=80 * GiB, free=64 * GiB, peak_allocated=10 * GiB, reserved=12 * GiB)
    budget = device_kv_budget(snap, 0.9, bytes_per_block=2 * MiB, baseline_used=GiB // 2)
    # used now = 16 GiB; non-torch = 16 - 12 - 0.5 = 3.5 GiB (context, workspaces)
    assert budget.non_torch == int(3.5 * GiB)
    assert budget.requested == int(80 * GiB * 0.9)
    assert budget.kv_bytes == int(80 * GiB * 0.9) - 10 * GiB - int(3.5 * GiB)   # 58.5 GiB
    assert budget.num_blocks == budget.kv_bytes // (2 * MiB) == 29952
    with_reserve = device_kv_budget(snap, 0.9, 2 * MiB, baseline_used=GiB // 2, reserve=256 * MiB)
    assert with_reserve.num_blocks == budget.num_blocks - 128


def test_device_kv_budget_clamped_to_free_and_zero():
    # Another process grabbed most of the device after start-up: only 4 GiB are free.
    snap = DeviceMemorySnapshot(total=80 * GiB, free=4 * GiB, peak_allocated=10 * GiB, reserved=10 * GiB)
    budget = device_kv_budget(snap, 0.9, GiB, baseline_used=66 * GiB)
    assert budget.kv_bytes == 4 * GiB and budget.num_blocks == 4
    tiny = DeviceMemorySnapshot(total=16 * GiB, free=GiB, peak_allocated=15 * GiB, reserved=15 * GiB)
    assert device_kv_budget(tiny, 0.9, MiB).num_blocks == 0
    with pytest.raises(ValueError):
        device_kv_budget(snap, 0.0, MiB)


class FakeDeviceModule:
    """The slice of torch.cuda's API the profiler uses, with scripted figures."""

    def __init__(self, total, used_by_others, weights, activation_peak, context=300 * MiB):
        self.total, self.others, self.weights = total, used_by_others, weights
        self.act, self.context = activation_peak, context
        self.allocated = weights
        self.peak = weights
        self.reserved = weights
        self.calls: list[str] = []

    def synchronize(self):
        self.calls.append("synchronize")

    def empty_cache(self):
        self.calls.append("empty_cache")
        self.reserved = self.allocated

    def reset_peak_memory_stats(self):
        self.calls.append("reset_peak")
        self.peak = self.allocated

    def forward(self):
        self.calls.append("forward")
        self.peak = max(self.peak, self.allocated + self.act)
        self.reserved = max(self.reserved, self.allocated + self.act)

    def max_memory_allocated(self):
        return self.peak

    def memory_reserved(self):
        return self.reserved

    def mem_get_info(self):
        return self.total - self.others - self.context - self.reserved, self.total


def test_torch_device_profiler_measures_around_forward():
    dev = FakeDeviceModule(total=141 * GiB, used_by_others=0, weights=16 * GiB, activation_peak=6 * GiB)
    config = EngineConfig.from_kwargs(gpu_memory_utilization=0.9)
    baseline = dev.context    # what mem_get_info showed at check_and_update_config
    profiler = TorchDeviceMemoryProfiler("fake", lambda: dev, baseline_used=baseline)
    blocks = profiler.num_kv_blocks(config, 4 * MiB, dev.forward)
    assert dev.calls.index("reset_peak") < dev.calls.index("forward")
    expected = (int(141 * GiB * 0.9) - (16 + 6) * GiB) // (4 * MiB)
    assert blocks == expected == profiler.last_budget.num_blocks
    # The block count fits in what is free after profiling.
    assert blocks * 4 * MiB <= dev.mem_get_info()[0]


def test_torch_device_profiler_refuses_when_nothing_fits():
    dev = FakeDeviceModule(total=16 * GiB, used_by_others=0, weights=14 * GiB, activation_peak=2 * GiB)
    with pytest.raises(ValueError, match="no memory left for the KV cache"):
        TorchDeviceMemoryProfiler("fake", lambda: dev).num_kv_blocks(EngineConfig(), MiB, dev.forward)


def test_xla_kv_budget_both_formats():
    new = {"bytes_limit": 16 * GiB, "bytes_used": 4 * GiB, "peak_bytes_used": 6 * GiB}
    budget = xla_kv_budget(new, 0.9, 8 * MiB)
    assert budget.num_blocks == (int(16 * GiB * 0.9) - 6 * GiB) // (8 * MiB)
    old = {"kb_total": 16 * 1024 * 1024, "kb_free": 12 * 1024 * 1024}           # 4 GiB used, no peak
    budget = xla_kv_budget(old, 0.9, 8 * MiB)
    charged = int(4 * GiB * (1 + memory.XLA_PEAK_MARGIN)) + 1
    assert abs(budget.peak_allocated - charged) <= 1
    assert budget.num_blocks == (int(16 * GiB * 0.9) - budget.peak_allocated) // (8 * MiB)
    with pytest.raises(ValueError):
        xla_kv_budget({"weird": 1}, 0.9, MiB)


def test_static_kv_blocks():
    # 8 sequences x ceil(4096/16)=256 blocks + 1 null block
    assert static_kv_blocks(8, 4096, 16, 1 * MiB, 16 * GiB, 0.9) == 8 * 256 + 1
    with pytest.raises(ValueError, match="lower --max-num-seqs"):
        static_kv_blocks(256, 32768, 16, 4 * MiB, 16 * GiB, 0.9)
    config = EngineConfig.from_kwargs(max_model_len=1024, max_num_seqs=4, num_gpu_blocks_override=7)
    assert NeuronStaticMemoryProfiler(16 * GiB).num_kv_blocks(config, MiB, lambda: None) == 7


def test_cpu_profiler_budget():
    config = EngineConfig.from_kwargs(kv_cache_memory=64 * MiB)
    assert CpuMemoryProfiler(lambda: 1 << 40).num_kv_blocks(config, MiB, lambda: None) == 64
    assert CpuMemoryProfiler(lambda: 8 * GiB).budget_bytes(None) == 2 * GiB


# ------------------------------------------------------------ the default memory profiler

class MinimalPlatform(Platform):
    """A new device's one class: nothing but a name and a probe."""
    name = "minimal"

    @classmethod
    def probe(cls):
        return Availability.yes()


class OwnMemoryPlatform(MinimalPlatform):
    def __init__(self, total=16 * GiB, free=12 * GiB):
        self.total, self.free, self.profiled = total, free, 0

    def total_memory(self):
        return self.total

    def free_memory(self):
        return self.free


def test_default_platform_needs_only_a_probe():
    platform = MinimalPlatform()
    assert platform.attention_backends() == ["reference"]
    total, free = platform.total_memory(), platform.free_memory()
    assert total >= free > 0
    profiler = platform.memory_profiler()
    assert isinstance(profiler, DefaultMemoryProfiler) and profiler.host_ram
    config = EngineConfig.from_kwargs(kv_cache_memory=64 * MiB)
    assert profiler.num_kv_blocks(config, MiB, lambda: None) == 64
    # On host RAM without kv_cache_memory: a quarter of what is available, at most 4 GiB, like the cpu platform.
    host = DefaultMemoryProfiler(lambda: 64 * GiB, lambda: 8 * GiB, host_ram=True)
    assert host.num_kv_blocks(EngineConfig(), MiB, lambda: None) == 2 * 1024


def test_default_profiler_on_device_memory_leaves_the_unused_share():
    platform = OwnMemoryPlatform()
    profiler = platform.memory_profiler()
    assert not profiler.host_ram
    calls = []

    def forward():          # the profiling pass: weights and activations now take 2 GiB more
        calls.append(1)
        platform.free -= 2 * GiB

    config = EngineConfig.from_kwargs(gpu_memory_utilization=0.75)
    blocks = profiler.num_kv_blocks(config, MiB, forward)
    assert calls == [1] and blocks == (10 * GiB - 4 * GiB) // MiB
    platform.free = 3 * GiB
    with pytest.raises(ValueError, match="no memory left for the KV cache"):
        profiler.num_kv_blocks(config, MiB, lambda: None)


# --------------------------------------------------------------------------- config checks

def test_cpu_check_and_update_config():
    config = EngineConfig()
    CpuPlatform().check_and_update_config(config)
    assert config.model.dtype in ("float32", "bfloat16")
    with pytest.raises(ValueError, match="float16"):
        CpuPlatform().check_and_update_config(EngineConfig.from_kwargs(dtype="float16"))


def test_tpu_refuses_fp16():
    with pytest.raises(ValueError, match="TPU"):
        TpuPlatform().check_and_update_config(EngineConfig.from_kwargs(dtype="float16"))
    config = EngineConfig()
    TpuPlatform().check_and_update_config(config)
    assert config.model.dtype == "bfloat16"
