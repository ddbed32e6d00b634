"""Picking tokens from processed logits: greedy rows' argmax, and draws by inverse CDF over the
candidates a row keeps (top-k / top-p / min-p applied to weights relative to the row's max).
Used by the sampler (sampler.py) and speculative decoding's rejection sampler (rejection.py)."""
from __future__ import annotations

from typing import Optional

import torch


def greedy_tokens(logits: torch.Tensor) -> list[int]:
    """Each row's argmax. Through `max(dim=-1)`, which returns the first maximal index as argmax
    does, and whose CPU kernel is vectorized where argmax's is not (a visible share of a large
    decode batch's step, with a 49152-token vocabulary)."""
    return logits.max(dim=-1).indices.tolist()


def inverse_cdf(w: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Index per row drawn proportionally to the non-negative weights ``w`` [R, K] with uniforms ``u`` [R].

    Never returns a zero-weight index: the target is kept strictly below the row total, and
    ``searchsorted(right=True)`` returns the first index whose cumulative weight exceeds it.
    """
    cdf = w.cumsum(dim=-1)
    total = cdf[:, -1:]
    target = (u.unsqueeze(1) * total.double()).to(cdf.dtype)
    target = torch.minimum(target, torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cdf, target, right=True).squeeze(1).clamp_(max=w.shape[1] - 1)


def sample_sorted(vals: torch.Tensor, idx: torch.Tensor, n_valid: Optional[torch.Tensor],
                   top_p: list[float], min_p: list[float], z: Optional[torch.Tensor],
                   u: torch.Tensor) -> list[int]:
    """Sample among candidates sorted by descending logit.

    vals/idx [R, K]: candidate (temperature-scaled) logits and their token ids; n_valid [R]: how many
    leading candidates each row may use (top_k), None for all; z [R]: the full distribution's total
    weight relative to its max for rows whose top_p refers to the whole vocabulary (NaN or None:
    the candidates' own total, i.e. top_p after top_k as vLLM applies it).
    """
    w = (vals - vals[:, :1]).exp_()
    if n_valid is not None:
        pos = torch.arange(vals.shape[1]).unsqueeze(0)
        w.masked_fill_(pos >= n_valid.unsqueeze(1), 0.0)
    if any(p < 1.0 for p in top_p):
        cum = w.cumsum(dim=-1)
        total = cum[:, -1]
        if z is not None:
            total = torch.where(torch.isnan(z), total, z)
        tp = torch.tensor([p if p < 1.0 else float("inf") for p in top_p], dtype=w.dtype)
        # Drop a candidate when the mass strictly before it already reaches top_p (keeps the first).
        remove = (cum - w) >= (tp * total).unsqueeze(1)
        remove[:, 0] = False
        w.masked_fill_(remove, 0.0)
    if any(p > 0.0 for p in min_p):
        # Weights are relative to the max (the first candidate is 1), so min_p compares directly.
        mp = torch.tensor(min_p, dtype=w.dtype).unsqueeze(1)
        w.masked_fill_(w < mp, 0.0)
    pick = inverse_cdf(w, u)
    return idx.gather(1, pick.unsqueeze(1)).squeeze(1).tolist()
