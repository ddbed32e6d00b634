"""CUDA-graph capture of decode steps (CUDA, and ROCm through HIP graphs: same torch.cuda API).

How it works
------------
* Capture sizes: 1, 2, 4, then every multiple of 8 up to min(max_num_seqs, 512), plus that cap.
* Static buffers sized for the largest capture size live on the device: input ids, positions,
  seq_lens, block tables [max_size, max_blocks_per_seq], slot mapping, and a fixed
  query_start_loc = arange (a decode-only batch has one query token per sequence).
* One graph per size is captured (largest first, sharing one memory pool) the first time a
  decode-only batch arrives, or eagerly through `CudaGraphRunner.capture_all()`.
* A decode-only batch (every sequence has query length 1) of n <= the largest size is padded
  to the next captured size B: its tensors are copied into the static buffers and the graph is
  replayed; rows [:n] of its output are returned (a copy). Padding rows either
  - use the model view's `pad_slot_id` (a KV slot no sequence owns, e.g. in a reserved null block):
    seq_len 1, block table -> that block; or, when it has none,
  - repeat the last real row exactly (same token, position, context, slot): they compute the
    same key/value as that row and write it to the same slot, so nothing is disturbed.
* Anything else (prefill chunks, mixed batches, more tokens than the largest size, block tables
  wider than max_blocks_per_seq) runs the eager forward.

What the attention backend must honour to be replayable (declare "cuda_graphs" in
`supported_graph_modes`): read per-sequence values only from the metadata's device tensors;
the host-side fields (num_seqs, num_decodes, max_query_len, max_seq_len, *_cpu lists) are
fixed at capture to the padded size and upper bounds (max_seq_len = max_blocks_per_seq *
block_size) and may only be used as such.

What it reads of the ModelView (platforms/interface.py): max_num_seqs, block_size,
max_blocks_per_seq, device, pad_slot_id, and attention_backend (if it does not list "cuda_graphs" in
supported_graph_modes, `build` returns the eager forward). Graphs are captured lazily at the
first decode batch, replicating one of its real rows (so the warm-up writes only what that row
writes anyway); `capture_all()` may also be called at start-up, before any KV is live.
"""
from __future__ import annotations

import bisect
import logging
from typing import Any, Callable, Optional

import torch

from tokenmill.attention_backends.interface import AttentionMetadata

from .interface import DecodeProgram, ModelView

logger = logging.getLogger("tokenmill.platforms.cuda_graphs")

MAX_CAPTURE_SIZE = 512


def cuda_graph_capture_sizes(max_num_seqs: int, max_size: int = MAX_CAPTURE_SIZE) -> list[int]:
    """Batch sizes to capture, ascending: 1, 2, 4, 8, 16, 24, ... up to min(max_num_seqs, max_size)."""
    cap = max(1, min(int(max_num_seqs), int(max_size)))
    base = [1, 2, 4] + list(range(8, cap + 1, 8))
    sizes = sorted({s for s in base if s <= cap} | {cap})
    return sizes


def padded_batch_size(n: int, sizes: list[int]) -> Optional[int]:
    """The smallest captured size >= n, or None when n exceeds them all."""
    i = bisect.bisect_left(sizes, n)
    return sizes[i] if i < len(sizes) else None


def is_decode_only(meta: AttentionMetadata, num_tokens: int) -> bool:
    num_seqs = meta.num_seqs
    return num_seqs > 0 and meta.num_decodes == num_seqs == num_tokens and meta.max_query_len == 1


def _first_row(meta: AttentionMetadata) -> AttentionMetadata:
    return AttentionMetadata(
        query_start_loc=meta.query_start_loc[:2], seq_lens=meta.seq_lens[:1], block_tables=meta.block_tables[:1],
        slot_mapping=meta.slot_mapping[:1], num_decodes=1, max_query_len=1, max_seq_len=meta.max_seq_len,
        block_size=meta.block_size, query_start_loc_cpu=[0, 1], seq_lens_cpu=list(meta.seq_lens_cpu[:1]))


class CudaGraphRunner:
    """The callable `CudaGraphProgram.build` returns: replays graphs for decode batches."""

    def __init__(self, forward: Callable[..., torch.Tensor], runner: ModelView, sizes: list[int],
                 device_module: Callable[[], Any] = lambda: torch.cuda, num_warmups: int = 1) -> None:
        self.forward = forward
        self.sizes = list(sizes)
        self.max_size = self.sizes[-1]
        self.block_size = int(runner.block_size)
        self.max_blocks_per_seq = int(runner.max_blocks_per_seq)
        self.device = torch.device(runner.device)
        pad = runner.pad_slot_id
        self.pad_slot_id: Optional[int] = None if pad is None else int(pad)
        self._mod = device_module
        self.num_warmups = num_warmups
        self.graphs: dict[int, Any] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.metadata: dict[int, AttentionMetadata] = {}
        self.captured = False
        self.capture_failed: Optional[str] = None
        self.num_replays = 0
        self.num_eager = 0
        self._buffers_ready = False

    # ------------------------------------------------------------------ buffers and metadata
    def _alloc(self) -> None:
        m, w, dev = self.max_size, self.max_blocks_per_seq, self.device
        self.input_ids = torch.zeros(m, dtype=torch.long, device=dev)
        self.positions = torch.zeros(m, dtype=torch.long, device=dev)
        self.query_start_loc = torch.arange(m + 1, dtype=torch.int32, device=dev)
        self.seq_lens = torch.ones(m, dtype=torch.int32, device=dev)
        pad_slot = self.pad_slot_id or 0
        self.pad_block = pad_slot // self.block_size
        self.block_tables = torch.full((m, w), self.pad_block, dtype=torch.int32, device=dev)
        self.slot_mapping = torch.full((m,), pad_slot, dtype=torch.long, device=dev)
        max_seq_len = w * self.block_size
        for b in self.sizes:
            self.metadata[b] = AttentionMetadata(
                query_start_loc=self.query_start_loc[: b + 1], seq_lens=self.seq_lens[:b],
                block_tables=self.block_tables[:b], slot_mapping=self.slot_mapping[:b],
                num_decodes=b, max_query_len=1, max_seq_len=max_seq_len, block_size=self.block_size,
                query_start_loc_cpu=list(range(b + 1)), seq_lens_cpu=[max_seq_len] * b)
        self._buffers_ready = True

    def _fill(self, b: int, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> None:
        n = input_ids.shape[0]
        self.input_ids[:n].copy_(input_ids, non_blocking=True)
        self.positions[:n].copy_(positions, non_blocking=True)
        self.seq_lens[:n].copy_(meta.seq_lens, non_blocking=True)
        self.slot_mapping[:n].copy_(meta.slot_mapping, non_blocking=True)
        bt = meta.block_tables
        width = bt.shape[1]
        self.block_tables[:n, :width].copy_(bt[:n], non_blocking=True)
        if width < self.max_blocks_per_seq:
            self.block_tables[:n, width:].fill_(self.pad_block)
        if b > n:
            if self.pad_slot_id is not None:
                self.input_ids[n:b].zero_()
                self.positions[n:b].zero_()
                self.seq_lens[n:b].fill_(1)
                self.slot_mapping[n:b].fill_(self.pad_slot_id)
                self.block_tables[n:b].fill_(self.pad_block)
            else:
                self._repeat_row(n - 1, n, b)

    def _repeat_row(self, src: int, start: int, stop: int) -> None:
        k = stop - start
        for buf in (self.input_ids, self.positions, self.seq_lens, self.slot_mapping):
            buf[start:stop].copy_(buf[src].expand(k))
        self.block_tables[start:stop].copy_(self.block_tables[src].expand(k, -1))

    def _capture_inputs(self, template) -> None:
        """What the warm-up and capture runs see: a real row repeated, the pad slot, or (start-up) slot 0."""
        if template is not None:
            ids, pos, meta = template
            self._fill(1, ids[:1], pos[:1], _first_row(meta))
            self._repeat_row(0, 1, self.max_size)
        else:
            self.input_ids.zero_()
            self.positions.zero_()
            self.seq_lens.fill_(1)
            self.block_tables.fill_(self.pad_block)
            self.slot_mapping.fill_(self.pad_slot_id or 0)

    # ---------------------------------------------------------------------------- capture
    def capture_all(self, template: Optional[tuple] = None) -> None:
        """Capture one graph per size, largest first, sharing one memory pool.

        `template` = (input_ids, positions, metadata) of a real decode batch whose first row the
        warm-up replicates; without it (start-up) the warm-up writes to pad_slot_id or slot 0."""
        if self.captured:
            return
        mod = self._mod()
        if not self._buffers_ready:
            with torch.inference_mode(False):   # normal tensors: updatable in and out of inference mode
                self._alloc()
        with torch.inference_mode():
            self._capture_inputs(template)
            mod.synchronize()
            pool = mod.graph_pool_handle()
            for b in reversed(self.sizes):
                meta = self.metadata[b]
                args = (self.input_ids[:b], self.positions[:b], meta)
                stream = mod.Stream()
                stream.wait_stream(mod.current_stream())
                with mod.stream(stream):
                    for _ in range(self.num_warmups):
                        self.forward(*args)
                mod.current_stream().wait_stream(stream)
                graph = mod.CUDAGraph()
                with mod.graph(graph, pool=pool):
                    out = self.forward(*args)
                self.graphs[b] = graph
                self.outputs[b] = out
            mod.synchronize()
        self.captured = True
        logger.info("captured %d CUDA graphs for decode batch sizes %s..%s", len(self.graphs),
                    self.sizes[0], self.sizes[-1])

    # ------------------------------------------------------------------------------- call
    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, attn_metadata: AttentionMetadata):
        b = self._replay_size(input_ids, attn_metadata)
        if b is None:
            self.num_eager += 1
            return self.forward(input_ids, positions, attn_metadata)
        if not self.captured:
            try:
                self.capture_all((input_ids, positions, attn_metadata))
            except Exception as exc:   # a backend that cannot be captured: say so once, run eagerly
                self.capture_failed = f"{type(exc).__name__}: {exc}"
                logger.warning("CUDA graph capture failed (%s); running eagerly", self.capture_failed)
                self.graphs.clear()
                self.outputs.clear()
                self.num_eager += 1
                return self.forward(input_ids, positions, attn_metadata)
        n = input_ids.shape[0]
        with torch.inference_mode():
            self._fill(b, input_ids, positions, attn_metadata)
            self.graphs[b].replay()
            out = self.outputs[b][:n].clone()
        self.num_replays += 1
        return out

    def _replay_size(self, input_ids: torch.Tensor, meta: AttentionMetadata) -> Optional[int]:
        if self.capture_failed:
            return None
        n = input_ids.shape[0]
        if n > self.max_size or not is_decode_only(meta, n):
            return None
        if meta.block_tables.shape[1] > self.max_blocks_per_seq:
            return None
        return padded_batch_size(n, self.sizes)


class CudaGraphProgram(DecodeProgram):
    """Decode program "cuda_graphs": `build` returns a CudaGraphRunner."""
    name = "cuda_graphs"

    def __init__(self, device_module: Callable[[], Any] = lambda: torch.cuda,
                 max_capture_size: int = MAX_CAPTURE_SIZE) -> None:
        self._mod = device_module
        self.max_capture_size = max_capture_size

    def build(self, forward: Callable[..., torch.Tensor], model: ModelView) -> Callable[..., torch.Tensor]:
        backend = model.attention_backend
        modes = getattr(backend, "supported_graph_modes", None)
        if modes is not None and self.name not in modes:
            logger.warning("attention backend %r does not support CUDA graphs (supports %s): running eagerly",
                           getattr(backend, "name", backend), list(modes))
            return forward
        sizes = cuda_graph_capture_sizes(model.max_num_seqs, self.max_capture_size)
        return CudaGraphRunner(forward, model, sizes, self._mod)
