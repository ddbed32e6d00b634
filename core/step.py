"""The one step boundary: what the scheduler hands the model runner (`ScheduledBatch`, and the
`StepInputs` a worker process receives for it) and what comes back (`StepOutput`).

In one process the runner reads the inputs straight off the scheduler's batch; with several
workers (core/executor.py) `StepInputs` is the message each rank receives every step, so it
carries only what a forward pass reads: the tokens fed this step (not the whole history), the
first position, the block table and which rows are sampled. Results are by position in the batch
(entry index), never by Sequence object, so the same type crosses a process boundary; the
scheduler maps them back to its sequences (`StepOutput.sampled_seqs`).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from .sequence import Sequence


@dataclass
class ScheduledBatch:
    # (sequence, number of new tokens) — decodes first, then prefill chunks
    entries: list[tuple[Sequence, int]] = field(default_factory=list)
    num_decodes: int = 0
    preempted: list[Sequence] = field(default_factory=list)
    first_scheduled: list[Sequence] = field(default_factory=list)   # admitted for the first time

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.entries)

    def __bool__(self) -> bool:
        return bool(self.entries)


@dataclass
class EntryInput:
    start: int                  # first position computed this step
    token_ids: list[int]        # the tokens fed (a verifying sequence: its last token, then its drafts)
    block_table: list[int]
    sample_rows: int = 0        # rows sampled: 0, 1 (the last token), or one per fed token (drafts)
    prompt_logprob_rows: int = 0   # prompt positions whose logits are wanted, from `start`
    pooling: bool = False       # a pooling sequence (in-process only: the pooler keeps state on it)
    lora_slot: int = -1         # the LoRA adapter slot its rows run on (core/lora/), -1: the base model
    group_tables: list[list[int]] = field(default_factory=list)   # hybrid KV: the other groups' tables
    state_slot: int = -1        # recurrent layers' state slot (core/state_cache.py), -1: none
    state_restore: int = -1     # the checkpoint its state starts from (a prefix-cache hit), -1: none
    state_save: int = -1        # the checkpoint its state after this step is saved to, -1: none

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


@dataclass
class StepInputs:
    entries: list[EntryInput]
    num_decodes: int            # the first num_decodes entries are single-token decodes

    @classmethod
    def from_batch(cls, batch: ScheduledBatch) -> "StepInputs":
        entries = []
        for seq, n in batch.entries:
            start = seq.num_computed_tokens
            end = start + n
            drafts = seq.spec_token_ids
            if drafts:
                ids = seq.token_ids[start:] + list(drafts)
                sample = n
            else:
                ids = seq.token_ids[start:end]
                sample = 1 if seq.pooling is None and end == seq.num_tokens else 0
            prompt_rows = 0
            # Choices of one request share the prompt: its logprobs come from the first one.
            if seq.params.prompt_logprobs is not None and seq.index == 0 and start < seq.num_prompt_tokens - 1:
                prompt_rows = min(end, seq.num_prompt_tokens - 1) - start
            entries.append(EntryInput(start, ids, seq.block_table, sample, prompt_rows, seq.pooling is not None,
                                      seq.lora_slot, seq.group_tables, seq.state_slot, seq.state_restore,
                                      seq.state_save[0] if seq.state_save is not None else -1))
        return cls(entries, batch.num_decodes)

    def split(self, parts: int) -> list["StepInputs"]:
        """Up to `parts` micro-batches of consecutive entries (decodes stay first in each)."""
        n = len(self.entries)
        parts = max(1, min(parts, n))
        bounds = [n * i // parts for i in range(parts + 1)]
        return [StepInputs(self.entries[a:b], max(0, min(self.num_decodes, b) - a))
                for a, b in zip(bounds, bounds[1:])]


@dataclass
class StepOutput:
    """A step's results by entry index (what the last pipeline stage's first rank sends back)."""
    logits: Optional[torch.Tensor]           # [rows, vocab] float32
    sampled: list[int]                       # entry index of each sampled sequence, in row order
    num_rows: Optional[list[int]] = None     # rows per sampled entry when drafts were verified
    prompt_logits: list[tuple[int, int, torch.Tensor]] = field(default_factory=list)  # (entry, start, logits)
    pooled: list[tuple[Any, list[float]]] = field(default_factory=list)   # in-process only: (sequence, vector)
    # Cumulative tokens per expert [layers, experts] of the MoE layers (core/layers/expert_tokens.py):
    # the runner's device tensor in process, a CPU copy from a worker; None without MoE layers.
    expert_tokens: Optional[torch.Tensor] = None

    def rows_per_seq(self) -> list[int]:
        """Rows of `logits` per sampled sequence (1 + its drafts when drafts were verified)."""
        return self.num_rows if self.num_rows is not None else [1] * len(self.sampled)

    def sampled_seqs(self, batch: ScheduledBatch) -> list["Sequence"]:
        """The batch's sequences behind `logits`' rows, in row order."""
        return [batch.entries[i][0] for i in self.sampled]

    @staticmethod
    def merge(outputs: list["StepOutput"], sizes: list[int]) -> "StepOutput":
        """One output from the micro-batches' (entries of micro-batch i follow those before it)."""
        offset, sampled, rows, prompt, logits = 0, [], [], [], []
        for out, size in zip(outputs, sizes):
            sampled += [offset + i for i in out.sampled]
            rows += out.num_rows if out.num_rows is not None else [1] * len(out.sampled)
            prompt += [(offset + i, start, t) for i, start, t in out.prompt_logits]
            if out.logits is not None:
                logits.append(out.logits)
            offset += size
        return StepOutput(logits=torch.cat(logits) if logits else None, sampled=sampled,
                          num_rows=rows if any(r != 1 for r in rows) else None, prompt_logits=prompt,
                          expert_tokens=outputs[-1].expert_tokens if outputs else None)
