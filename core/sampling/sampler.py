"""Batched token sampler: logit processing, greedy / random sampling, per-request seeds, logprobs.

Semantics follow vLLM (v1):
  * logprobs are those of the raw model distribution (``log_softmax`` of the logits before any
    processing);
  * processing order: logit_bias, min_tokens suppression, repetition penalty, frequency/presence
    penalties, temperature, top_k, top_p, min_p, then sampling;
  * greedy (temperature < 1e-5) is ``argmax`` of the processed logits (bias, min_tokens and
    penalties apply to greedy rows too);
  * random rows are sampled by inverse CDF with one uniform per row; a seeded row draws
    its uniform from its own generator only, so its tokens do not depend on the rest of the batch
    or on its row position. Unseeded rows share the sampler's generator (torch's default RNG
    unless one is passed to ``Sampler(generator=...)``).

All processing is vectorized over the rows that need it; the all-greedy, no-processing batch is a
single ``argmax``.
"""
from __future__ import annotations

import array
from dataclasses import dataclass
from typing import Optional

import torch

from ..sampling_params import SamplingParams
from .draw import greedy_tokens, inverse_cdf, sample_sorted
from .structured import apply_grammar_masks

_GREEDY_EPS = 1e-5
# top_p-only rows are sampled among this many top candidates when these hold top_p of the mass.
_TOP_P_CANDIDATES = 256
_TOP_P_CANDIDATES_2 = 4096


def _long(values: list[int]) -> torch.Tensor:
    """list of ints -> int64 tensor, through numpy: torch.tensor converts a long list element by
    element, far slower."""
    if not values:
        return torch.empty(0, dtype=torch.long)
    return torch.frombuffer(array.array("q", values), dtype=torch.long)


def _in_vocab(r_idx: torch.Tensor, t_idx: torch.Tensor, vocab: int, values: torch.Tensor):
    """Drop (row, token) pairs whose token id is outside the logits' vocabulary."""
    ok = (t_idx >= 0) & (t_idx < vocab)
    if bool(ok.all()):
        return r_idx, t_idx, values
    return r_idx[ok], t_idx[ok], values[ok]


@dataclass
class SamplingRow:
    """One row of the logits matrix to sample from."""
    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]             # generated so far by this sequence
    generator: Optional[torch.Generator]    # the request's own generator when params.seed is set
    eos_token_ids: tuple[int, ...] = ()     # suppressed (with stop_token_ids) while output < min_tokens
    grammar: Optional[object] = None        # a GrammarMatcher: structured outputs mask the row (structured.py)


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
        logits, vocab = apply_grammar_masks(logits, rows), logits.shape[1]

        # Classify rows (one pass of cheap attribute checks).
        greedy_idx, random_idx, lp_idx = [], [], []   # type: list[int], list[int], list[int]
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
            token_ids = greedy_tokens(logits)
            return self._with_logprobs(token_ids, rows, lp_idx, raw_logprobs)

        if needs_processing:
            logits = logits.clone()
            self._apply_processing(logits, rows, vocab)

        token_ids: list[int] = [0] * n
        if greedy_idx:
            if len(greedy_idx) == n:
                token_ids = greedy_tokens(logits)
            else:
                g = greedy_tokens(logits[greedy_idx])
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
        """logit_bias, min_tokens, repetition / frequency / presence penalties, written into ``logits``.

        Everything is sparse: the cost is proportional to the number of (row, token) pairs touched,
        never rows x vocab.
        """
        bias_r: list[int] = []
        bias_t: list[int] = []
        bias_v: list[float] = []
        block_r: list[int] = []
        block_t: list[int] = []
        rep_rows: list[int] = []
        rep_n: list[int] = []
        rep_t: list[int] = []
        rep_p: list[float] = []
        out_rows: list[int] = []
        out_n: list[int] = []
        out_t: list[int] = []
        out_f: list[float] = []
        out_p: list[float] = []
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
                n_tok = len(row.prompt_token_ids) + len(row.output_token_ids)
                if n_tok:
                    rep_rows.append(i)
                    rep_n.append(n_tok)
                    rep_t.extend(row.prompt_token_ids)
                    rep_t.extend(row.output_token_ids)
                    rep_p.append(p.repetition_penalty)
            if (p.frequency_penalty != 0.0 or p.presence_penalty != 0.0) and row.output_token_ids:
                out_rows.append(i)
                out_n.append(len(row.output_token_ids))
                out_t.extend(row.output_token_ids)
                out_f.append(p.frequency_penalty)
                out_p.append(p.presence_penalty)

        if bias_r:
            logits.index_put_((torch.tensor(bias_r), torch.tensor(bias_t)),
                              torch.tensor(bias_v, dtype=logits.dtype), accumulate=True)
        if block_r:
            logits[torch.tensor(block_r), torch.tensor(block_t)] = float("-inf")
        if rep_rows:
            counts = _long(rep_n)
            r_idx = torch.repeat_interleave(_long(rep_rows), counts)
            t_idx = _long(rep_t)
            pen = torch.repeat_interleave(torch.tensor(rep_p, dtype=logits.dtype), counts)
            r_idx, t_idx, pen = _in_vocab(r_idx, t_idx, vocab, pen)
            vals = logits[r_idx, t_idx]
            # Duplicate (row, token) pairs all write the same value, so each token is penalized once.
            logits[r_idx, t_idx] = torch.where(vals > 0, vals / pen, vals * pen)
        if out_rows:
            counts = _long(out_n)
            rows_t = _long(out_rows)
            r_idx = torch.repeat_interleave(rows_t, counts)
            t_idx = _long(out_t)
            freq = torch.repeat_interleave(torch.tensor(out_f, dtype=logits.dtype), counts)
            r_idx, t_idx, freq = _in_vocab(r_idx, t_idx, vocab, freq)
            # frequency: subtracted once per occurrence (accumulate sums duplicates).
            if any(out_f):
                logits.index_put_((r_idx, t_idx), -freq, accumulate=True)
            # presence: once per distinct token.
            if any(out_p):
                flat = torch.unique(r_idx * vocab + t_idx)
                u_r = torch.div(flat, vocab, rounding_mode="floor")
                u_t = flat - u_r * vocab
                row_to_pen = torch.zeros(len(rows), dtype=logits.dtype)
                row_to_pen[rows_t] = torch.tensor(out_p, dtype=logits.dtype)
                logits.index_put_((u_r, u_t), -row_to_pen[u_r], accumulate=True)

    # ------------------------------------------------------------------ random sampling
    def _uniforms(self, rows: list[SamplingRow]) -> torch.Tensor:
        """One U[0, 1) per row: seeded rows from their own generator, the rest from the shared one."""
        r = len(rows)
        seeded = [j for j, row in enumerate(rows) if row.generator is not None]
        if not seeded:
            return torch.rand(r, dtype=torch.float64, generator=self.generator)
        values = [0.0] * r
        if len(seeded) < r:
            seeded_set = set(seeded)
            unseeded = [j for j in range(r) if j not in seeded_set]
            shared = torch.rand(len(unseeded), dtype=torch.float64, generator=self.generator).tolist()
            for j, v in zip(unseeded, shared):
                values[j] = v
        for j in seeded:
            values[j] = torch.rand(1, dtype=torch.float64, generator=rows[j].generator).item()
        return torch.tensor(values, dtype=torch.float64)

    def _sample_random(self, logits: torch.Tensor, rows: list[SamplingRow], vocab: int) -> list[int]:
        """Sample the random rows. ``logits``: [R, V] processed logits of exactly these rows.

        Rows with top_k or top_p are sampled among candidates (a small ``topk``; top_p-only rows take
        the top ``_TOP_P_CANDIDATES`` and fall back to a full sort when those do not hold top_p of the
        mass), so the full-vocab sort is rare. Sampling is inverse-CDF with one uniform per row on the
        unnormalized weights ``exp(logit - max)``: each row's result depends only on that row and its
        uniform (batch-independent for seeded rows).
        """
        r = len(rows)
        temps = [row.params.temperature for row in rows]
        if all(t == 1.0 for t in temps):
            scaled = logits
        else:
            scaled = logits / torch.tensor(temps, dtype=logits.dtype).unsqueeze(1)
        u = self._uniforms(rows)
        result: list[int] = [0] * r

        ks = [row.params.top_k if 0 < row.params.top_k < vocab else 0 for row in rows]
        tps = [row.params.top_p for row in rows]
        mps = [row.params.min_p for row in rows]
        cand = [j for j in range(r) if ks[j] or tps[j] < 1.0]
        full = [j for j in range(r) if not (ks[j] or tps[j] < 1.0)]

        if cand:
            sub = scaled if len(cand) == r else scaled[cand]
            n_c = [ks[j] if ks[j] else min(_TOP_P_CANDIDATES, vocab) for j in cand]
            kc = max(n_c)
            vals, idx = sub.topk(kc, dim=-1)
            # Total weight of the whole row (relative to its max) for top_p-only rows: the top_p
            # threshold is a fraction of the full distribution's mass.
            p_only = [c for c, j in enumerate(cand) if not ks[j]]
            z = None
            fallback: list[int] = []
            if p_only:
                z = torch.full((len(cand),), float("nan"), dtype=torch.float32)
                lse = sub[p_only].logsumexp(dim=-1)
                z_p = torch.exp(lse - vals[p_only, 0])
                cov = torch.exp(vals[p_only, :min(_TOP_P_CANDIDATES, vocab)].logsumexp(dim=-1) - lse)
                need = torch.tensor([tps[cand[c]] for c in p_only], dtype=cov.dtype)
                ok = (cov >= need).tolist()
                z[p_only] = z_p
                fallback = [cand[c] for c, good in zip(p_only, ok) if not good]
            if fallback:
                fb = set(fallback)
                keep = [c for c, j in enumerate(cand) if j not in fb]
                cand = [cand[c] for c in keep]
                n_c = [n_c[c] for c in keep]
                vals, idx = vals[keep], idx[keep]
                z = z[keep] if z is not None else None
            if cand:
                picks = sample_sorted(vals, idx, torch.tensor(n_c), [tps[j] for j in cand],
                                       [mps[j] for j in cand], z, u[cand])
                for j, t in zip(cand, picks):
                    result[j] = t
            if fallback:
                # Second tier: a larger topk for the rows whose nucleus exceeded the first one.
                sub = scaled[fallback]
                k2 = min(_TOP_P_CANDIDATES_2, vocab)
                if k2 < vocab:
                    vals, idx = sub.topk(k2, dim=-1)
                    lse = sub.logsumexp(dim=-1)
                    cov = torch.exp(vals.logsumexp(dim=-1) - lse)
                    need = torch.tensor([tps[j] for j in fallback], dtype=cov.dtype)
                    ok = (cov >= need).tolist()
                    good = [c for c, g in enumerate(ok) if g]
                    if good:
                        rows_g = [fallback[c] for c in good]
                        picks = sample_sorted(vals[good], idx[good], None, [tps[j] for j in rows_g],
                                               [mps[j] for j in rows_g],
                                               torch.exp(lse[good] - vals[good, 0]), u[rows_g])
                        for j, t in zip(rows_g, picks):
                            result[j] = t
                    bad = [c for c, g in enumerate(ok) if not g]
                    fallback = [fallback[c] for c in bad]
                    sub = sub[bad] if fallback else sub
            if fallback:
                # Last resort: the full sort (very flat distributions only).
                vals, idx = sub.sort(dim=-1, descending=True)
                picks = sample_sorted(vals, idx, None, [tps[j] for j in fallback],
                                       [mps[j] for j in fallback], None, u[fallback])
                for j, t in zip(fallback, picks):
                    result[j] = t

        if full:
            sub = scaled if len(full) == r else scaled[full]
            w = (sub - sub.amax(dim=-1, keepdim=True)).exp_()
            if any(mps[j] > 0.0 for j in full):
                mp = torch.tensor([mps[j] for j in full], dtype=w.dtype).unsqueeze(1)
                w.masked_fill_(w < mp, 0.0)
            picks = inverse_cdf(w, u[full]).tolist()
            for j, t in zip(full, picks):
                result[j] = t
        return result

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
