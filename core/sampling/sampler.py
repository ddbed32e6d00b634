"""Batched token sampler: logit processing, greedy / random sampling, per-request seeds, logprobs.

Semantics follow vLLM (v1):
  * logprobs are those of the raw model distribution (``log_softmax`` of the logits before any
    processing);
  * processing order: logit_bias, min_tokens suppression, repetition penalty, frequency/presence
    penalties, temperature, top_k, top_p, min_p, then sampling;
  * greedy (temperature < 1e-5) is ``argmax`` of the processed logits (bias, min_tokens and
    penalties apply to greedy rows too);
  * random rows are sampled with the exponential race ``argmax(probs / Exp(1))``; a seeded row draws
    its noise from its own generator only, so its tokens do not depend on the rest of the batch
    or on its row position. Unseeded rows share the sampler's generator (torch's default RNG
    unless one is passed to ``Sampler(generator=...)``).

All processing is vectorized over the rows that need it; the all-greedy, no-processing batch is a
single ``argmax``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from ..sampling_params import SamplingParams

_GREEDY_EPS = 1e-5


@dataclass
class SamplingRow:
    """One row of the logits matrix to sample from."""
    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]             # generated so far by this sequence
    generator: Optional[torch.Generator]    # the request's own generator when params.seed is set
    eos_token_ids: tuple[int, ...] = ()     # suppressed (with stop_token_ids) while output < min_tokens


@dataclass
class SamplerOutput:
    token_ids: list[int]                            # one per row
    sampled_logprobs: list[Optional[float]]         # logprob of the sampled token (None when not requested)
    top_logprobs: list[Optional[dict[int, float]]]  # top-k plus the sampled token (None when not requested)


def _is_greedy(p: SamplingParams) -> bool:
    return p.temperature < _GREEDY_EPS


class Sampler:
    def __init__(self, generator: Optional[torch.Generator] = None) -> None:
        # Shared generator for unseeded random rows (None: torch's default RNG).
        self.generator = generator

    # ------------------------------------------------------------------ entry point
    def __call__(self, logits: torch.Tensor, rows: list[SamplingRow]) -> SamplerOutput:
        n = len(rows)
        if logits.dim() != 2 or logits.shape[0] != n:
            raise ValueError(f"logits must be [len(rows), vocab], got {tuple(logits.shape)} for {n} rows")
        if n == 0:
            return SamplerOutput([], [], [])
        if logits.dtype != torch.float32:
            logits = logits.float()
        vocab = logits.shape[1]

        # Classify rows (one pass of cheap attribute checks).
        greedy_idx: list[int] = []
        random_idx: list[int] = []
        lp_idx: list[int] = []
        needs_processing = False
        for i, row in enumerate(rows):
            p = row.params
            if p.temperature < _GREEDY_EPS:
                greedy_idx.append(i)
            else:
                random_idx.append(i)
            if p.logprobs is not None:
                lp_idx.append(i)
            if (p.logit_bias or p.repetition_penalty != 1.0 or p.frequency_penalty != 0.0
                    or p.presence_penalty != 0.0
                    or (p.min_tokens and len(row.output_token_ids) < p.min_tokens)):
                needs_processing = True

        # Raw logprobs, before any processing (vLLM v1 default).
        raw_logprobs = None
        if lp_idx:
            sub = logits if len(lp_idx) == n else logits[lp_idx]
            raw_logprobs = torch.log_softmax(sub, dim=-1)

        # Fast path: all greedy, nothing to process.
        if not random_idx and not needs_processing:
            token_ids = logits.argmax(dim=-1).tolist()
            return self._with_logprobs(token_ids, rows, lp_idx, raw_logprobs)

        if needs_processing:
            logits = logits.clone()
            self._apply_processing(logits, rows, vocab)

        token_ids: list[int] = [0] * n
        if greedy_idx:
            if len(greedy_idx) == n:
                token_ids = logits.argmax(dim=-1).tolist()
            else:
                g = logits[greedy_idx].argmax(dim=-1).tolist()
                for i, t in zip(greedy_idx, g):
                    token_ids[i] = t
        if random_idx:
            sub = logits if len(random_idx) == n else logits[random_idx]
            sampled = self._sample_random(sub, [rows[i] for i in random_idx], vocab)
            for i, t in zip(random_idx, sampled):
                token_ids[i] = t
        return self._with_logprobs(token_ids, rows, lp_idx, raw_logprobs)

    # ------------------------------------------------------------------ processing (in place)
    def _apply_processing(self, logits: torch.Tensor, rows: list[SamplingRow], vocab: int) -> None:
        # logit_bias and min_tokens suppression: one index_put each over a flat (row, token) list.
        bias_r: list[int] = []
        bias_t: list[int] = []
        bias_v: list[float] = []
        block_r: list[int] = []
        block_t: list[int] = []
        rep_rows: list[int] = []
        pen_rows: list[int] = []
        for i, row in enumerate(rows):
            p = row.params
            if p.logit_bias:
                for tok, val in p.logit_bias.items():
                    if 0 <= tok < vocab:
                        bias_r.append(i)
                        bias_t.append(tok)
                        bias_v.append(val)
            if p.min_tokens and len(row.output_token_ids) < p.min_tokens:
                for tok in (*row.eos_token_ids, *(p.stop_token_ids or ())):
                    if 0 <= tok < vocab:
                        block_r.append(i)
                        block_t.append(tok)
            if p.repetition_penalty != 1.0:
                rep_rows.append(i)
            if p.frequency_penalty != 0.0 or p.presence_penalty != 0.0:
                pen_rows.append(i)

        if bias_r:
            logits.index_put_((torch.tensor(bias_r), torch.tensor(bias_t)),
                              torch.tensor(bias_v, dtype=logits.dtype), accumulate=True)
        if block_r:
            logits[torch.tensor(block_r), torch.tensor(block_t)] = float("-inf")

        if rep_rows:
            r_list: list[int] = []
            t_list: list[int] = []
            for j, i in enumerate(rep_rows):
                row = rows[i]
                toks = row.prompt_token_ids + row.output_token_ids if row.prompt_token_ids else row.output_token_ids
                r_list.extend([j] * len(toks))
                t_list.extend(toks)
            if t_list:
                seen = torch.zeros(len(rep_rows), vocab, dtype=torch.bool)
                t_tensor = torch.tensor(t_list).clamp_(0, vocab - 1)
                seen[torch.tensor(r_list), t_tensor] = True
                idx = torch.tensor(rep_rows)
                sub = logits[idx]
                pen = torch.tensor([rows[i].params.repetition_penalty for i in rep_rows],
                                   dtype=logits.dtype).unsqueeze(1)
                penalized = torch.where(sub > 0, sub / pen, sub * pen)
                logits[idx] = torch.where(seen, penalized, sub)

        if pen_rows:
            r_list = []
            t_list = []
            for j, i in enumerate(pen_rows):
                out = rows[i].output_token_ids
                r_list.extend([j] * len(out))
                t_list.extend(out)
            if t_list:
                counts = torch.zeros(len(pen_rows), vocab, dtype=logits.dtype)
                t_tensor = torch.tensor(t_list).clamp_(0, vocab - 1)
                counts.index_put_((torch.tensor(r_list), t_tensor),
                                  torch.ones(len(t_list), dtype=logits.dtype), accumulate=True)
                freq = torch.tensor([rows[i].params.frequency_penalty for i in pen_rows],
                                    dtype=logits.dtype).unsqueeze(1)
                pres = torch.tensor([rows[i].params.presence_penalty for i in pen_rows],
                                    dtype=logits.dtype).unsqueeze(1)
                idx = torch.tensor(pen_rows)
                logits[idx] = logits[idx] - freq * counts - pres * (counts > 0).to(logits.dtype)

    # ------------------------------------------------------------------ random sampling
    def _sample_random(self, logits: torch.Tensor, rows: list[SamplingRow], vocab: int) -> list[int]:
        """logits: [R, V] (a copy or the processed matrix for the random rows only)."""
        r = len(rows)
        temps = [row.params.temperature for row in rows]
        # Always a new tensor: the masking below writes into it, never into the caller's logits.
        if all(t == 1.0 for t in temps):
            scaled = logits.clone()
        else:
            scaled = logits / torch.tensor(temps, dtype=logits.dtype).unsqueeze(1)

        # top_k: threshold each row at its k-th largest value (one topk over the max k).
        ks = [row.params.top_k if 0 < row.params.top_k < vocab else 0 for row in rows]
        k_rows = [j for j, k in enumerate(ks) if k]
        if k_rows:
            kmax = max(ks[j] for j in k_rows)
            sub = scaled[k_rows] if len(k_rows) < r else scaled
            top_vals = sub.topk(kmax, dim=-1).values
            kth = top_vals.gather(1, torch.tensor([ks[j] - 1 for j in k_rows]).unsqueeze(1))
            masked = sub.masked_fill(sub < kth, float("-inf"))
            if len(k_rows) < r:
                scaled[k_rows] = masked
            else:
                scaled = masked

        # top_p: only for rows that need it (this is the one full-vocab sort).
        p_rows = [j for j, row in enumerate(rows) if row.params.top_p < 1.0]
        if p_rows:
            sub = scaled[p_rows] if len(p_rows) < r else scaled
            sorted_vals, sorted_idx = sub.sort(dim=-1, descending=True)
            sorted_probs = sorted_vals.softmax(dim=-1)
            cum = sorted_probs.cumsum(dim=-1)
            top_p = torch.tensor([rows[j].params.top_p for j in p_rows], dtype=sub.dtype).unsqueeze(1)
            # Drop a token when the mass strictly before it already reaches top_p (keeps >= 1 token).
            remove_sorted = (cum - sorted_probs) >= top_p
            remove_sorted[:, 0] = False
            remove = torch.zeros_like(remove_sorted).scatter_(1, sorted_idx, remove_sorted)
            masked = sub.masked_fill(remove, float("-inf"))
            if len(p_rows) < r:
                scaled[p_rows] = masked
            else:
                scaled = masked

        probs = scaled.softmax(dim=-1)

        # min_p: drop tokens whose probability is below min_p * max probability.
        m_rows = [j for j, row in enumerate(rows) if row.params.min_p > 0.0]
        if m_rows:
            sub = probs[m_rows] if len(m_rows) < r else probs
            min_p = torch.tensor([rows[j].params.min_p for j in m_rows], dtype=sub.dtype).unsqueeze(1)
            thresh = sub.amax(dim=-1, keepdim=True) * min_p
            masked = sub.masked_fill(sub < thresh, 0.0)
            if len(m_rows) < r:
                probs[m_rows] = masked
            else:
                probs = masked
            # No renormalization needed: the exponential race is scale-invariant per row.

        # Exponential race: argmax(probs / E), E ~ Exp(1). Seeded rows draw from their own generator.
        noise = torch.empty_like(probs)
        seeded = [j for j, row in enumerate(rows) if row.generator is not None]
        if not seeded:
            noise.exponential_(generator=self.generator)
        else:
            seeded_set = set(seeded)
            unseeded = [j for j in range(r) if j not in seeded_set]
            if unseeded:
                shared = torch.empty(len(unseeded), vocab, dtype=probs.dtype)
                shared.exponential_(generator=self.generator)
                noise[unseeded] = shared
            for j in seeded:
                noise[j].exponential_(generator=rows[j].generator)
        return probs.div_(noise).argmax(dim=-1).tolist()

    # ------------------------------------------------------------------ logprobs
    @staticmethod
    def _with_logprobs(token_ids: list[int], rows: list[SamplingRow], lp_idx: list[int],
                       raw_logprobs: Optional[torch.Tensor]) -> SamplerOutput:
        n = len(rows)
        sampled: list[Optional[float]] = [None] * n
        tops: list[Optional[dict[int, float]]] = [None] * n
        if not lp_idx or raw_logprobs is None:
            return SamplerOutput(token_ids, sampled, tops)
        vocab = raw_logprobs.shape[1]
        chosen = torch.tensor([token_ids[i] for i in lp_idx]).unsqueeze(1)
        sampled_vals = raw_logprobs.gather(1, chosen).squeeze(1).tolist()
        ks = [min(rows[i].params.logprobs, vocab) for i in lp_idx]
        kmax = max(ks)
        if kmax > 0:
            top_vals, top_ids = raw_logprobs.topk(kmax, dim=-1)
            top_vals_l = top_vals.tolist()
            top_ids_l = top_ids.tolist()
        for j, i in enumerate(lp_idx):
            d: dict[int, float] = {}
            k = ks[j]
            if k:
                d = dict(zip(top_ids_l[j][:k], top_vals_l[j][:k]))
            d[token_ids[i]] = sampled_vals[j]
            sampled[i] = sampled_vals[j]
            tops[i] = d
        return SamplerOutput(token_ids, sampled, tops)


def compute_prompt_logprobs(logits: torch.Tensor, prompt_token_ids: list[int], k: int,
                            start: int = 0) -> list[Optional[dict[int, float]]]:
    """Prompt logprobs (vLLM semantics) for a run of prompt positions.

    ``logits`` row ``j`` is the model output at prompt position ``start + j`` and therefore scores
    prompt token ``start + j + 1``. ``prompt_token_ids`` is the full prompt. Each entry is
    ``{token: logprob}`` with the top-``k`` tokens plus the actual prompt token.

    With ``start == 0`` the result begins with ``None`` for the first prompt token (it has no
    logprob) so that a whole-prompt call (``logits`` of ``P-1`` rows) returns a list of length
    ``P`` aligned with the prompt. For a later chunk (``start > 0``) no ``None`` is prepended, so
    concatenating the chunks' results in order again gives the list aligned with the prompt.
    Rows past the last prompt token (the position that predicts the first generated token)
    are ignored.
    """
    if logits.dtype != torch.float32:
        logits = logits.float()
    rows = max(0, min(logits.shape[0], len(prompt_token_ids) - 1 - start))
    result: list[Optional[dict[int, float]]] = [None] if start == 0 else []
    if rows == 0:
        return result
    lp = torch.log_softmax(logits[:rows], dim=-1)
    targets = prompt_token_ids[start + 1:start + 1 + rows]
    actual = lp.gather(1, torch.tensor(targets).unsqueeze(1)).squeeze(1).tolist()
    k = min(max(k, 0), lp.shape[1])
    if k:
        top_vals, top_ids = lp.topk(k, dim=-1)
        top_vals_l = top_vals.tolist()
        top_ids_l = top_ids.tolist()
    for j in range(rows):
        d: dict[int, float] = dict(zip(top_ids_l[j], top_vals_l[j])) if k else {}
        d[targets[j]] = actual[j]
        result.append(d)
    return result
