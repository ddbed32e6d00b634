"""A sequence: one stream of tokens being generated (a request with n > 1 owns n of them)."""
from __future__ import annotations

import enum
import itertools
from typing import Any, Optional

from .sampling_params import SamplingParams

_seq_counter = itertools.count()


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Sequence:
    """Token state plus what the block manager and scheduler need to know about it."""

    def __init__(self, request_id: str, index: int, prompt_token_ids: list[int], params: SamplingParams,
                 arrival_time: float, priority: int = 0, group_id: Optional[str] = None) -> None:
        self.seq_id = next(_seq_counter)
        self.request_id = request_id
        # What the scheduler shares running slots fairly across: one HTTP request (all its prompts,
        # all their n choices); a request on its own by default.
        self.group_id = group_id if group_id is not None else request_id
        self.index = index
        self.token_ids: list[int] = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.params = params
        self.arrival_time = arrival_time
        self.priority = priority
        self.status = SequenceStatus.WAITING
        self.num_computed_tokens = 0      # tokens whose K/V sit in the cache
        self.num_cached_tokens = 0        # of the prompt, found in the prefix cache at first schedule
        self.block_table: list[int] = []
        # Hybrid KV (core/kv_groups.py): the other layer groups' tables, and per group the blocks
        # already released for having left the window.
        self.group_tables: list[list[int]] = []
        self.window_trimmed: list[int] = []
        self.block_hashes: list[int] = []  # chained hash of each full block, in order
        self.num_preemptions = 0
        self.finish_reason: Optional[str] = None
        self.stop_reason: Any = None
        self.ever_scheduled = False        # admitted from the waiting queue at least once
        # Filled by the engine at add_request.
        self.generator: Any = None         # torch.Generator of a seeded request
        self.detokenizer: Any = None       # IncrementalDetokenizer (params.detokenize)
        self.cumulative_logprob: Optional[float] = None   # not None: logprobs were requested
        self.grammar: Any = None           # GrammarMatcher of a structured-outputs request
        # With a reasoning parser: the matcher waits here until the output leaves the reasoning
        # part (grammar_gate(output_text) is True), then becomes `grammar` from the next token on.
        self.pending_grammar: Any = None
        self.grammar_gate: Any = None
        # Draft tokens to verify this step (speculative decoding); not part of token_ids.
        self.spec_token_ids: list[int] = []
        # Prompt positions whose logprobs were emitted (the leading None counts): a recompute
        # after preemption must not emit them twice.
        self.num_prompt_logprobs_emitted = 0
        # A pooling request (core/pooling_params.py): its PoolingParams, and what the pooler has
        # folded in of the chunks computed so far (core/layers/pooler.py).
        self.pooling: Any = None
        self.pooling_partial: Any = None
        # A LoRA request (core/lora/): its adapter, the device slot it holds while running (-1: none)
        # and what its prefix-cache hashes start from (None: the base model's).
        self.lora_request: Any = None
        self.lora_slot = -1
        self.cache_salt: Optional[int] = None
        # A hybrid model's recurrent-state slot (core/state_cache.py), held with the blocks; -1: none.
        self.state_slot = -1
        # Prefix caching on such a model: the checkpoint its state is restored from at its next step
        # (-1: none), and (checkpoint, block index) its state is saved to after it (None: none).
        self.state_restore = -1
        self.state_save: Optional[tuple[int, int]] = None

    # ------------------------------------------------------------------ views
    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[:self.num_prompt_tokens]

    @property
    def is_finished(self) -> bool:
        return self.status == SequenceStatus.FINISHED

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def is_decode(self) -> bool:
        """One token left to compute and it is a generated one (or the last prompt token after a cache hit)."""
        return self.num_uncomputed_tokens == 1 and self.num_output_tokens > 0

    def sort_key(self) -> tuple:
        return (self.priority, self.arrival_time, self.seq_id)

    def __repr__(self) -> str:
        return (f"Sequence(id={self.seq_id}, req={self.request_id!r}, tokens={len(self.token_ids)}, "
                f"computed={self.num_computed_tokens}, status={self.status.value})")
