"""Rejection sampling for speculative decoding with a random drafter (Leviathan et al. 2023, Chen
et al. 2023), on the distributions the sampler itself draws from.

A draft token d, drawn from the draft's distribution q, is accepted with probability
min(1, p(d) / q(d)) where p is the target's distribution at that position; at the first rejection
the token is drawn from normalize(max(0, p - q)) instead and the step ends there; when every draft
is accepted a bonus token is drawn from p at the position after the last draft. Each emitted
token is then distributed exactly as p given the tokens before it.

p and q are "what the sampler would sample from": the grammar mask, logit_bias, min_tokens,
repetition/frequency/presence penalties (`processed_logits`, the sampler's own processing), then
temperature, top_k, top_p and min_p with the sampler's semantics (`probabilities`). A drafter that
proposes one token deterministically (n-gram) has q = one-hot(d): accepted with probability p(d),
else drawn from p without d -- which is "draw y ~ p, accept iff y == d", what the sampler does for
n-gram drafts unchanged. `verify` takes q=None for that case.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch

from .draw import greedy_tokens, inverse_cdf
from .sampler import _GREEDY_EPS, Sampler, SamplerOutput, SamplingRow
from .structured import apply_grammar_masks

_PROCESSOR = Sampler()      # for its (stateless) logit processing


def is_greedy(row: SamplingRow) -> bool:
    return row.params.temperature < _GREEDY_EPS


@torch.inference_mode()
def masked_and_processed(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> tuple[torch.Tensor, torch.Tensor]:
    """(grammar-masked logits, the same after logit_bias / min_tokens / penalties): new tensors,
    the sampler's processing in its order. The first is what reported logprobs come from."""
    masked = apply_grammar_masks(logits.float().clone(), rows)
    processed = masked.clone()
    _PROCESSOR._apply_processing(processed, list(rows), processed.shape[1])
    return masked, processed


@torch.inference_mode()
def probabilities(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    """[R, V] float32: the distribution the sampler draws each (random) row from, given its
    processed logits: temperature, then top_k, top_p (of the top_k candidates when top_k is set,
    else of the whole distribution, as vLLM applies them), then min_p relative to the top token."""
    r, vocab = logits.shape
    temps = torch.tensor([row.params.temperature for row in rows], dtype=logits.dtype).unsqueeze(1)
    scaled = logits / temps
    w = (scaled - scaled.amax(dim=-1, keepdim=True)).exp_()
    ks = [row.params.top_k if 0 < row.params.top_k < vocab else 0 for row in rows]
    tps = [row.params.top_p for row in rows]
    cand = [j for j in range(r) if ks[j] or tps[j] < 1.0]
    if cand:
        sub = w[cand]
        vals, idx = sub.sort(dim=-1, descending=True)
        pos = torch.arange(vocab).unsqueeze(0)
        vals.masked_fill_(pos >= torch.tensor([ks[j] or vocab for j in cand]).unsqueeze(1), 0.0)
        if any(tps[j] < 1.0 for j in cand):
            cum = vals.cumsum(dim=-1)
            tp = torch.tensor([tps[j] if tps[j] < 1.0 else float("inf") for j in cand], dtype=w.dtype)
            remove = (cum - vals) >= (tp * cum[:, -1]).unsqueeze(1)   # mass before it reached top_p
            remove[:, 0] = False
            vals.masked_fill_(remove, 0.0)
        w[cand] = torch.zeros_like(sub).scatter_(1, idx, vals)
    mps = [row.params.min_p for row in rows]
    if any(m > 0.0 for m in mps):
        w.masked_fill_(w < torch.tensor(mps, dtype=w.dtype).unsqueeze(1), 0.0)
    return w / w.sum(dim=-1, keepdim=True)


@torch.inference_mode()
def sample_rows(logits: torch.Tensor, rows: Sequence[SamplingRow],
                sampler: Sampler) -> tuple[list[int], dict[int, torch.Tensor]]:
    """A drafter's tokens, one per row, drawn as the sampler would (greedy rows: argmax), and the
    distribution each random row was drawn from, by row index (its q)."""
    _, processed = masked_and_processed(logits, rows)
    tokens = [0] * len(rows)
    greedy = [i for i, row in enumerate(rows) if is_greedy(row)]
    rand = [i for i, row in enumerate(rows) if not is_greedy(row)]
    if greedy:
        for i, t in zip(greedy, greedy_tokens(processed[greedy])):
            tokens[i] = t
    q: dict[int, torch.Tensor] = {}
    if rand:
        sub_rows = [rows[i] for i in rand]
        probs = probabilities(processed[rand], sub_rows)
        picks = inverse_cdf(probs, sampler._uniforms(sub_rows)).tolist()
        for j, i in enumerate(rand):
            tokens[i] = picks[j]
            q[i] = probs[j]
    return tokens, q


@torch.inference_mode()
def verify(logits: torch.Tensor, rows: Sequence[SamplingRow],
           groups: Sequence[tuple[list[int], Optional[torch.Tensor]]], sampler: Sampler) -> SamplerOutput:
    """Rejection sampling for sequences whose rows verify drafts. `rows` are the sequences' rows one
    after the other (len(drafts) + 1 each, as Speculator.sampling_rows builds them) and `logits`
    theirs; `groups` gives each sequence's drafts and their q ([len(drafts), V]; None: one-hot).

    Row j of a sequence gets draft j while the drafts are accepted, then the replacement (or the
    bonus token) -- so "append while the token equals the draft" (the scheduler's rule) stops there.
    Rows after it repeat their draft and are never read. One uniform per row, as the sampler draws
    them (a seeded sequence's from its own generator): row j's decides draft j's acceptance, the
    last row's the token drawn at the end (replacement or bonus)."""
    masked, processed = masked_and_processed(logits, rows)
    p = probabilities(processed, rows)
    u = sampler._uniforms(list(rows))
    starts, draft_rows, flat = [], [], []
    start = 0
    for drafts, _ in groups:
        starts.append(start)
        draft_rows.extend(range(start, start + len(drafts)))
        flat.extend(drafts)
        start += len(drafts) + 1
    assert start == len(rows), (start, len(rows))
    d_idx = torch.tensor(flat, dtype=torch.long)
    p_d = p[torch.tensor(draft_rows, dtype=torch.long), d_idx].double()
    q_rows = [q if q is not None else torch.nn.functional.one_hot(torch.tensor(d), p.shape[1]).to(p.dtype)
              for d, q in groups]
    q_all = torch.cat(q_rows) if q_rows else p[:0]
    q_d = q_all[torch.arange(len(flat)), d_idx].double()
    accepted = (u[torch.tensor(draft_rows, dtype=torch.long)] * q_d < p_d).tolist()
    finals, last_rows, final_u = [], [], []
    at = 0
    for (drafts, _), s in zip(groups, starts):
        m = next((j for j in range(len(drafts)) if not accepted[at + j]), len(drafts))
        if m < len(drafts):
            residual = (p[s + m] - q_all[at + m]).clamp_(min=0.0)
            finals.append(residual if bool(residual.sum() > 0) else p[s + m])
        else:
            finals.append(p[s + m])                        # every draft accepted: the bonus token
        last_rows.append(s + m)
        final_u.append(s + len(drafts))      # the one uniform no acceptance test used
        at += len(drafts)
    picks = inverse_cdf(torch.stack(finals), u[final_u]).tolist()
    tokens: list[int] = []
    for (drafts, _), s, row, pick in zip(groups, starts, last_rows, picks):
        own = list(drafts) + [pick]
        own[row - s] = pick
        tokens.extend(own)
    lp_idx = [i for i, row in enumerate(rows) if row.params.logprobs is not None]
    raw = torch.log_softmax(masked[lp_idx], dim=-1) if lp_idx else None
    return Sampler._with_logprobs(tokens, list(rows), lp_idx, raw)
