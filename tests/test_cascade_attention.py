"""Decodes that share physical prefix blocks attend to them once (cascade); same result as reference."""
from __future__ import annotations

import random

import pytest
import torch

from tokenmill.attention_backends.cpu_sdpa import CpuSdpaAttention
from tokenmill.attention_backends.interface import AttentionMetadata
from tokenmill.attention_backends.reference import ReferenceAttention


def _decode_batch(lens, shared_blocks, bs=16, num_blocks=200, seed=0):
    rng = random.Random(seed)
    blocks = list(range(num_blocks))
    rng.shuffle(blocks)
    shared, rest = blocks[:shared_blocks], blocks[shared_blocks:]
    tables = [shared + [rest.pop() for _ in range((n + bs - 1) // bs - shared_blocks)] for n in lens]
    width = max(map(len, tables))
    slots = [tables[i][(n - 1) // bs] * bs + (n - 1) % bs for i, n in enumerate(lens)]
    return AttentionMetadata(
        query_start_loc=torch.arange(len(lens) + 1, dtype=torch.int32),
        seq_lens=torch.tensor(lens, dtype=torch.int32),
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32),
        slot_mapping=torch.tensor(slots), num_decodes=len(lens), max_query_len=1, max_seq_len=max(lens),
        block_size=bs, query_start_loc_cpu=list(range(len(lens) + 1)), seq_lens_cpu=list(lens))


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
