"""cpu_sdpa's per-step plans: what depends only on a batch's layout, built on the first layer of
a step and shared by the 30-odd layers after it (gather indices, padding masks, and the
cascade plans for rows that share cached prefix blocks), the block gather itself, and the
attention-with-log-sum-exp and merge-by-log-sum-exp steps cascade attention is made of.
"""
from __future__ import annotations

from typing import Optional

import torch

from .interface import AttentionMetadata

_CACHE_ATTR = "_cpu_sdpa_step_cache"


def _step_cache(metadata: AttentionMetadata, block_size: int, sliding_window: Optional[int],
                device: torch.device) -> dict:
    """Tensors that depend only on the batch layout, built on the first layer of a step."""
    cache = getattr(metadata, _CACHE_ATTR, None)
    nd = metadata.num_decodes
    # Keyed on everything it derives from, so a metadata object mutated in place is still safe.
    key = (sliding_window, block_size, nd, tuple(metadata.seq_lens_cpu[:nd]))
    if (cache is not None and cache["key"] == key and cache["block_tables"] is metadata.block_tables
            and cache["seq_lens"] is metadata.seq_lens):
        return cache
    cache = {"key": key, "block_tables": metadata.block_tables, "seq_lens": metadata.seq_lens}
    if nd:
        lens = metadata.seq_lens_cpu[:nd]
        max_len = max(lens)
        nblk = (max_len + block_size - 1) // block_size
        cache["decode_nblk"] = nblk
        cache["decode_max_len"] = max_len
        cache["decode_index"] = metadata.block_tables[:nd, :nblk].reshape(-1).to(torch.long)
        if min(lens) == max_len and sliding_window is None:
            cache["decode_mask"] = None          # all the same length: nothing to mask
        else:
            pos = torch.arange(max_len, device=device).unsqueeze(0)
            seq = metadata.seq_lens[:nd].to(device=device, dtype=torch.long).unsqueeze(1)
            allowed = pos < seq
            if sliding_window is not None:
                allowed &= pos > seq - 1 - sliding_window
            cache["decode_mask"] = allowed.view(nd, 1, 1, max_len)
    cache["cascade"] = _shared_prefix_plan(metadata, block_size, sliding_window, device) if nd else None
    cache["prefill_runs"] = _shared_prefill_runs(metadata, block_size, sliding_window)
    try:
        setattr(metadata, _CACHE_ATTR, cache)
    except (AttributeError, TypeError):   # a frozen or slotted metadata: just recompute
        pass
    return cache


def _gather_blocks(kv_cache: torch.Tensor, index: torch.Tensor, step: Optional[dict] = None) -> torch.Tensor:
    """kv_cache[:, index] for the [2, num_blocks, ...] layout, as one dim-0 `index_select` over a
    [2 * num_blocks, block elements] view (about twice as fast as selecting along dim 1)."""
    if not kv_cache.is_contiguous():
        return kv_cache.index_select(1, index)
    num_blocks = kv_cache.shape[1]
    both = None
    if step is not None:
        both = step.get(("both", num_blocks))
    if both is None:
        both = torch.cat([index, index + num_blocks])
        if step is not None:
            step[("both", num_blocks)] = both
    flat = kv_cache.view(2 * num_blocks, -1)
    if flat.dtype.itemsize == 1 and flat.dtype != torch.uint8:   # fp8: select the raw bytes
        return flat.view(torch.uint8).index_select(0, both).view(flat.dtype).view(2, index.numel(), *kv_cache.shape[2:])
    return flat.index_select(0, both).view(2, index.numel(), *kv_cache.shape[2:])


CASCADE_MIN_TOKENS = 128   # a shared prefix shorter than this is cheaper to gather per sequence


def _shared_prefix_plan(metadata: AttentionMetadata, block_size: int, sliding_window: Optional[int],
                        device: torch.device) -> Optional[dict]:
    """When all decodes start with the same physical blocks (prefix caching at work), attend to
    those blocks once for all queries and only gather each sequence's own suffix (cascade
    attention). None when there is no worthwhile shared prefix."""
    nd = metadata.num_decodes
    if nd < 2 or sliding_window is not None:
        return None
    lens = metadata.seq_lens_cpu[:nd]
    limit = (min(lens) - 1) // block_size          # every sequence keeps >= 1 token of its own
    if limit * block_size < CASCADE_MIN_TOKENS:
        return None
    tables = metadata.block_tables[:nd, :limit]
    same = (tables == tables[:1]).all(0).to(torch.int32)
    shared_blocks = int(same.cumprod(0).sum())
    if shared_blocks * block_size < CASCADE_MIN_TOKENS:
        return None
    prefix_len = shared_blocks * block_size
    suffix_lens = [n - prefix_len for n in lens]
    max_suffix = max(suffix_lens)
    suffix_blocks = (max(lens) + block_size - 1) // block_size - shared_blocks
    plan = {
        "prefix_index": tables[0, :shared_blocks].to(torch.long),
        "prefix_len": prefix_len,
        "suffix_index": metadata.block_tables[:nd, shared_blocks:shared_blocks + suffix_blocks]
        .reshape(-1).to(torch.long),
        "suffix_blocks": suffix_blocks,
        "max_suffix": max_suffix,
        "suffix_mask": None,
    }
    if min(suffix_lens) != max_suffix:
        pos = torch.arange(max_suffix, device=device).unsqueeze(0)
        allowed = pos < torch.tensor(suffix_lens, device=device).unsqueeze(1)
        mask = torch.zeros(allowed.shape, dtype=torch.float32, device=device)
        plan["suffix_mask"] = mask.masked_fill_(~allowed, float("-inf")).view(nd, 1, 1, max_suffix)
    return plan


def _shared_prefill_runs(metadata: AttentionMetadata, block_size: int,
                         sliding_window: Optional[int]) -> dict[int, tuple[int, int]]:
    """{first chunk: (chunks, prefix length)} for runs of prompt chunks of one length whose cached
    context is the same leading blocks and nothing else (a shared system prompt under prefix
    caching): the prefix is attended once for all their queries instead of once per chunk."""
    runs: dict[int, tuple[int, int]] = {}
    if sliding_window is not None or not metadata.causal:
        return runs
    qsl, lens, n = metadata.query_start_loc_cpu, metadata.seq_lens_cpu, metadata.num_seqs
    i = metadata.num_decodes
    while i < n:
        length = qsl[i + 1] - qsl[i]
        prefix = lens[i] - length
        j = i + 1
        if prefix >= CASCADE_MIN_TOKENS and prefix % block_size == 0:
            while j < n and qsl[j + 1] - qsl[j] == length and lens[j] - length == prefix:
                j += 1
            tables = metadata.block_tables[i:j, :prefix // block_size]
            if j - i >= 2 and bool((tables == tables[:1]).all()):
                runs[i] = (j - i, prefix)
            else:
                j = i + 1
        i = j
    return runs


def _attend_with_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Optional[torch.Tensor],
                     scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """SDPA over [B, H, L, D] that also returns the log-sum-exp of each query's scores."""
    if mask is not None and mask.dtype != q.dtype:
        mask = mask.to(q.dtype)
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q, k, v, 0.0, False, attn_mask=mask, scale=scale)[:2]
    return out, lse


def _merge_by_lse(out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor,
                  dtype: torch.dtype) -> torch.Tensor:
    """Attention over two disjoint key sets merged into attention over both: each part weighted by
    its share exp(lse - max) of the softmax denominator (lse [..., H], out [..., H, D])."""
    top = torch.maximum(lse_a, lse_b)
    w_a = torch.exp(lse_a - top).unsqueeze_(-1)
    w_b = torch.exp(lse_b - top).unsqueeze_(-1)
    return out_a.float().mul_(w_a).add_(out_b.float().mul_(w_b)).div_(w_a.add_(w_b)).to(dtype)


def _with_sinks(flash, sinks: Optional[torch.Tensor]):
    """A flash kernel's result as attention with sinks: (out [T, H, D], lse [H, T]) -> out times
    Z / (Z + e^sink) per head (Z = e^lse, the denominator without the sink); without sinks `flash`
    is the output itself."""
    if sinks is None:
        return flash
    out, lse = flash
    return (out.float() * torch.sigmoid(lse.t() - sinks.float()).unsqueeze(-1)).to(out.dtype)
