"""Prompt logprobs (vLLM semantics), from the logits of a run of prompt positions."""
from __future__ import annotations

from typing import Optional

import torch


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
