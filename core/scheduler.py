"""Decides, each step, which sequences run and how many tokens each computes, and folds each
step's results back in (`update_from_output`): the one place tokens are appended, finishing is
decided (EOS, stop tokens, stop strings, max_tokens, max_model_len) and blocks are freed.

One token budget per step (`max_num_batched_tokens`): running decodes first, then running
prefill chunks, then new prefills from the waiting queue (chunked when they do not fit).
When the KV pool runs dry, the lowest-priority running sequence is preempted: its blocks are
freed and it goes back to the waiting queue to be recomputed (its prefix may still be cached).

Fair across request groups (`Sequence.group_id`: one HTTP request, all its prompts x n): waiting
sequences are admitted round-robin, the group with the fewest running sequences first, and a group
with nothing running while the slots are full gets one from the group holding the most (beyond its
fair share), so 64 prompts x n=8 of one client cannot keep another client's request waiting.

A model with recurrent layers caches prefixes through state checkpoints at chunk ends: its prefill
chunks end on block boundaries (BlockManager.chunk_for_checkpoints, core/state_cache.py).
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Optional

from .block_manager import BlockManager
from .fair_queue import FairQueue
from .config import SchedulerConfig
from .outputs import CompletionDelta, LogprobsEntry
from .request_checks import pool_problem
from .sampling.prompt_logprobs import compute_prompt_logprobs
from .sequence import Sequence, SequenceStatus
from .step import ScheduledBatch, StepOutput

if TYPE_CHECKING:
    from .sampling.sampler import SamplerOutput


@dataclass
class SequenceUpdate:
    """What one sequence got from a step: a new token (delta) and/or prompt logprobs."""
    seq: Sequence
    delta: Optional[CompletionDelta] = None
    prompt_logprobs: Optional[list[Optional[LogprobsEntry]]] = None
    pooled: Optional[list[float]] = None      # a pooling sequence's vector: it finished this step


@dataclass
class SchedulerStats:
    num_running_seqs: int
    num_waiting_seqs: int
    running_request_ids: set[str]
    waiting_request_ids: set[str]
    kv_cache_usage: float           # 0..1
    prefix_cache_queries: int       # tokens, cumulative
    prefix_cache_hits: int          # tokens, cumulative
    num_preemptions: int            # cumulative
    prompt_tokens: int              # cumulative computed prompt tokens
    generation_tokens: int          # cumulative generated tokens


class Scheduler:
    def __init__(self, config: SchedulerConfig, block_manager: BlockManager, max_model_len: int,
                 eos_token_ids: tuple[int, ...] = ()) -> None:
        self.config = config
        self.block_manager = block_manager
        self.max_model_len = max_model_len
        self.eos_token_ids = frozenset(eos_token_ids)
        self.waiting: list[Sequence] = []
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self.verified: list[tuple[int, int]] = []   # (drafts, accepted) per verification; the engine drains it
        self.num_prompt_tokens = 0
        self.num_generation_tokens = 0
        # Called with each sequence whose blocks are released (finished, aborted, preempted):
        # state kept per sequence elsewhere (a draft model's KV) goes with them.
        self.on_free: Optional[Callable[[Sequence], None]] = None
        # LoRA adapter slots (core/lora/manager.py): taken at admission, given back with the blocks.
        self.lora: Any = None

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
        if self.lora is not None:
            self.lora.release(seq)
        if self.on_free is not None:
            self.on_free(seq)

    def fits_in_pool(self, num_tokens: int) -> Optional[str]:
        """None when a sequence of `num_tokens` can ever be held by the pool, else why not."""
        chunk = self.config.max_num_batched_tokens or num_tokens
        return pool_problem(self.block_manager.blocks_for_tokens(num_tokens, chunk), self.block_manager.num_blocks)

    def reset_prefix_cache(self) -> None:
        self.block_manager.reset_prefix_cache()

    def stats(self) -> SchedulerStats:
        bm = self.block_manager
        return SchedulerStats(
            num_running_seqs=len(self.running), num_waiting_seqs=len(self.waiting),
            running_request_ids={s.request_id for s in self.running},
            waiting_request_ids={s.request_id for s in self.waiting},
            kv_cache_usage=bm.usage, prefix_cache_queries=bm.prefix_cache_queries,
            prefix_cache_hits=bm.prefix_cache_hits, num_preemptions=self.num_preemptions,
            prompt_tokens=self.num_prompt_tokens, generation_tokens=self.num_generation_tokens)

    # ------------------------------------------------------------------ the step
    def schedule(self) -> ScheduledBatch:
        budget = self.config.max_num_batched_tokens
        threshold = self.config.long_prefill_token_threshold or None
        batch = ScheduledBatch()
        entries: list[tuple[Sequence, int]] = []
        self._preempt_for_starved_group(batch)
        num_fair_preemptions = len(batch.preempted)

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
            num_new = self.block_manager.chunk_for_checkpoints(seq, num_new)
            if seq.spec_token_ids:   # drafts ride along when the budget and free blocks allow
                drafts = seq.spec_token_ids[:max(0, budget - num_new)]
                if drafts and not self.block_manager.can_allocate(seq, num_new + len(drafts)):
                    drafts = []
                seq.spec_token_ids = drafts
                num_new += len(drafts)
            if not self._make_room(seq, num_new, batch, scheduled_ids):
                continue   # seq itself was preempted
            self.block_manager.allocate(seq, num_new)
            self.block_manager.plan_state_save(seq, num_new)
            entries.append((seq, num_new))
            scheduled_ids.add(seq.seq_id)
            budget -= num_new

        # 2. New prefills, unless this step already had to preempt for memory; round-robin across groups.
        pending = self._blocks_being_computed() if self.block_manager.enable_prefix_caching else set()
        queue = FairQueue(self.waiting, self.running, self.config.policy == "priority") if (
            self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs) else None
        admitted = False
        while (queue and budget > 0 and len(batch.preempted) == num_fair_preemptions
               and len(self.running) < self.config.max_num_seqs):
            seq = queue.head()
            if not seq.block_table and seq.params.prompt_logprobs is None:
                # Prompt logprobs need the logits of every prompt position: no cache hits for them.
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
            num_new = self.block_manager.chunk_for_checkpoints(seq, num_new)
            if not self.block_manager.can_allocate(seq, num_new):
                self._undo_prefix_match(seq)
                break
            if self.lora is not None and not self.lora.acquire(seq):
                self._undo_prefix_match(seq)      # waits for a free adapter slot; others may go first
                queue.skip()
                continue
            queue.pop()
            admitted = True
            if self.block_manager.enable_prefix_caching:
                pending.update(self._uncomputed_prompt_hashes(seq))
            self.block_manager.allocate(seq, num_new)
            self.block_manager.plan_state_save(seq, num_new)
            seq.status = SequenceStatus.RUNNING
            if not seq.ever_scheduled:
                seq.ever_scheduled = True
                batch.first_scheduled.append(seq)
            self.running.append(seq)
            entries.append((seq, num_new))
            scheduled_ids.add(seq.seq_id)
            budget -= num_new
        if admitted:
            self.waiting = [s for s in self.waiting if s.status == SequenceStatus.WAITING]

        for seq in ordered:            # drafts only ride with their sequence: preempted or left out, void
            if seq.spec_token_ids and (seq.seq_id not in scheduled_ids or seq.status != SequenceStatus.RUNNING):
                seq.spec_token_ids = []
        # Attention backends take query-length-1 rows (decodes) first.
        decodes = [e for e in entries if e[1] == 1]
        batch.entries = decodes + [e for e in entries if e[1] != 1]
        batch.num_decodes = len(decodes)
        return batch

    def _preempt_for_starved_group(self, batch: ScheduledBatch) -> None:
        """The running slots are full and a waiting group has none: the group holding the most slots gives
        up one sequence (its newest), if it holds more than its fair share (max_num_seqs / groups) and is
        not of a more urgent priority. At most one per step: a starved group gets a slot at once, a burst
        of them one per step (each preemption costs a recompute), and a lone request loses nothing."""
        if not self.waiting or len(self.running) < self.config.max_num_seqs:
            return
        held = Counter(s.group_id for s in self.running)
        starved = next((s for s in self.waiting if s.group_id not in held
                        and (self.lora is None or self.lora.can_acquire(s))), None)   # not one waiting for a slot
        if starved is None:
            return
        num_groups = len(held) + len({s.group_id for s in self.waiting} - held.keys())
        share = max(1, self.config.max_num_seqs // num_groups)
        by_priority = self.config.policy == "priority"
        candidates = [s for s in self.running
                      if held[s.group_id] > share and not (by_priority and s.priority < starved.priority)]
        if candidates:
            victim = max(candidates, key=lambda s: (held[s.group_id], self._victim_key(s)))
            self._preempt(victim, batch)

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
        if self.lora is not None:
            self.lora.release(seq)
        if self.on_free is not None:
            self.on_free(seq)
        seq.num_cached_tokens = 0
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        batch.preempted.append(seq)
        self.waiting.insert(0, seq)
        if self.config.policy == "priority":
            self.waiting.sort(key=Sequence.sort_key)

    # ------------------------------------------------------------------ after the forward pass
    def update_from_output(self, batch: ScheduledBatch, result: StepOutput,
                           sampled: Optional["SamplerOutput"]) -> list[SequenceUpdate]:
        """Fold one step's results in: advance computed tokens, register full blocks in the prefix
        cache, append each sampled token (advancing its grammar matcher), detokenize, decide finishing
        (grammar terminated included), free finished sequences.
        Returns one update per sequence that produced something the caller must see."""
        bm = self.block_manager
        for seq, n in batch.entries:
            if seq.spec_token_ids:
                continue           # counted once its drafts are verified (_append_verified)
            if seq.num_computed_tokens < seq.num_prompt_tokens:
                self.num_prompt_tokens += min(n, seq.num_prompt_tokens - seq.num_computed_tokens)
            seq.num_computed_tokens += n
            bm.cache_full_blocks(seq)
            seq.state_restore = -1           # restored before this step
            bm.commit_state_save(seq)
        updates: dict[int, SequenceUpdate] = {}
        for index, start, logits in result.prompt_logits:
            seq = batch.entries[index][0]
            entries = compute_prompt_logprobs(logits, seq.prompt_token_ids, seq.params.prompt_logprobs, start)
            first_new = seq.num_prompt_logprobs_emitted - (start + (0 if start == 0 else 1))
            new = entries[max(0, first_new):]     # recomputed after a preemption: emitted already
            if new:
                seq.num_prompt_logprobs_emitted += len(new)
                updates[seq.seq_id] = SequenceUpdate(seq, prompt_logprobs=new)
        for seq, vector in result.pooled:      # prefill-only sequences end with their prompt
            seq.finish_reason = "stop"
            self.finish(seq)
            updates[seq.seq_id] = SequenceUpdate(seq, CompletionDelta(seq.index, [], "", finish_reason="stop"),
                                                 pooled=vector)
        row = 0
        for seq, num_rows in zip(result.sampled_seqs(batch), result.rows_per_seq()):
            if num_rows == 1:
                delta = self._append_token(seq, sampled, row)
            else:
                delta = self._append_verified(seq, sampled, row, num_rows)
            row += num_rows
            update = updates.get(seq.seq_id)
            if update is None:
                updates[seq.seq_id] = SequenceUpdate(seq, delta=delta)
            else:
                update.delta = delta
        return list(updates.values())

    def _append_verified(self, seq: Sequence, sampled: "SamplerOutput", row: int, num_rows: int) -> CompletionDelta:
        """A sequence that verified drafts: append the sampled tokens while they agree with the
        drafts (the first that does not, or the bonus token after the last draft, ends the step)."""
        drafts, seq.spec_token_ids = seq.spec_token_ids, []
        merged: Optional[CompletionDelta] = None
        accepted = 0
        for j in range(num_rows):
            delta = self._append_token(seq, sampled, row + j)
            if merged is None:
                merged = delta
            else:
                merged.token_ids += delta.token_ids
                merged.text += delta.text
                if delta.logprobs is not None and merged.logprobs is not None:
                    merged.logprobs += delta.logprobs
                merged.cumulative_logprob = delta.cumulative_logprob
                merged.finish_reason, merged.stop_reason = delta.finish_reason, delta.stop_reason
            if seq.is_finished or j == len(drafts) or delta.token_ids[0] != drafts[j]:
                break
            accepted += 1
        self.verified.append((len(drafts), accepted))
        if not seq.is_finished:   # the accepted drafts' KV is in place; the newest token's is not
            seq.num_computed_tokens = seq.num_tokens - 1
            self.block_manager.cache_full_blocks(seq)
        assert merged is not None
        return merged

    def _append_token(self, seq: Sequence, sampled: "SamplerOutput", row: int) -> CompletionDelta:
        params = seq.params
        token = sampled.token_ids[row]
        seq.token_ids.append(token)
        self.num_generation_tokens += 1
        logprobs = None
        if seq.cumulative_logprob is not None and sampled.top_logprobs[row] is not None:
            logprobs = [sampled.top_logprobs[row]]
            seq.cumulative_logprob += sampled.sampled_logprobs[row]
        stop_str = seq.detokenizer.append([token]) if seq.detokenizer is not None else None
        num_out = seq.num_output_tokens
        # A constrained sequence ends when its grammar does (or, never expected, refuses the token).
        if seq.grammar is not None and (not seq.grammar.accept_token(token) or seq.grammar.is_terminated()):
            seq.finish_reason = "stop"
        elif num_out >= params.min_tokens:
            if not params.ignore_eos and token in self.eos_token_ids:
                seq.finish_reason = "stop"
            elif params.stop_token_ids and token in params.stop_token_ids:
                seq.finish_reason, seq.stop_reason = "stop", token
            elif stop_str is not None:
                seq.finish_reason, seq.stop_reason = "stop", stop_str
        if seq.finish_reason is None and (
                (params.max_tokens is not None and num_out >= params.max_tokens)
                or seq.num_tokens >= self.max_model_len):
            seq.finish_reason = "length"
        finished = seq.finish_reason is not None
        if finished:
            self.finish(seq)
        elif seq.grammar_gate is not None and seq.grammar_gate(seq.detokenizer.text):
            # The reasoning is over: the constraint holds from the next token on.
            seq.grammar, seq.pending_grammar, seq.grammar_gate = seq.pending_grammar, None, None
        text = seq.detokenizer.output_text(finished=finished, delta=True) if seq.detokenizer is not None else ""
        return CompletionDelta(index=seq.index, token_ids=[token], text=text, logprobs=logprobs,
                               cumulative_logprob=seq.cumulative_logprob, finish_reason=seq.finish_reason,
                               stop_reason=seq.stop_reason)

