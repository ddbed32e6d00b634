"""Expert parallelism (vLLM's `--enable-expert-parallel`): a mixture-of-experts layer's experts split
over the tensor-parallel ranks, whole, in contiguous ranges (`expert_range`: rank r owns experts
[r * E / n, (r + 1) * E / n), the first ranks one more when E does not divide), instead of every
expert's intermediate size split over all of them. Attention and the shared experts stay
tensor-parallel, so every rank still holds the same (replicated) hidden states for the same tokens.

Two ways for the tokens to reach the rank owning their expert, both over torch.distributed only
(gloo on CPU, the accelerator's library elsewhere) and both running the layer's own expert op (the
platform's kernel or moe_reference) on the rank's local expert ids:

* `all_reduce` (the default, and vLLM's own for expert parallelism without data-parallel attention):
  each rank already holds every token, so it runs its experts on the (token, expert) pairs routed to
  them and one all-reduce sums the ranks' parts — the volume of the tensor-parallel all-reduce it
  replaces, and no extra collective.
* `all_to_all`: each rank takes its 1/n of the tokens, sends each (token, expert) pair's hidden row
  (with its expert id and weight) to the expert's owner with `all_to_all_single` (counts exchanged
  first), the owner runs its experts on what it received, a second all_to_all returns the weighted
  rows, the sender adds them up in the original order (expert order, as moe_reference does) and an
  all-gather rebuilds the replicated [T, H]. This is the exchange a data-parallel attention (tokens
  not replicated) needs; here it moves more bytes than the all-reduce (k rows per token out and back).

Both give each token its experts' sum in expert order, as one rank does.
"""
from __future__ import annotations

from typing import Any, Protocol

import torch

from tokenmill.platforms.interface import graph_capturing

from ..distributed import all_reduce, get_state


class ExpertLayer(Protocol):
    expert_start: int
    expert_end: int
    num_experts: int

    def experts(self, hidden: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor: ...


def expert_range(num_experts: int, rank: int, size: int) -> tuple[int, int]:
    """[start, end) of the experts rank `rank` of `size` owns (contiguous; the first num_experts % size
    ranks take one more)."""
    base, extra = divmod(num_experts, size)
    start = rank * base + min(rank, extra)
    return start, start + base + (1 if rank < extra else 0)


def local_experts(num_experts: int) -> tuple[int, int]:
    """[start, end) of the experts this rank holds: its range at expert parallelism, else all of them."""
    state = get_state()
    if not state.expert_parallel:
        return 0, num_experts
    if num_experts < state.tp_size:
        raise ValueError(f"enable_expert_parallel: {num_experts} experts cannot give each of "
                         f"tensor_parallel_size={state.tp_size} ranks one; use a tensor_parallel_size <= {num_experts}")
    return expert_range(num_experts, state.tp_rank, state.tp_size)


def parallel_experts(layer: ExpertLayer, hidden: torch.Tensor, weights: torch.Tensor,
                     ids: torch.Tensor) -> torch.Tensor:
    """The routed sum over every rank's experts [T, H], the same on every rank."""
    if get_state().expert_exchange == "all_to_all" and not graph_capturing(hidden):
        return _all_to_all(layer, hidden, weights, ids)
    return all_reduce(_local_part(layer, hidden, weights, ids))


def _local_part(layer: ExpertLayer, hidden: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Sum over each token's experts that this rank owns (zero rows for tokens routed elsewhere)."""
    start, end = layer.expert_start, layer.expert_end
    if graph_capturing(hidden):
        # No data-dependent shapes inside a captured graph: every pair, weighted 0 where another rank owns it.
        mine = (ids >= start) & (ids < end)
        local = (ids - start).clamp(0, end - start - 1)
        return layer.experts(hidden, weights * mine.to(weights.dtype), local)
    tokens, slots, expert = _pairs_by_expert(ids, start, end)
    out = torch.zeros_like(hidden)
    if tokens.numel():
        out.index_add_(0, tokens, _run_pairs(layer, hidden[tokens], weights[tokens, slots], expert - start))
    return out


def _pairs_by_expert(ids: torch.Tensor, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(token, slot, expert) of the (token, slot) pairs routed to experts [start, end), sorted by
    expert (stable over the slot-major order moe_reference uses, so the sums add up in its order)."""
    t = ids.shape[0]
    flat = ids.t().reshape(-1)
    picked = ((flat >= start) & (flat < end)).nonzero().squeeze(1)
    order = picked[torch.argsort(flat[picked], stable=True)]
    return order % t, order // t, flat[order]


def _run_pairs(layer: ExpertLayer, rows: torch.Tensor, weights: torch.Tensor, local_ids: torch.Tensor) -> torch.Tensor:
    """Each row through its one local expert, times its weight: [R, H]."""
    return layer.experts(rows, weights[:, None], local_ids[:, None])


def _all_to_all(layer: Any, hidden: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    import torch.distributed as dist
    state = get_state()
    n, rank, group = state.tp_size, state.tp_rank, state.tp_group
    t, width = hidden.shape
    lo, hi = expert_range(t, rank, n)                  # this rank's share of the tokens
    tokens, slots, expert = _pairs_by_expert(ids[lo:hi], 0, layer.num_experts)
    owners = _owners(layer, hidden.device)
    send_counts = torch.bincount(owners[expert], minlength=n)     # pairs sorted by expert: by owner too
    recv_counts = torch.empty_like(send_counts)
    dist.all_to_all_single(recv_counts, send_counts, group=group)
    send, recv = send_counts.tolist(), recv_counts.tolist()      # the shapes below need them on the host
    # Each pair's expert id and weight travel beside its row, in float64 (exact for ids and for weights
    # in float32 / bf16 / fp16).
    meta = torch.stack((expert.double(), weights[lo:hi][tokens, slots].double()), dim=1)
    rows_in = hidden.new_empty(sum(recv), width)
    meta_in = meta.new_empty(sum(recv), 2)
    dist.all_to_all_single(rows_in, hidden[lo:hi][tokens].contiguous(), recv, send, group=group)
    dist.all_to_all_single(meta_in, meta, recv, send, group=group)
    results = hidden.new_empty(0, width) if not rows_in.shape[0] else _run_pairs(
        layer, rows_in, meta_in[:, 1].to(weights.dtype), meta_in[:, 0].long() - layer.expert_start)
    back = hidden.new_empty(tokens.shape[0], width)
    dist.all_to_all_single(back, results.contiguous(), send, recv, group=group)
    share = max(expert_range(t, 0, n)[1], 1)           # the largest share: all_gather takes equal sizes
    mine = hidden.new_zeros(share, width)
    if tokens.numel():
        mine.index_add_(0, tokens, back)
    parts = [torch.empty_like(mine) for _ in range(n)]
    dist.all_gather(parts, mine, group=group)
    return torch.cat([part[:b - a] for part, (a, b) in zip(parts, (expert_range(t, r, n) for r in range(n)))])


def _owners(layer: Any, device: torch.device) -> torch.Tensor:
    """The rank owning each of the layer's experts [E] (cached on the layer)."""
    owners = getattr(layer, "_expert_owners", None)
    if owners is None or owners.device != device:
        n = get_state().tp_size
        sizes = [b - a for a, b in (expert_range(layer.num_experts, r, n) for r in range(n))]
        owners = torch.repeat_interleave(torch.arange(n, device=device), torch.tensor(sizes, device=device))
        layer._expert_owners = owners
    return owners
