"""The platforms: probes (true reasons here, every branch through monkeypatching), the memory
profilers' arithmetic, CUDA-graph padding/replay logic (with a fake device module), XLA bucketing,
config checks. Nothing here needs an accelerator."""
from __future__ import annotations

import contextlib

import pytest
import torch

from tokenmill.attention_backends.interface import AttentionMetadata
from tokenmill.core.config import EngineConfig
from tokenmill.platforms import _probe
from tokenmill.platforms import rocm as rocm_mod
from tokenmill.platforms import memory
from tokenmill.platforms.cpu import CpuMemoryProfiler, CpuPlatform
from tokenmill.platforms.cuda import CudaPlatform
from tokenmill.platforms.cuda_graphs import (CudaGraphCapture, CudaGraphRunner, cuda_graph_capture_sizes,
                                             padded_batch_size)
from tokenmill.platforms.interface import PLATFORM_API_VERSION, Availability, GraphCapture, choose_graph_capture
from tokenmill.platforms.memory import (GiB, MiB, DeviceMemorySnapshot, TorchDeviceMemoryProfiler,
                                        device_kv_budget, static_kv_blocks, xla_kv_budget)
from tokenmill.platforms.neuron import NeuronPlatform, NeuronStaticMemoryProfiler
from tokenmill.platforms.rocm import RocmPlatform
from tokenmill.platforms.tpu import TpuPlatform
from tokenmill.platforms.xla_common import XlaBucketedRunner, bucket_for, pad_batch, token_buckets
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
    assert desc["name"] == cls.name and desc["attention_backends"] and desc["graph_capture"]
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
    assert XpuPlatform.probe().reason == "torch.xpu has no devices (no /dev/dri/renderD* node: no Intel GPU driver loaded)"


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
        self.total, self.others, self.weights, self.act, self.context = total, used_by_others, weights, activation_peak, context
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


# ------------------------------------------------------------------- graph capture choice

def test_choose_graph_capture():
    config = EngineConfig()
    assert choose_graph_capture(config, "x", ["cuda_graphs", "none"], "cuda_graphs") == "cuda_graphs"
    config.device.enforce_eager = True
    assert choose_graph_capture(config, "x", ["cuda_graphs", "none"], "cuda_graphs") == "none"
    config = EngineConfig.from_kwargs(graph_capture="xla")
    with pytest.raises(ValueError, match="not offered by the x platform"):
        choose_graph_capture(config, "x", ["cuda_graphs", "none"], "cuda_graphs")


def test_cuda_graph_capture_strategy_selection():
    platform = CudaPlatform()
    assert platform.graph_capture(EngineConfig()).name == "cuda_graphs"
    assert platform.graph_capture(EngineConfig.from_kwargs(enforce_eager=True)).name == "none"
    assert platform.graph_capture_name(EngineConfig.from_kwargs(graph_capture="torch.compile")) == "torch.compile"
    assert TpuPlatform().graph_capture(EngineConfig.from_kwargs(enforce_eager=True)).name == "xla"
    with pytest.raises(ValueError):
        TpuPlatform().graph_capture(EngineConfig.from_kwargs(graph_capture="cuda_graphs"))


def test_capture_sizes():
    assert cuda_graph_capture_sizes(256) == [1, 2, 4] + list(range(8, 257, 8))
    assert cuda_graph_capture_sizes(5) == [1, 2, 4, 5]
    assert cuda_graph_capture_sizes(4096)[-1] == 512
    sizes = cuda_graph_capture_sizes(32)
    assert [padded_batch_size(n, sizes) for n in (1, 3, 5, 9, 32, 33)] == [1, 4, 8, 16, 32, None]


# --------------------------------------------------------- CUDA-graph runner, fake device

class FakeGraphModule:
    """torch.cuda's graph API on the CPU: 'capture' records the call, 'replay' re-runs it into the
    captured output tensor in place, exactly as a real replay rewrites the graph's output memory."""

    def __init__(self):
        self.capturing = None
        self.captured_sizes: list[int] = []

    class CUDAGraph:
        def __init__(self):
            self.fn = None

        def replay(self):
            self.fn()

    def synchronize(self):
        pass

    def graph_pool_handle(self):
        return object()

    def Stream(self):
        return self

    def current_stream(self):
        return self

    def wait_stream(self, stream):
        pass

    @contextlib.contextmanager
    def stream(self, stream):
        yield

    @contextlib.contextmanager
    def graph(self, graph, pool=None):
        self.capturing = graph
        yield
        self.capturing = None


def make_forward(mod: FakeGraphModule, kv: torch.Tensor, log: list):
    """A toy 'model': writes a value per token into its KV slot, then per token reads back its whole
    context through the block table. Reads per-sequence values only from device tensors."""

    def compute(ids, pos, meta):
        log.append(int(ids.shape[0]))
        if ids.shape[0] != meta.seq_lens.shape[0]:       # the toy only models decode batches
            return torch.zeros(ids.shape[0], 3, dtype=kv.dtype)
        kv.view(-1).index_copy_(0, meta.slot_mapping, (ids * 1000 + pos).to(kv.dtype))
        bs = meta.block_size
        max_len = meta.block_tables.shape[1] * bs
        p = torch.arange(max_len)
        slots = meta.block_tables.long()[:, p // bs] * bs + p % bs              # [S, max_len]
        vals = kv.view(-1)[slots] * (p < meta.seq_lens.unsqueeze(1).long())     # mask beyond seq_len
        return torch.stack([vals.sum(1), ids.to(kv.dtype), pos.to(kv.dtype)], dim=1)     # [T, 3]

    def forward(ids, pos, meta):
        out = compute(ids, pos, meta)
        if mod.capturing is not None:
            graph = mod.capturing
            graph.fn = lambda: out.copy_(compute(ids, pos, meta))
            mod.captured_sizes.append(int(ids.shape[0]))
        return out

    return forward


class FakeRunner:
    def __init__(self, **kw):
        self.max_num_seqs, self.block_size, self.max_blocks_per_seq, self.device = 8, 4, 4, "cpu"
        self.__dict__.update(kw)


def decode_meta(seqs: list[tuple[int, list[int]]], block_size: int, width: int) -> tuple:
    """seqs: (seq_len, block table) per sequence, one new token each at position seq_len-1."""
    ids = torch.tensor([100 + i for i in range(len(seqs))])
    pos = torch.tensor([n - 1 for n, _ in seqs])
    tables = torch.tensor([t + [0] * (width - len(t)) for _, t in seqs], dtype=torch.int32)
    slots = torch.tensor([t[(n - 1) // block_size] * block_size + (n - 1) % block_size for n, t in seqs])
    meta = AttentionMetadata(
        query_start_loc=torch.arange(len(seqs) + 1, dtype=torch.int32),
        seq_lens=torch.tensor([n for n, _ in seqs], dtype=torch.int32), block_tables=tables, slot_mapping=slots,
        num_decodes=len(seqs), max_query_len=1, max_seq_len=max(n for n, _ in seqs), block_size=block_size,
        query_start_loc_cpu=list(range(len(seqs) + 1)), seq_lens_cpu=[n for n, _ in seqs])
    return ids, pos, meta


@pytest.mark.parametrize("pad_slot_id", [None, 0])
def test_cuda_graph_runner_pads_and_replays(pad_slot_id):
    torch.manual_seed(0)
    mod = FakeGraphModule()
    # 12 blocks of 4 slots (block 0 reserved when pad_slot_id=0); integers in float64: sums are exact.
    kv_graph = torch.randint(0, 100, (12 * 4,)).double()
    kv_eager = kv_graph.clone()
    log: list = []
    runner = FakeRunner(pad_slot_id=pad_slot_id)
    wrapped = CudaGraphCapture(lambda: mod).wrap(make_forward(mod, kv_graph, log), runner)
    eager = make_forward(FakeGraphModule(), kv_eager, [])
    assert isinstance(wrapped, CudaGraphRunner) and wrapped.sizes == [1, 2, 4, 8]

    steps = [
        [(5, [3, 7]), (2, [5]), (9, [1, 2, 4])],          # 3 -> padded to 4
        [(6, [3, 7]), (3, [5])],                           # 2 exactly
        [(7, [3, 7]), (4, [5]), (10, [1, 2, 4]), (1, [6]), (2, [8])],   # 5 -> 8
    ]
    for seqs in steps:
        ids, pos, meta = decode_meta(seqs, 4, 3)
        got = wrapped(ids, pos, meta)
        want = eager(ids, pos, meta)
        assert got.shape == want.shape
        torch.testing.assert_close(got, want, rtol=0, atol=0)
        # The KV cache of real sequences is exactly what the eager run left.
        used = sorted({b for _, t in seqs for b in t})
        view_g, view_e = kv_graph.view(12, 4), kv_eager.view(12, 4)
        torch.testing.assert_close(view_g[used], view_e[used], rtol=0, atol=0)
    assert wrapped.num_replays == 3 and wrapped.captured
    assert mod.captured_sizes == [8, 4, 2, 1]            # largest first, once each


def test_cuda_graph_runner_runs_prefill_eagerly():
    mod = FakeGraphModule()
    kv = torch.zeros(48)
    log: list = []
    wrapped = CudaGraphCapture(lambda: mod).wrap(make_forward(mod, kv, log), FakeRunner())
    ids, pos, meta = decode_meta([(3, [1])], 4, 1)
    prefill = AttentionMetadata(
        query_start_loc=torch.tensor([0, 3], dtype=torch.int32), seq_lens=torch.tensor([3], dtype=torch.int32),
        block_tables=torch.tensor([[1]], dtype=torch.int32), slot_mapping=torch.tensor([4, 5, 6]), num_decodes=0,
        max_query_len=3, max_seq_len=3, block_size=4, query_start_loc_cpu=[0, 3], seq_lens_cpu=[3])
    wrapped(torch.tensor([1, 2, 3]), torch.tensor([0, 1, 2]), prefill)
    assert not wrapped.captured and wrapped.num_eager == 1
    too_many = decode_meta([(2, [i + 1]) for i in range(9)], 4, 1)      # 9 > largest size 8
    wrapped(*too_many)
    assert not wrapped.captured and wrapped.num_eager == 2


def test_cuda_graph_capture_skipped_for_backend_without_graphs():
    class NoGraphs:
        name = "reference"
        supported_graph_modes = ("none",)

    forward = lambda *a: None  # noqa: E731
    assert CudaGraphCapture(lambda: FakeGraphModule()).wrap(forward, FakeRunner(backend_cls=NoGraphs)) is forward
    assert GraphCapture().wrap(forward, None) is forward


# -------------------------------------------------------------------------- XLA bucketing

def test_token_buckets():
    assert token_buckets(2048) == [16, 32, 64, 128, 256, 512, 1024, 2048]
    assert token_buckets(100, 128) == [128]
    assert bucket_for(17, token_buckets(2048)) == 32 and bucket_for(5000, token_buckets(2048)) is None


def test_pad_batch_and_bucketed_runner():
    ids = torch.tensor([5, 6, 7, 8])
    pos = torch.tensor([0, 1, 2, 9])
    meta = AttentionMetadata(
        query_start_loc=torch.tensor([0, 1, 4], dtype=torch.int32), seq_lens=torch.tensor([10, 3], dtype=torch.int32),
        block_tables=torch.tensor([[2, 3, 4], [5, 0, 0]], dtype=torch.int32),
        slot_mapping=torch.tensor([4 * 4 + 1, 20, 21, 22]), num_decodes=1, max_query_len=3, max_seq_len=10,
        block_size=4, query_start_loc_cpu=[0, 1, 4], seq_lens_cpu=[10, 3])
    p_ids, p_pos, p_meta = pad_batch(ids, pos, meta, 16, 4, 8, pad_slot_id=0)
    assert p_ids.shape == (16,) and p_meta.block_tables.shape == (4, 8)
    assert p_meta.query_start_loc.tolist() == [0, 1, 4, 4, 4] and p_meta.seq_lens.tolist() == [10, 3, 0, 0]
    assert p_meta.slot_mapping[4:].eq(0).all() and p_meta.num_decodes == 0 and p_meta.max_query_len == 16
    assert p_meta.query_start_loc_cpu == [0, 1, 4, 4, 4] and p_meta.seq_lens_cpu == [10, 3, 0, 0]

    shapes: list = []

    def forward(i, p, m):
        shapes.append((i.shape[0], m.block_tables.shape))
        return (i * 10 + p).float().unsqueeze(1)

    steps: list = []
    runner = XlaBucketedRunner(forward, FakeRunner(max_num_seqs=4, max_blocks_per_seq=8), [16, 32],
                               step_fn=lambda: steps.append(1))
    runner.precompile()
    assert shapes == [(16, (4, 8)), (32, (4, 8))] and len(steps) == 2
    out = runner(ids, pos, meta)
    torch.testing.assert_close(out, (ids * 10 + pos).float().unsqueeze(1))
    assert shapes[-1] == (16, (4, 8))


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
