"""Method "draft_model": a small model with the target's vocabulary proposes the drafts.

The draft model has its own ModelRunner and KV pool, and its own BlockManager over that pool,
keyed by a shadow Sequence per target sequence that decodes. Each step, for the sequences that
draft:

    sync       the shadow keeps the K/V of the longest prefix it shares with the target's tokens
               (rejected drafts rolled back, their blocks released: BlockManager.truncate) -- at
               most all but the last token, whose logits propose the first draft
    catch up   one forward over every shadow's uncomputed tokens (the prompt the first time, from
               the draft's own prefix cache where it can; later the accepted drafts and the
               target's last token), in chunks of the step's token budget
    draft      k - 1 single-token forwards: draft j + 1 from the logits after draft j

Draft j is drawn as the target's sampler would draw it (sampling/rejection.py `sample_rows`:
the request's penalties, grammar mask, temperature, top_k/top_p/min_p, its seeded generator),
and for a random row its distribution q is kept for the rejection sampling of the verification.
A constrained sequence's matcher is advanced through the drafts (each drawn under the grammar's
mask, so every draft is valid) and rolled back afterwards. The shadow is freed with its sequence
(finished, aborted or preempted: Scheduler.on_free).
"""
from __future__ import annotations

import copy
import logging
import os
from typing import Any, Callable, Sequence as Seq

import torch

from .block_manager import BlockManager
from .config import EngineConfig
from .loaders import hf
from .loaders.loader import load_model
from .model_runner import ModelRunner
from .sampling.rejection import sample_rows
from .sampling.sampler import Sampler, SamplingRow
from .sampling_params import SamplingParams
from .step import ScheduledBatch
from .sequence import Sequence

logger = logging.getLogger("tokenmill.spec_draft")
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
_SHADOW_PARAMS = SamplingParams(detokenize=False)


class _Shadow(Sequence):
    """The draft model's view of a target sequence: its tokens (plus the drafts being computed)."""

    def __init__(self, seq: Sequence) -> None:
        super().__init__(seq.request_id, seq.index, seq.token_ids, _SHADOW_PARAMS, seq.arrival_time)
        self.confirmed = 0       # leading tokens known to be the target's


class DraftModel:
    def __init__(self, config: EngineConfig, platform: Any, choose_backend: Callable[[Any], type],
                 tokenizer: Any, tokenizer_path: str, vocab_size: int, num_blocks: int,
                 eos_token_ids: tuple[int, ...]) -> None:
        spec = config.speculative
        path = str(spec.model)
        if not os.path.exists(path):
            raise ValueError(f"speculative_config model {path!r} does not exist")
        cfg = copy.deepcopy(config)
        cfg.model.model, cfg.model.tokenizer = path, tokenizer_path   # the target's tokenizer
        bundle = load_model(cfg, platform, choose_backend)
        draft_vocab = int(getattr(bundle.hf_config, "vocab_size", 0) or 0)
        same = draft_vocab == vocab_size
        if same and os.path.isdir(path) and any(os.path.exists(os.path.join(path, f)) for f in _TOKENIZER_FILES):
            same = hf.load_hf_tokenizer(path).get_vocab() == tokenizer.get_vocab()
        if not same:
            raise ValueError(
                f"speculative_config model {path!r} does not share the target model's vocabulary "
                f"({draft_vocab} tokens in the draft, {vocab_size} in the target, or other token ids): "
                f"a draft model must use the target's tokenizer")
        cfg.model.max_model_len = min(config.model.max_model_len, bundle.max_model_len)
        self.max_model_len = cfg.model.max_model_len
        # The target's token capacity plus a block per sequence for the drafts past it.
        cfg.cache.num_gpu_blocks_override = num_blocks + config.scheduler.max_num_seqs
        self.runner = ModelRunner(cfg, platform, bundle.model, bundle.dtype)
        self.block_manager = BlockManager(self.runner.num_blocks, cfg.cache.block_size, cfg.cache.enable_prefix_caching,
                                          self.runner.kv_layout, window_margin=cfg.speculative.num_speculative_tokens)
        self.token_budget = max(1, int(cfg.scheduler.max_num_batched_tokens))
        self.eos_token_ids = eos_token_ids
        self.sampler = Sampler()
        self.shadows: dict[int, _Shadow] = {}
        logger.info("draft model %s (%s): %d KV blocks of %d tokens (%.1f MiB)", path, bundle.architecture,
                    self.runner.num_blocks, cfg.cache.block_size,
                    self.runner.num_blocks * self.runner.bytes_per_block / 2**20)

    # ------------------------------------------------------------------ per-sequence KV
    def release(self, seq: Sequence) -> None:
        shadow = self.shadows.pop(seq.seq_id, None)
        if shadow is not None:
            self.block_manager.free(shadow)

    def _sync(self, seq: Sequence) -> _Shadow:
        """The shadow of `seq`, holding the K/V of the longest prefix it shares with seq's tokens
        (never all of them: the last one is computed again for its logits)."""
        target = seq.token_ids
        shadow = self.shadows.get(seq.seq_id)
        if shadow is None:
            shadow = self.shadows[seq.seq_id] = _Shadow(seq)
            self.block_manager.match_prefix(shadow)
            return shadow
        old = shadow.token_ids
        limit = min(shadow.num_computed_tokens, len(target) - 1)
        common = min(shadow.confirmed, limit)
        while common < limit and old[common] == target[common]:
            common += 1
        self.block_manager.truncate(shadow, common)
        shadow.token_ids = list(target)
        return shadow

    def _forward(self, entries: list[tuple[_Shadow, int]]) -> dict[int, torch.Tensor]:
        """One draft forward; the logits of each shadow whose tokens are all computed after it."""
        for shadow, n in entries:
            self.block_manager.allocate(shadow, n)
        batch = ScheduledBatch()
        decodes = [e for e in entries if e[1] == 1]
        batch.entries = decodes + [e for e in entries if e[1] != 1]
        batch.num_decodes = len(decodes)
        result = self.runner.execute(batch)
        for shadow, n in entries:
            shadow.num_computed_tokens += n
        if result.logits is None:
            return {}
        return {s.seq_id: result.logits[i] for i, s in enumerate(result.sampled_seqs(batch))}

    def _catch_up(self, shadows: list[_Shadow]) -> dict[int, torch.Tensor]:
        """Compute every shadow's uncomputed tokens (chunked to the token budget); the last logits
        of each. A shadow the draft pool has no room for is released (no drafts for it)."""
        logits: dict[int, torch.Tensor] = {}
        pending = list(shadows)
        while pending:
            budget, entries = self.token_budget, []
            for shadow in pending:
                n = min(shadow.num_uncomputed_tokens, budget)
                if n <= 0:
                    break
                if not self.block_manager.can_allocate(shadow, n):
                    continue
                entries.append((shadow, n))
                budget -= n
            if not entries:                  # the pool is full: give up on what is left
                break
            logits.update(self._forward(entries))
            pending = [s for s in pending if s.num_uncomputed_tokens > 0]
        return logits

    # ------------------------------------------------------------------ proposing
    def propose(self, items: Seq[tuple[Sequence, int]]) -> dict[int, torch.Tensor]:
        """Set `spec_token_ids` (up to `limit` drafts) of each (sequence, limit); return q
        ([len(drafts), V]) by seq_id for the sequences that sample at random."""
        work: list[tuple[Sequence, _Shadow, int]] = []
        for seq, limit in items:
            limit = min(limit, self.max_model_len - seq.num_tokens + 1)
            if limit > 0:
                work.append((seq, self._sync(seq), limit))
        logits = self._catch_up([sh for _, sh, _ in work])
        for seq, shadow, _ in work:
            if shadow.seq_id not in logits:
                self.release(seq)
            else:
                shadow.confirmed = seq.num_tokens
                self.block_manager.cache_full_blocks(shadow)   # only the target's tokens so far
        active = [(seq, shadow, limit) for seq, shadow, limit in work if shadow.seq_id in logits]
        drafts: dict[int, list[int]] = {seq.seq_id: [] for seq, _, _ in active}
        qs: dict[int, list[torch.Tensor]] = {}
        advanced: dict[int, int] = {}
        while active:
            rows = [self._row(seq, drafts[seq.seq_id]) for seq, _, _ in active]
            tokens, q = sample_rows(torch.stack([logits[sh.seq_id] for _, sh, _ in active]), rows, self.sampler)
            going, entries = [], []
            for i, (seq, shadow, limit) in enumerate(active):
                token, own = tokens[i], drafts[seq.seq_id]
                if seq.grammar is not None:
                    if not seq.grammar.accept_token(token):
                        continue          # only when the grammar allows nothing (then it ended)
                    advanced[seq.seq_id] = advanced.get(seq.seq_id, 0) + 1
                own.append(token)
                if i in q:
                    qs.setdefault(seq.seq_id, []).append(q[i])
                if len(own) >= limit or (seq.grammar is not None and seq.grammar.is_terminated()):
                    continue
                if not self.block_manager.can_allocate(shadow, 1):
                    continue
                shadow.token_ids.append(token)
                going.append((seq, shadow, limit))
                entries.append((shadow, 1))
            logits = self._forward(entries) if entries else {}
            active = going
        for seq, _, _ in work:
            n = advanced.get(seq.seq_id)
            if n:
                seq.grammar.rollback(n)
            seq.spec_token_ids = drafts.get(seq.seq_id, [])
        return {sid: torch.stack(rows) for sid, rows in qs.items()}

    def _row(self, seq: Sequence, drafts: list[int]) -> SamplingRow:
        """The sampler row of the draft's next position: as the target's row there will be."""
        eos = () if seq.params.ignore_eos or seq.grammar is not None else self.eos_token_ids
        return SamplingRow(params=seq.params, prompt_token_ids=seq.prompt_token_ids,
                           output_token_ids=seq.output_token_ids + drafts, generator=seq.generator,
                           eos_token_ids=eos, grammar=seq.grammar)
