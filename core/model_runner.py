"""Turns a scheduled batch into one flattened forward pass over the paged KV cache.

Owns the KV pool (sized by the platform's memory profiler) and the forward callable (built by the
platform's decode program, platforms/interface.py DecodeProgram, from a ModelView). Device-neutral:
every device question goes to the platform.
"""
from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from tokenmill.attention_backends.interface import AttentionMetadata, kv_cache_torch_dtype
from tokenmill.platforms.interface import ModelView

from . import distributed
from .config import EngineConfig
from .kv_groups import KVLayout, MLAKVSpec, kv_layout
from .layers.expert_tokens import ExpertTokenCounter
from .layers.pooler import Pooler
from .pooler_config import PoolerConfig
from .sequence import Sequence
from .state_cache import RecurrentBatch, StateCache, StateLayout, state_layout_of
from .step import ScheduledBatch, StepInputs, StepOutput

logger = logging.getLogger("tokenmill.model_runner")


@dataclass
class StepProfile:
    """Forward passes by the path that ran them (the decode program's name, or "eager"): steps,
    tokens and seconds, split into decode-only steps and the rest."""
    rows: dict[tuple[str, bool], list[float]] = field(default_factory=dict)

    def record(self, path: str, decode_only: bool, tokens: int, seconds: float) -> None:
        row = self.rows.setdefault((path, decode_only), [0, 0, 0.0])
        row[0] += 1
        row[1] += tokens
        row[2] += seconds

    def summary(self) -> list[dict[str, Any]]:
        total = sum(r[2] for r in self.rows.values()) or 1.0
        decode_total = sum(r[2] for (_, d), r in self.rows.items() if d) or 1.0
        return [{"path": path, "decode_only": decode_only, "steps": int(r[0]), "tokens": int(r[1]),
                 "seconds": r[2], "share_of_forward_time": r[2] / total,
                 "share_of_decode_time": r[2] / decode_total if decode_only else None}
                for (path, decode_only), r in sorted(self.rows.items(), key=lambda kv: -kv[1][2])]


class ModelRunner:
    def __init__(self, config: EngineConfig, platform, model: torch.nn.Module, dtype: torch.dtype,
                 pooler_config: Optional[PoolerConfig] = None) -> None:
        self.config = config
        # Set: a pooling run (embeddings): every sequence is pooled, none sampled.
        self.pooler = Pooler(pooler_config.pooling_type, pooler_config.normalize) if pooler_config else None
        self.causal = bool(getattr(model, "is_causal", True))
        self.platform = platform
        self.model = model
        self.lora: Any = None     # the LoRA manager (core/lora/manager.py) when adapters are enabled
        self.dtype = dtype
        self.device = platform.device()
        self.block_size = config.cache.block_size
        self.max_num_seqs = config.scheduler.max_num_seqs
        self.max_model_len = config.model.max_model_len
        self.max_blocks_per_seq = math.ceil(self.max_model_len / self.block_size)
        self.layers = list(model.attention_layers)
        impl = self.layers[0].impl
        self.num_kv_heads, self.head_size = impl.num_kv_heads, impl.head_size
        self.backend_cls = type(impl)
        # The backend validated the name (its supported_kv_cache_dtypes); "auto" = model dtype.
        self.kv_cache_dtype = kv_cache_torch_dtype(config.cache.kv_cache_dtype, dtype)
        # Layers grouped by attention type, so sliding layers hold only their window (core/kv_groups.py);
        # a pipeline stage holds some of the layers, so stages keep one group.
        self.kv_layout: KVLayout = kv_layout(
            [layer.sliding_window for layer in self.layers],
            hybrid=config.parallel.pipeline_parallel_size == 1 and self.causal
            and not config.cache.disable_hybrid_kv_cache_manager)

        # A layer's own cache geometry where it is not keys and values per KV head (MLA's latent rows).
        self.kv_spec: Optional[MLAKVSpec] = getattr(self.layers[0], "kv_spec", None)
        self.bytes_per_block = self._bytes_per_block()
        # Recurrent layers (linear attention, state-space): a state per sequence slot, from the same budget.
        recurrent = state_layout_of(model)
        self.recurrent_layers, self.state_layout = recurrent if recurrent else ([], None)
        self.state_cache: Optional[StateCache] = None
        override = config.cache.num_gpu_blocks_override
        if override is not None:
            self.num_blocks = override
        else:
            self.num_blocks = platform.memory_profiler().num_kv_blocks(
                config, self.bytes_per_block, self._profile_forward)
        self.num_state_checkpoints = 0      # prefix-cache state checkpoints, slots after the sequences'
        self.num_state_slots = self._carve_state_slots(override is None) if self.state_layout else 0
        # Every rank holds the same block ids: the smallest pool any rank can afford wins.
        self.num_blocks = distributed.min_over_ranks(self.num_blocks)
        if self.num_blocks <= 0:
            raise ValueError(
                f"no room for the KV cache: one block needs {self.bytes_per_block} bytes "
                f"(raise kv_cache_memory / gpu_memory_utilization)")
        self._allocate_kv_cache(self.num_blocks)
        if self.kv_spec is not None:
            element = torch.empty((), dtype=self.kv_cache_dtype).element_size()
            logger.info(self.kv_spec.describe(element, len(self.layers)))
        if self.kv_layout.hybrid:
            logger.info(self.kv_layout.describe(self.num_blocks, self.block_size, self.bytes_per_block,
                                                self.max_model_len))
        # Graph capture is for decode steps (captured graphs, the fused decode step); a pooling run
        # has none, only prefills, so it runs eagerly whatever the platform captures.
        self.decode_program = platform.decode_program(config)
        one_table = self.kv_layout.hybrid and not self.decode_program.reads_kv_groups
        if one_table and self.pooler is None:
            self.decode_program.eager_reason = "hybrid KV groups: a block table per layer group"
        if self.state_layout is not None and self.decode_program.name != "none":
            kinds = "/".join(sorted({s.kind for s in self.state_layout.specs}))
            self.decode_program.eager_reason = (f"{len(self.recurrent_layers)} recurrent ({kinds}) layers: no decode "
                                                "program carries their per-sequence state yet")
        eager = (one_table and self.pooler is None) or self.state_layout is not None
        if eager and self.decode_program.eager_reason:
            logger.info("%s: running the model eagerly: %s", self.decode_program.name, self.decode_program.eager_reason)
        self.forward = (self._forward_eager if self.pooler is not None or eager
                        else self.decode_program.build(self._forward_eager, self.model_view()))
        self.profile: Optional[StepProfile] = None     # set by `bench --profile`: where step time goes
        # Tokens per expert of each MoE layer (the metric), counted on the first tp rank of each stage
        # (the others route the same tokens); attached after profiling, so only real steps count.
        self.expert_tokens = None if distributed.tp_rank() != 0 else ExpertTokenCounter.attach(
            model, max(config.scheduler.max_num_batched_tokens or 0, self.max_num_seqs), self.device)
        self._replays_seen = 0

    def fast_path_report(self) -> dict[str, Any]:
        """Which decode program runs this model (or why it runs eagerly) and the kernels each op kind
        reached: what `tokenmill bench throughput --profile` prints."""
        from .layers.kernels import LAYER_KINDS
        layers: dict[str, str] = {}
        methods: dict[str, list[str]] = {}
        for module in self.model.modules():
            for kind, cls in LAYER_KINDS.items():
                kernel = getattr(module, "_kernel", None)
                if isinstance(module, cls) and kernel is not None:
                    layers[kind] = getattr(kernel, "name", type(kernel).__name__)
            method = getattr(module, "quant_method", None)
            if method is not None and type(method).__name__ not in methods:
                methods[type(method).__name__] = method.kernels.offered()
        took = self.forward != self._forward_eager     # bound methods: compared by ==, never `is`
        impl = self.layers[0].impl
        return {"decode_program": self.decode_program.name, "took_the_model": took,
                "eager_reason": None if took else (
                    self.decode_program.eager_reason
                    or ("the platform's default is eager" if self.decode_program.name == "none" else None)),
                "attention_backend": impl.name,
                "native_decode_attention": bool(
                    getattr(impl, "native_decode_fn", lambda _: None)(self.layers[0].kv_cache)),
                "layer_kernels": layers, "quantization_kernels": methods}

    def model_view(self) -> ModelView:
        """What the platform's decode program may read of the model and the pool."""
        parallel = self.config.parallel
        return ModelView(model=self.model, attention_layers=self.layers, attention_backend=self.backend_cls,
                         num_blocks=self.num_blocks, block_size=self.block_size,
                         max_blocks_per_seq=self.max_blocks_per_seq, max_num_seqs=self.max_num_seqs,
                         device=torch.device(self.device), world_size=parallel.world_size)

    # ------------------------------------------------------------------ KV pool and state slots
    def _carve_state_slots(self, from_budget: bool) -> int:
        """Sequence slots for the recurrent layers' states, taken from the KV budget (up to half of it;
        with num_gpu_blocks_override, beside the blocks): max_num_seqs is capped at the slots. With
        prefix caching, checkpoint slots for cached prefixes' states too (up to a quarter more)."""
        layout: StateLayout = self.state_layout
        budget = self.num_blocks * self.bytes_per_block
        slots = layout.num_slots(budget, self.max_num_seqs) if from_budget else self.max_num_seqs
        if slots <= 0:
            raise ValueError(f"no room for one sequence's recurrent state ({layout.bytes_per_seq} bytes) in the "
                             f"{budget} bytes of cache memory (raise kv_cache_memory / gpu_memory_utilization)")
        if self.config.cache.enable_prefix_caching:
            self.num_state_checkpoints = (layout.num_checkpoints(budget, slots) if from_budget
                                          else layout.num_checkpoints(1 << 62, slots))
        if from_budget:
            used = (slots + self.num_state_checkpoints) * layout.bytes_per_seq
            self.num_blocks = (budget - used) // self.bytes_per_block
        logger.info(layout.describe(slots, budget, self.max_num_seqs, self.num_state_checkpoints))
        self.max_num_seqs = self.config.scheduler.max_num_seqs = min(self.max_num_seqs, slots)
        self.state_cache = StateCache(self.recurrent_layers, layout, slots + self.num_state_checkpoints,
                                      self.platform.zeros)
        return slots

    def _kv_shape(self, num_blocks: int) -> tuple[int, ...]:
        if self.kv_spec is not None:
            return self.kv_spec.cache_shape(num_blocks, self.block_size)
        return self.backend_cls.kv_cache_shape(num_blocks, self.block_size, self.num_kv_heads, self.head_size)

    def _bytes_per_block(self) -> int:
        element = torch.empty((), dtype=self.kv_cache_dtype).element_size()
        return math.prod(self._kv_shape(1)) * element * self.kv_layout.group_size

    def _allocate_kv_cache(self, num_blocks: int) -> None:
        shape = self._kv_shape(num_blocks)
        # Zeros, not empty: masked-out slots (and a hybrid layout's null block) must never hold NaN bit patterns.
        tensors = [self.platform.zeros(shape, self.kv_cache_dtype) for _ in range(self.kv_layout.group_size)]
        tensor_of, group_of = self.kv_layout.tensor_of_layer(), self.kv_layout.group_of_layer()
        for i, layer in enumerate(self.layers):
            layer.kv_cache = tensors[tensor_of[i]]
            layer.kv_group = group_of[i]

    def _profile_forward(self) -> None:
        """One dummy forward at the step's token budget, for profilers that measure peak memory."""
        num_tokens = min(self.config.scheduler.max_num_batched_tokens, self.max_model_len)
        num_blocks = math.ceil(num_tokens / self.block_size)
        saved = [layer.kv_cache for layer in self.layers]
        self._allocate_kv_cache(num_blocks)
        meta = self._metadata([num_tokens], [num_tokens], [list(range(num_blocks))],
                              list(range(num_tokens)), num_decodes=0)
        if self.state_layout is not None:      # one slot's state, dropped with this pass
            StateCache(self.recurrent_layers, self.state_layout, 1, self.platform.zeros)
            meta.state = RecurrentBatch([0], [0], torch.zeros(1, dtype=torch.long, device=self.device))
        ids = torch.zeros(num_tokens, dtype=torch.long, device=self.device)
        pos = torch.arange(num_tokens, dtype=torch.long, device=self.device)
        with torch.inference_mode():
            hidden = self._forward_eager(ids, pos, meta)
            if self.pooler is None:
                self.model.compute_logits(hidden[-min(num_tokens, self.max_num_seqs):])
        self.platform.synchronize()
        for layer, cache in zip(self.layers, saved):
            layer.kv_cache = cache

    # ------------------------------------------------------------------ a step
    def _forward_eager(self, input_ids: torch.Tensor, positions: torch.Tensor,
                       attn_metadata: AttentionMetadata) -> torch.Tensor:
        return self.model(input_ids, positions, attn_metadata)

    def _metadata(self, query_lens: list[int], seq_lens: list[int], block_tables: list[list[int]],
                  slots: "list[int] | torch.Tensor", num_decodes: int) -> AttentionMetadata:
        qsl = [0]
        for n in query_lens:
            qsl.append(qsl[-1] + n)
        width = max(len(bt) for bt in block_tables)
        padded = [bt + [0] * (width - len(bt)) for bt in block_tables]
        dev = self.device
        return AttentionMetadata(
            query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=dev),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
            block_tables=torch.tensor(padded, dtype=torch.int32, device=dev),
            slot_mapping=(slots if isinstance(slots, torch.Tensor)
                          else torch.tensor(slots, dtype=torch.long, device=dev)),
            num_decodes=num_decodes, max_query_len=max(query_lens), max_seq_len=max(seq_lens),
            block_size=self.block_size, query_start_loc_cpu=qsl, seq_lens_cpu=list(seq_lens), causal=self.causal)

    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch) -> StepOutput:
        return self.execute_inputs(StepInputs.from_batch(batch), [seq for seq, _ in batch.entries])

    @torch.inference_mode()
    def execute_inputs(self, inputs: StepInputs, seqs: Optional[list[Sequence]] = None) -> StepOutput:
        """One forward over `inputs` (`seqs`: the batch's sequences, in-process, for pooling)."""
        step = self.prepare(inputs)
        if self.profile is None:
            return self.finish(step, self.count_experts(step, self.forward(step.input_ids, step.positions,
                                                                           step.metadata)), seqs)
        start = time.perf_counter()
        hidden = self.count_experts(step, self.forward(step.input_ids, step.positions, step.metadata))
        path = getattr(self.forward, "last_path", None) or (
            "eager" if self.forward == self._forward_eager else self.decode_program.name)
        self.profile.record(path, inputs.num_decodes == len(inputs.entries), len(step.input_ids),
                            time.perf_counter() - start)
        return self.finish(step, hidden, seqs)

    def count_experts(self, step: "PreparedStep", hidden: torch.Tensor) -> torch.Tensor:
        """After a step's forward: its tokens' expert picks into the counts (no-op without MoE layers)."""
        if self.expert_tokens is not None:
            replays = getattr(self.forward, "num_replays", 0)       # a graph runner's (platforms/cuda_graphs.py)
            self.expert_tokens.collect(step.total_rows, replayed=replays != self._replays_seen)
            self._replays_seen = replays
        return hidden

    def prepare(self, inputs: StepInputs) -> "PreparedStep":
        """Flatten the entries into the forward's tensors and note which rows are read after it."""
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        query_lens: list[int] = []
        seq_lens: list[int] = []
        tables: list[list[int]] = []
        groups = len(self.kv_layout.groups)
        group_tables: list[list[list[int]]] = [[] for _ in range(groups - 1)]
        group_slots: list[list[int]] = [[] for _ in range(groups - 1)]
        step = PreparedStep()
        row = 0
        for index, entry in enumerate(inputs.entries):
            start, n = entry.start, entry.num_tokens
            end = start + n
            table = entry.block_table
            input_ids.extend(entry.token_ids)
            positions.extend(range(start, end))
            slots.extend(table[p // bs] * bs + p % bs for p in range(start, end))
            query_lens.append(n)
            seq_lens.append(end)
            tables.append(table)
            for g, other in enumerate(entry.group_tables[:groups - 1]):
                group_tables[g].append(other)
                group_slots[g].extend(other[p // bs] * bs + p % bs for p in range(start, end))
            if entry.pooling:                          # prefill only: pooled, never sampled
                step.pooling_chunks.append((index, start, row, n))
            elif entry.sample_rows:                    # the last row, or one per verified draft
                step.sample_rows.extend(range(row + n - entry.sample_rows, row + n))
                step.sampled.append(index)
                step.num_rows.append(entry.sample_rows)
            if entry.prompt_logprob_rows > 0:
                step.prompt_rows.append((index, start, row, entry.prompt_logprob_rows))
            row += n
        step.total_rows = row
        dev = self.device
        # One host-to-device copy for the three per-token rows (a decode step is short enough
        # that each tensor built costs measurably).
        step.input_ids, step.positions, slots_t = torch.tensor([input_ids, positions, slots], dtype=torch.long,
                                                               device=dev)
        step.metadata = self._metadata(query_lens, seq_lens, tables, slots_t, inputs.num_decodes)
        if groups > 1:
            step.metadata.groups = [step.metadata] + [
                self._metadata(query_lens, seq_lens, group_tables[g], group_slots[g], inputs.num_decodes)
                for g in range(groups - 1)]
        if self.state_cache is not None:     # each entry's state slot, checked against what it holds
            step.metadata.state = self.state_cache.batch(
                [e.state_slot for e in inputs.entries], [e.start for e in inputs.entries],
                query_lens, inputs.num_decodes, dev, [e.state_restore for e in inputs.entries],
                [e.state_save for e in inputs.entries])
        if self.lora is not None:      # one mapping per step: which rows run on which adapter slot
            self.lora.set_mapping([(entry.lora_slot, entry.num_tokens) for entry in inputs.entries])
        return step

    def finish(self, step: "PreparedStep", hidden: torch.Tensor, seqs: Optional[list[Sequence]] = None) -> StepOutput:
        """Logits of the sampled rows (and prompt-logprob rows), pooled vectors: from the final hidden states."""
        logits = None
        if step.sample_rows:
            if len(step.sample_rows) == step.total_rows:    # every row sampled (decode): no gather
                logits = self.model.compute_logits(hidden).float()
            else:
                index = torch.tensor(step.sample_rows, dtype=torch.long, device=self.device)
                logits = self.model.compute_logits(hidden.index_select(0, index)).float()
        prompt_logits = [(i, start, self.model.compute_logits(hidden[first:first + count]).float())
                         for i, start, first, count in step.prompt_rows]
        pooled = []
        if step.pooling_chunks:
            assert seqs is not None, "pooling runs in the engine's process (its state lives on the sequence)"
            pooled = self.pooler(hidden, [(seqs[i], start, first, n) for i, start, first, n in step.pooling_chunks])
        num_rows = step.num_rows if len(step.sample_rows) != len(step.sampled) else None
        return StepOutput(logits=logits, sampled=step.sampled, num_rows=num_rows, prompt_logits=prompt_logits,
                          pooled=pooled,
                          expert_tokens=None if self.expert_tokens is None else self.expert_tokens.counts)


@dataclass
class PreparedStep:
    """A step flattened for the forward, and the rows read after it (by entry index)."""
    input_ids: Any = None
    positions: Any = None
    metadata: Any = None
    total_rows: int = 0
    sample_rows: list[int] = field(default_factory=list)
    sampled: list[int] = field(default_factory=list)
    num_rows: list[int] = field(default_factory=list)
    prompt_rows: list[tuple[int, int, int, int]] = field(default_factory=list)   # entry, start, first row, rows
    pooling_chunks: list[tuple[int, int, int, int]] = field(default_factory=list)
