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
