"""Graph capture for XLA devices (TPU through torch_xla, Neuron through torch_neuronx's XLA).

XLA compiles one program per distinct set of shapes (and host constants), so every batch is
padded onto a small, fixed set of shapes ("buckets") and each bucket is compiled once, at
start-up ("precompile"), instead of at the first request that happens to hit it:

* tokens are padded to the next bucket (powers of two from `min_bucket` up to
  max_num_batched_tokens); padding tokens belong to no sequence and write their KV to
  `pad_slot_id`;
* sequences are always padded to max_num_seqs (padding sequences have zero query tokens and
  seq_len 0), block tables to [max_num_seqs, max_blocks_per_seq];
* host-side metadata is fixed per bucket: max_query_len = bucket, max_seq_len = max context,
  num_decodes = 0 (every sequence is treated as a generic chunk, which is always true).

The padding itself is plain torch and is unit-tested on the CPU; the compile step needs the
device package and runs only there.

The probe and the XlaPlatform base that TPU and Neuron share live here too.
"""
from __future__ import annotations

import bisect
import logging
from typing import Callable, Optional

import torch

from tokenmill.attention_backends.interface import AttentionMetadata

from . import _probe
from .interface import Availability, DecodeProgram, ModelView, Platform, resolve_dtype

logger = logging.getLogger("tokenmill.platforms.xla")


def token_buckets(max_num_batched_tokens: int, min_bucket: int = 16) -> list[int]:
    """Powers of two from min_bucket until one covers max_num_batched_tokens."""
    limit = max(1, int(max_num_batched_tokens))
    buckets = [max(1, int(min_bucket))]
    while buckets[-1] < limit:
        buckets.append(buckets[-1] * 2)
    return buckets


def bucket_for(n: int, buckets: list[int]) -> Optional[int]:
    i = bisect.bisect_left(buckets, n)
    return buckets[i] if i < len(buckets) else None


def pad_batch(input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata, num_tokens: int,
              num_seqs: int, max_blocks_per_seq: int, pad_slot_id: int):
    """Pad one flattened batch to (num_tokens, num_seqs, max_blocks_per_seq). Pure torch."""
    t, s = input_ids.shape[0], meta.num_seqs
    if t > num_tokens or s > num_seqs or meta.block_tables.shape[1] > max_blocks_per_seq:
        raise ValueError(f"batch ({t} tokens, {s} seqs, {meta.block_tables.shape[1]} blocks/seq) exceeds the "
                         f"bucket ({num_tokens}, {num_seqs}, {max_blocks_per_seq})")
    dev = input_ids.device
    ids = torch.zeros(num_tokens, dtype=input_ids.dtype, device=dev)
    ids[:t] = input_ids
    pos = torch.zeros(num_tokens, dtype=positions.dtype, device=dev)
    pos[:t] = positions
    slots = torch.full((num_tokens,), pad_slot_id, dtype=meta.slot_mapping.dtype, device=dev)
    slots[:t] = meta.slot_mapping
    qsl = torch.full((num_seqs + 1,), t, dtype=meta.query_start_loc.dtype, device=dev)
    qsl[: s + 1] = meta.query_start_loc
    seq_lens = torch.zeros(num_seqs, dtype=meta.seq_lens.dtype, device=dev)
    seq_lens[:s] = meta.seq_lens
    bt = torch.full((num_seqs, max_blocks_per_seq), pad_slot_id // meta.block_size,
                    dtype=meta.block_tables.dtype, device=dev)
    bt[:s, : meta.block_tables.shape[1]] = meta.block_tables
    padded = AttentionMetadata(
        query_start_loc=qsl, seq_lens=seq_lens, block_tables=bt, slot_mapping=slots, num_decodes=0,
        max_query_len=num_tokens, max_seq_len=max_blocks_per_seq * meta.block_size, block_size=meta.block_size,
        query_start_loc_cpu=list(meta.query_start_loc_cpu) + [t] * (num_seqs - s),
        seq_lens_cpu=list(meta.seq_lens_cpu) + [0] * (num_seqs - s))
    return ids, pos, padded


class XlaBucketedRunner:
    """Pads every batch to a bucket, runs the (compiled) forward, returns the real rows."""

    def __init__(self, forward: Callable[..., torch.Tensor], runner: ModelView, buckets: list[int],
                 compile_fn: Optional[Callable[[Callable], Callable]] = None,
                 step_fn: Optional[Callable[[], None]] = None) -> None:
        self.eager_forward = forward
        self.forward = compile_fn(forward) if compile_fn else forward
        self.buckets = list(buckets)
        self.num_seqs = int(runner.max_num_seqs)
        self.block_size = int(runner.block_size)
        self.max_blocks_per_seq = int(runner.max_blocks_per_seq)
        self.device = torch.device(runner.device)
        self.pad_slot_id = int(runner.pad_slot_id or 0)
        self._step = step_fn or (lambda: None)
        self.compiled_buckets: set[int] = set()

    def precompile(self) -> None:
        """Run every bucket once with padding only, so the compile happens at start-up."""
        for t in self.buckets:
            empty = AttentionMetadata(
                query_start_loc=torch.zeros(1, dtype=torch.int32, device=self.device),
                seq_lens=torch.zeros(0, dtype=torch.int32, device=self.device),
                block_tables=torch.zeros((0, self.max_blocks_per_seq), dtype=torch.int32, device=self.device),
                slot_mapping=torch.zeros(0, dtype=torch.long, device=self.device), num_decodes=0,
                max_query_len=0, max_seq_len=0, block_size=self.block_size,
                query_start_loc_cpu=[0], seq_lens_cpu=[])
            ids = torch.zeros(0, dtype=torch.long, device=self.device)
            self._run(t, ids, ids.clone(), empty)
        logger.info("precompiled %d XLA buckets: %s", len(self.buckets), self.buckets)

    def _run(self, bucket: int, input_ids, positions, meta):
        ids, pos, padded = pad_batch(input_ids, positions, meta, bucket, self.num_seqs, self.max_blocks_per_seq,
                                     self.pad_slot_id)
        out = self.forward(ids, pos, padded)
        self._step()
        self.compiled_buckets.add(bucket)
        return out[: input_ids.shape[0]]

    def __call__(self, input_ids, positions, attn_metadata):
        bucket = bucket_for(input_ids.shape[0], self.buckets)
        if bucket is None or attn_metadata.num_seqs > self.num_seqs:
            logger.warning("batch of %d tokens is beyond the largest bucket %d: compiling a new shape",
                           input_ids.shape[0], self.buckets[-1])
            return self.eager_forward(input_ids, positions, attn_metadata)
        return self._run(bucket, input_ids, positions, attn_metadata)


class XlaBucketedProgram(DecodeProgram):
    """Decode program "xla": bucketed padded shapes, precompiled at start-up."""
    name = "xla"

    def __init__(self, min_bucket: int = 16, precompile: bool = True,
                 compile_fn: Optional[Callable[[Callable], Callable]] = None,
                 step_fn: Optional[Callable[[], None]] = None, max_num_batched_tokens: int = 2048) -> None:
        self.min_bucket = min_bucket
        self.precompile = precompile
        self.compile_fn = compile_fn
        self.step_fn = step_fn
        self.max_num_batched_tokens = max_num_batched_tokens

    def build(self, forward: Callable[..., torch.Tensor], model: ModelView) -> Callable[..., torch.Tensor]:
        buckets = token_buckets(self.max_num_batched_tokens, self.min_bucket)
        wrapped = XlaBucketedRunner(forward, model, buckets, self.compile_fn, self.step_fn)
        if self.precompile:
            wrapped.precompile()
        return wrapped


def xla_mark_step() -> None:
    import torch_xla.core.xla_model as xm
    xm.mark_step()


def openxla_compile(forward: Callable) -> Callable:
    """torch.compile with the openxla dynamo backend when torch_xla registered it; else lazy tracing."""
    try:
        from torch._dynamo import list_backends
        if "openxla" in list_backends(exclude_tags=()):
            return torch.compile(forward, backend="openxla", fullgraph=False, dynamic=False)
    except Exception as exc:  # pragma: no cover - only on XLA hosts
        logger.warning("torch.compile(backend='openxla') unavailable (%s): using lazy-tensor tracing", exc)
    return forward


def probe_xla_runtime(platform: str, package: str, probe_device: Callable[[], Availability]) -> Availability:
    """Availability of an XLA platform whose runtime is `package`: not installed, else `probe_device`.

    `platform.probe()` must never raise, and a broken driver or half-installed runtime raises from
    anywhere in the probe, so the whole probe, the package check included, runs under one guard.
    """
    try:
        # find_spec, not import: importing an XLA runtime can take seconds and grab the device.
        if not _probe.module_present(package):
            return Availability.no(f"{package} is not installed")
        return probe_device()
    except Exception as exc:
        return Availability.no(f"probing {platform} failed: {_probe.exc_text(exc)}")


class XlaPlatform(Platform):
    """What every torch_xla-backed platform shares: one "xla" device, graph capture and collectives."""
    torch_device = "xla"

    def decode_programs(self) -> list[str]:
        return ["xla"]

    def decode_program_name(self, config) -> str:
        return "xla"

    def distributed_backend(self) -> str:
        return "xla"

    def check_and_update_config(self, config) -> None:
        # bfloat16 is what TPU and NeuronCore matmul units run natively, so "auto" means it here.
        resolve_dtype(config.model.dtype, torch.bfloat16)
        if config.model.dtype == "auto":
            config.model.dtype = "bfloat16"

    def device(self) -> torch.device:
        import torch_xla.core.xla_model as xm
        return xm.xla_device()

    def synchronize(self) -> None:
        import torch_xla.core.xla_model as xm
        xm.mark_step()
        xm.wait_device_ops()
