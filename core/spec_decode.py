"""Speculative decoding: propose a few draft tokens per decoding sequence, verify them all in one
forward pass, keep the longest prefix the target model agrees with.

    engine.step:  speculator.propose(running)       seq.spec_token_ids = [d1 .. dk]
    scheduler:    the sequence computes 1 + k tokens (its last token and the drafts)
    runner:       logits at each of the 1 + k positions
    engine:       speculator.sampling_rows(...)     one sampler row per position, row j seeing
                                                    output + d1..dj (penalties, min_tokens) and the
                                                    grammar mask after d1..dj
    scheduler:    update_from_output appends y0, y1, ... while y_j == d_(j+1); the first
                  disagreement (or y_k, the bonus token) is the last token of the step

Why this keeps the target distribution exactly: each y_j is sampled from the target model's own
(processed) distribution given the accepted prefix, which is the real prefix. With a drafter that
proposes one token deterministically (n-gram), the textbook rejection step -- accept d with
probability p(d), else sample from p without d, renormalized -- is the same distribution as
"sample y ~ p, accept iff y == d, else emit y": so the sampler is used unchanged, greedy output is
identical to decoding without speculation, and seeded rows stay reproducible.

The target's KV of rejected drafts needs no undo: those positions lie past `num_computed_tokens`,
which only counts accepted tokens, so the next step overwrites them and the prefix cache never
registers a block holding them (a draft model rolls its own KV back: core/spec_draft.py). A step
with more decoding sequences than `disable_by_batch_size` drafts nothing (batched decode is
compute-bound: verifying drafts would cost more than it saves).

Method "ngram" (prompt lookup): the longest suffix of the sequence (prompt_lookup_max down to
prompt_lookup_min tokens) that occurred earlier in it proposes the tokens that followed it then.

Method "draft_model" (core/spec_draft.py): a small model with the target's vocabulary, with its
own KV pool, draws the drafts as the sampler would. Greedy rows verify as above (the draft's argmax
is its one-hot q). Random rows keep the draft's distribution q per draft and are verified by
rejection sampling (sampling/rejection.py: accept with min(1, p/q), else draw from max(0, p - q)),
which keeps the target distribution exactly for a random drafter too; with q = one-hot it is the
n-gram rule above.
"""
from __future__ import annotations

import array
from typing import TYPE_CHECKING, Any, Optional, Sequence as Seq

import torch

from .config import EngineConfig, SpeculativeConfig
from .sampling import rejection
from .sampling.sampler import Sampler, SamplerOutput, SamplingRow
from .sequence import Sequence
from .spec_draft import DraftModel

if TYPE_CHECKING:
    from .step import ScheduledBatch, StepOutput


class NgramProposer:
    """Prompt-lookup drafting over the sequence's own tokens (prompt and output)."""

    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n, self.max_n = min_n, max_n

    def propose(self, token_ids: Seq[int], limit: int) -> list[int]:
        """Up to `limit` tokens that followed the latest earlier occurrence of the longest suffix
        n-gram; [] when no suffix of min_n tokens occurred before."""
        total = len(token_ids)
        if limit <= 0 or total < self.min_n + 1:
            return []
        # int32 bytes: bytes.rfind does the search in C; a hit must sit on a 4-byte boundary.
        hay = array.array("i", token_ids).tobytes()
        for n in range(min(self.max_n, total - 1), self.min_n - 1, -1):
            pattern = hay[4 * (total - n):]
            end = 4 * (total - 1)              # an occurrence must end before the last token
            while True:
                at = hay.rfind(pattern, 0, end)
                if at < 0:
                    break
                if at % 4 == 0:
                    start = at // 4 + n
                    return list(token_ids[start:start + limit])
                end = at + len(pattern) - 1
        return []


class FixedMask:
    """A grammar mask computed ahead (for a draft position) in the matcher's place for the sampler."""
    __slots__ = ("_bitmask", "_row")

    def __init__(self, bitmask: torch.Tensor, row: int) -> None:
        self._bitmask, self._row = bitmask, row

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        bitmask[row] = self._bitmask[self._row]


class Speculator:
    def __init__(self, config: SpeculativeConfig, max_model_len: int, vocab_size: int,
                 draft: Optional[DraftModel] = None) -> None:
        self.config = config
        self.k = config.num_speculative_tokens
        self.max_model_len = max_model_len
        self.words = -(-vocab_size // 32)
        self.proposer = NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
        self.draft = draft
        self.pending_q: dict[int, torch.Tensor] = {}   # seq_id -> q of this step's random drafts
        self.num_drafts = 0                         # proposals verified (steps of one sequence)
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.accepted_per_position = [0] * self.k  # how often draft j (from 0) was accepted

    def propose(self, running: Seq[Sequence]) -> None:
        """Set `spec_token_ids` of the running sequences that decode this step (none when too many)."""
        # Last step's drafts are gone: verified ones cleared in update_from_output, unscheduled
        # ones in schedule().
        self.pending_q = {}
        decodes = [s for s in running if s.num_uncomputed_tokens == 1 and s.num_output_tokens > 0]
        limit_batch = self.config.disable_by_batch_size
        if not decodes or (limit_batch is not None and len(decodes) > limit_batch):
            return
        items: list[tuple[Sequence, int]] = []
        for seq in decodes:
            params = seq.params
            room = self.max_model_len - seq.num_tokens - 1
            if params.max_tokens is not None:
                room = min(room, params.max_tokens - seq.num_output_tokens - 1)
            if seq.grammar_gate is not None or (seq.grammar is not None and not seq.grammar.supports_rollback):
                continue       # a constraint about to start, or one that cannot undo a rejected draft
            if self.draft is not None:
                items.append((seq, min(self.k, room)))
                continue
            drafts = self.proposer.propose(seq.token_ids, min(self.k, room))
            if drafts and seq.grammar is not None:
                drafts = drafts[:seq.grammar.count_valid(drafts)]
            seq.spec_token_ids = drafts
        if items:
            self.pending_q = self.draft.propose(items)

    def release(self, seq: Sequence) -> None:
        """The sequence's blocks were released (finished, aborted, preempted): so are the draft's."""
        if self.draft is not None:
            self.draft.release(seq)

    def sample(self, sampler: Sampler, result: "StepOutput", batch: "ScheduledBatch",
               rows: list[SamplingRow]) -> SamplerOutput:
        """The step's tokens: the sampler's, except for the rows of sequences verifying random
        drafts with a known q (a draft model's), decided by rejection sampling."""
        pending, self.pending_q = self.pending_q, {}
        special: list[int] = []
        groups: list[tuple[list[int], Optional[torch.Tensor]]] = []
        row = 0
        for seq, n in zip(result.sampled_seqs(batch), result.rows_per_seq()):
            q = pending.get(seq.seq_id) if n > 1 else None
            if q is not None:
                groups.append((seq.spec_token_ids, q[:n - 1]))
                special.extend(range(row, row + n))
            row += n
        logits = result.logits
        if not special:
            return sampler(logits, rows)
        chosen = set(special)
        others = [i for i in range(len(rows)) if i not in chosen]
        verified = rejection.verify(logits[special], [rows[i] for i in special], groups, sampler)
        if not others:
            return verified
        rest = sampler(logits[others], [rows[i] for i in others])
        out = SamplerOutput([0] * len(rows), [None] * len(rows), [None] * len(rows))
        for part, where in ((verified, special), (rest, others)):
            for j, i in enumerate(where):
                out.token_ids[i] = part.token_ids[j]
                out.sampled_logprobs[i] = part.sampled_logprobs[j]
                out.top_logprobs[i] = part.top_logprobs[j]
        return out

    def sampling_rows(self, seq: Sequence, eos: tuple[int, ...]) -> list[SamplingRow]:
        """The sampler rows of a sequence with drafts: one per verified position."""
        drafts = seq.spec_token_ids
        out = seq.output_token_ids
        masks: list[Any] = [None] * (len(drafts) + 1)
        if seq.grammar is not None:
            masks = self._grammar_masks(seq.grammar, drafts)
        eos_ids = () if seq.params.ignore_eos or seq.grammar is not None else eos
        return [SamplingRow(params=seq.params, prompt_token_ids=seq.prompt_token_ids,
                            output_token_ids=out + drafts[:j], generator=seq.generator,
                            eos_token_ids=eos_ids, grammar=masks[j])
                for j in range(len(drafts) + 1)]

    def _grammar_masks(self, matcher: Any, drafts: list[int]) -> list[FixedMask]:
        bitmask = torch.full((len(drafts) + 1, self.words), -1, dtype=torch.int32)
        advanced = 0
        for j in range(len(drafts) + 1):
            matcher.fill_bitmask(bitmask, j)
            if j < len(drafts):
                if not matcher.accept_token(drafts[j]):
                    break                 # cannot happen: propose kept only what the grammar allows
                advanced += 1
                if matcher.is_terminated():
                    break                 # the sequence ends at this draft if it is accepted
        if advanced:
            matcher.rollback(advanced)
        return [FixedMask(bitmask, j) for j in range(len(drafts) + 1)]

    def record(self, num_drafts: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_drafts
        self.num_accepted_tokens += num_accepted
        for j in range(num_accepted):
            self.accepted_per_position[j] += 1

    def counters(self) -> dict[str, Any]:
        """The EngineStats fields speculative decoding keeps."""
        return {"spec_num_drafts": self.num_drafts, "spec_num_draft_tokens": self.num_draft_tokens,
                "spec_num_accepted_tokens": self.num_accepted_tokens,
                "spec_accepted_per_position": list(self.accepted_per_position)}


def make_speculator(config: EngineConfig, max_model_len: int, vocab_size: int,
                    **draft_kwargs: Any) -> Optional[Speculator]:
    """The speculator `config.speculative` asks for (None: none); `draft_kwargs` are DraftModel's."""
    spec = config.speculative
    if not spec.method:
        return None
    draft = DraftModel(config, vocab_size=vocab_size, **draft_kwargs) if spec.method == "draft_model" else None
    return Speculator(spec, max_model_len, vocab_size, draft)
