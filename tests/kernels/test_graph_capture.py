"""Graph capture, without an accelerator: the strategy choice, CUDA-graph padding/replay logic
(with a fake device module), XLA bucketing."""
from __future__ import annotations

import contextlib

import pytest
import torch

from tokenmill.attention_backends.interface import AttentionMetadata
from tokenmill.core.config import EngineConfig
from tokenmill.platforms.cuda import CudaPlatform
from tokenmill.platforms.cuda_graphs import (CudaGraphProgram, CudaGraphRunner, cuda_graph_capture_sizes,
                                             padded_batch_size)
from tokenmill.platforms.interface import DecodeProgram, choose_decode_program
from tokenmill.platforms.tpu import TpuPlatform
from tokenmill.platforms.xla_common import XlaBucketedRunner, bucket_for, pad_batch, token_buckets


# ------------------------------------------------------------------- graph capture choice

def test_choose_decode_program():
    config = EngineConfig()
    assert choose_decode_program(config, "x", ["cuda_graphs", "none"], "cuda_graphs") == "cuda_graphs"
    config.device.enforce_eager = True
    assert choose_decode_program(config, "x", ["cuda_graphs", "none"], "cuda_graphs") == "none"
    config = EngineConfig.from_kwargs(graph_capture="xla")
    with pytest.raises(ValueError, match="not offered by the x platform"):
        choose_decode_program(config, "x", ["cuda_graphs", "none"], "cuda_graphs")


def test_cuda_graph_capture_strategy_selection():
    platform = CudaPlatform()
    assert platform.decode_program(EngineConfig()).name == "cuda_graphs"
    assert platform.decode_program(EngineConfig.from_kwargs(enforce_eager=True)).name == "none"
    assert platform.decode_program_name(EngineConfig.from_kwargs(graph_capture="torch.compile")) == "torch.compile"
    assert TpuPlatform().decode_program(EngineConfig.from_kwargs(enforce_eager=True)).name == "xla"
    with pytest.raises(ValueError):
        TpuPlatform().decode_program(EngineConfig.from_kwargs(graph_capture="cuda_graphs"))


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
        self.pad_slot_id, self.attention_backend = None, None
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
    wrapped = CudaGraphProgram(lambda: mod).build(make_forward(mod, kv_graph, log), runner)
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
    wrapped = CudaGraphProgram(lambda: mod).build(make_forward(mod, kv, log), FakeRunner())
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
    assert CudaGraphProgram(lambda: FakeGraphModule()).build(forward, FakeRunner(attention_backend=NoGraphs)) is forward
    assert DecodeProgram().build(forward, None) is forward


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
