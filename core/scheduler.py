"""Decides, each step, which sequences run and how many tokens each computes.

One token budget per step (`max_num_batched_tokens`): running decodes first, then running
prefill chunks, then new prefills from the waiting queue (chunked when they do not fit).
When the KV pool runs dry, the lowest-priority running sequence is preempted: its blocks are
freed and it goes back to the waiting queue to be recomputed (its prefix may still be cached).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from .block_manager import BlockManager
from .config import SchedulerConfig
from .sequence import Sequence, SequenceStatus


@dataclass
class ScheduledBatch:
    # (sequence, number of new tokens) — decodes first, then prefill chunks
    entries: list[tuple[Sequence, int]] = field(default_factory=list)
    num_decodes: int = 0
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.entries)

    def __bool__(self) -> bool:
        return bool(self.entries)


class Scheduler:
    def __init__(self, config: SchedulerConfig, block_manager: BlockManager, max_model_len: int) -> None:
        self.config = config
        self.block_manager = block_manager
        self.max_model_len = max_model_len
        self.waiting: list[Sequence] = []
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    # ------------------------------------------------------------------ queues
    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)
        if self.config.policy == "priority":
            self.waiting.sort(key=Sequence.sort_key)

    def finish(self, seq: Sequence) -> None:
        """Remove a sequence wherever it is and release its blocks."""
        if seq.status == SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status == SequenceStatus.WAITING and seq in self.waiting:
            self.waiting.remove(seq)
        self.block_manager.free(seq)
        seq.status = SequenceStatus.FINISHED

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # ------------------------------------------------------------------ the step
    def schedule(self) -> ScheduledBatch:
        budget = self.config.max_num_batched_tokens
        threshold = self.config.long_prefill_token_threshold or None
        batch = ScheduledBatch()
        entries: list[tuple[Sequence, int]] = []

        # 1. Running sequences: decodes first, then unfinished prefill chunks.
        ordered = sorted(self.running, key=lambda s: 0 if s.num_uncomputed_tokens == 1 else 1)
        scheduled_ids: set[int] = set()
        for seq in ordered:
            if seq.status != SequenceStatus.RUNNING or seq.seq_id in scheduled_ids:
                continue  # preempted earlier in this loop
            if budget <= 0:
                break
            num_new = min(seq.num_uncomputed_tokens, budget)
            if threshold:
                num_new = min(num_new, threshold)
            if not self._make_room(seq, num_new, batch, scheduled_ids):
                continue   # seq itself was preempted
            self.block_manager.allocate(seq, num_new)
            entries.append((seq, num_new))
            scheduled_ids.add(seq.seq_id)
            budget -= num_new

        # 2. New prefills, unless this step already had to preempt.
        pending = self._blocks_being_computed() if self.block_manager.enable_prefix_caching else set()
        while (self.waiting and budget > 0 and not batch.preempted
               and len(self.running) < self.config.max_num_seqs):
            seq = self.waiting[0]
            if not seq.block_table:
                self.block_manager.match_prefix(seq)
            if pending and self._waits_for_pending_prefix(seq, pending):
                # Its next block is being computed by a running sequence: admitted next step,
                # it reuses that block instead of computing the same prefix a second time.
                self._undo_prefix_match(seq)
                break
            num_new = seq.num_uncomputed_tokens
            if threshold:
                num_new = min(num_new, threshold)
            if num_new > budget:
                if not self.config.enable_chunked_prefill:
                    break
                num_new = budget
            if not self.block_manager.can_allocate(seq, num_new):
                self._undo_prefix_match(seq)
                break
            self.waiting.pop(0)
            if self.block_manager.enable_prefix_caching:
                pending.update(self._uncomputed_prompt_hashes(seq))
            self.block_manager.allocate(seq, num_new)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            entries.append((seq, num_new))
            scheduled_ids.add(seq.seq_id)
            budget -= num_new

        # Attention backends take query-length-1 rows (decodes) first.
        decodes = [e for e in entries if e[1] == 1]
        batch.entries = decodes + [e for e in entries if e[1] != 1]
        batch.num_decodes = len(decodes)
        return batch

    def _uncomputed_prompt_hashes(self, seq: Sequence) -> list[int]:
        hashes = self.block_manager.full_block_hashes(seq)[:seq.num_prompt_tokens // self.block_manager.block_size]
        return hashes[seq.num_computed_tokens // self.block_manager.block_size:]

    def _blocks_being_computed(self) -> set[int]:
        pending: set[int] = set()
        for seq in self.running:
            if seq.num_computed_tokens < seq.num_prompt_tokens:
                pending.update(self._uncomputed_prompt_hashes(seq))
        return pending

    def _waits_for_pending_prefix(self, seq: Sequence, pending: set[int]) -> bool:
        hashes = self.block_manager.full_block_hashes(seq)
        nxt = len(seq.block_table)
        return nxt < (seq.num_tokens - 1) // self.block_manager.block_size and hashes[nxt] in pending

    def _undo_prefix_match(self, seq: Sequence) -> None:
        """A waiting sequence that could not be admitted must not pin cached blocks meanwhile."""
        if seq.block_table:
            self.block_manager.free(seq)
            seq.num_cached_tokens = 0

    def _make_room(self, seq: Sequence, num_new: int, batch: ScheduledBatch, scheduled_ids: set[int]) -> bool:
        """Preempt lowest-priority running sequences until `seq` fits. False if `seq` itself was preempted."""
        while not self.block_manager.can_allocate(seq, num_new):
            candidates = [s for s in self.running if s.seq_id not in scheduled_ids]
            victim = max(candidates, key=self._victim_key) if candidates else seq
            self._preempt(victim, batch)
            if victim is seq:
                return False
        return True

    def _victim_key(self, seq: Sequence) -> tuple:
        if self.config.policy == "priority":
            return seq.sort_key()
        return (seq.arrival_time, seq.seq_id)

    def _preempt(self, seq: Sequence, batch: ScheduledBatch) -> None:
        self.running.remove(seq)
        self.block_manager.free(seq)
        seq.num_cached_tokens = 0
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        batch.preempted.append(seq)
        self.waiting.insert(0, seq)
        if self.config.policy == "priority":
            self.waiting.sort(key=Sequence.sort_key)
