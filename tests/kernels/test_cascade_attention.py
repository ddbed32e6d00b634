"""Decodes that share physical prefix blocks attend to them once (cascade); same result as reference."""
from __future__ import annotations


import pytest
import torch

from tokenmill.attention_backends.cpu_sdpa import CpuSdpaAttention
from tokenmill.attention_backends.reference import ReferenceAttention

from model_helpers import decode_batch


def _decode_batch(lens, shared_blocks, **kwargs):
    return decode_batch(lens, shared_blocks, **kwargs)[1]


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("lens", [[170, 200, 161, 190], [300, 300, 300]])
def test_cascade_matches_reference(dtype, tol, lens):
    torch.manual_seed(0)
    heads, kv_heads, d, bs = 9, 3, 64, 16
    cache = torch.randn(2, 200, bs, kv_heads, d).to(dtype)
    q = torch.randn(len(lens), heads, d).to(dtype)
    k = torch.randn(len(lens), kv_heads, d).to(dtype)
    v = torch.randn(len(lens), kv_heads, d).to(dtype)
    meta = _decode_batch(lens, shared_blocks=9)
    fast = CpuSdpaAttention(heads, d, d ** -0.5, kv_heads).forward(q, k, v, cache.clone(), meta)
    assert meta._cpu_sdpa_step_cache["cascade"] is not None   # the shared-prefix path really ran
    ref = ReferenceAttention(heads, d, d ** -0.5, kv_heads).forward(q, k, v, cache.clone(),
                                                                     _decode_batch(lens, shared_blocks=9))
    assert (fast.float() - ref.float()).abs().max().item() < tol


def test_no_cascade_without_a_shared_prefix():
    meta = _decode_batch([170, 200], shared_blocks=0)
    q = torch.randn(2, 9, 64)
    kv = torch.randn(2, 3, 64)
    CpuSdpaAttention(9, 64, 0.125, 3).forward(q, kv, kv, torch.zeros(2, 200, 16, 3, 64), meta)
    assert meta._cpu_sdpa_step_cache["cascade"] is None


def _prefill_batch(prefix_blocks: int, chunks: list[int], bs: int = 16, seed: int = 0):
    """Prompt chunks of these lengths, each after the same `prefix_blocks` cached blocks (their
    first positions) and nothing else cached; blocks drawn from a shuffled pool of 200."""
    import random

    from tokenmill.attention_backends.interface import AttentionMetadata
    rng = random.Random(seed)
    pool = list(range(200))
    rng.shuffle(pool)
    shared, rest = pool[:prefix_blocks], pool[prefix_blocks:]
    prefix = prefix_blocks * bs
    tables, slots = [], []
    for n in chunks:
        table = shared + [rest.pop() for _ in range((prefix + n + bs - 1) // bs - prefix_blocks)]
        tables.append(table)
        slots += [table[p // bs] * bs + p % bs for p in range(prefix, prefix + n)]
    qsl = [0]
    for n in chunks:
        qsl.append(qsl[-1] + n)
    width = max(map(len, tables))
    lens = [prefix + n for n in chunks]
    return AttentionMetadata(
        query_start_loc=torch.tensor(qsl, dtype=torch.int32), seq_lens=torch.tensor(lens, dtype=torch.int32),
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32),
        slot_mapping=torch.tensor(slots), num_decodes=0, max_query_len=max(chunks), max_seq_len=max(lens),
        block_size=bs, query_start_loc_cpu=qsl, seq_lens_cpu=lens)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("chunks,runs", [([24, 24, 24], {0: (3, 144)}),
                                         ([24, 24, 7, 7, 24], {0: (2, 144), 2: (2, 144)})])
def test_prompt_chunks_after_a_shared_prefix_attend_to_it_once(dtype, tol, chunks, runs):
    """A shared system prompt under prefix caching: chunks of one length after the same cached
    blocks run as one cascade (prefix once for all queries, own tokens causally, merged by
    log-sum-exp); a chunk of another length breaks the run. Same result as the reference."""
    torch.manual_seed(0)
    heads, kv_heads, d = 9, 3, 64
    cache = torch.randn(2, 200, 16, kv_heads, d).to(dtype)
    t = sum(chunks)
    q, k, v = (torch.randn(t, n, d).to(dtype) for n in (heads, kv_heads, kv_heads))
    meta = _prefill_batch(9, chunks)
    fast = CpuSdpaAttention(heads, d, d ** -0.5, kv_heads).forward(q, k, v, cache.clone(), meta)
    assert meta._cpu_sdpa_step_cache["prefill_runs"] == runs
    ref = ReferenceAttention(heads, d, d ** -0.5, kv_heads).forward(q, k, v, cache.clone(), _prefill_batch(9, chunks))
    assert (fast.float() - ref.float()).abs().max().item() < tol
