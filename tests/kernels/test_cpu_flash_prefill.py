"""The bf16 prompt-attention kernels against float64: the native one (attention_backends/csrc/
flash_prefill.cpp) and the same contract on torch's flash kernel (what AMX hosts run)."""
from __future__ import annotations

import pytest
import torch

from tokenmill.attention_backends import cpu_flash_prefill

native_only = pytest.mark.skipif(cpu_flash_prefill.available() is not None, reason=str(cpu_flash_prefill.available()))
KERNELS = {"native": (cpu_flash_prefill.flash_prefill, cpu_flash_prefill.flash_prefill_batch),
           "torch": (cpu_flash_prefill.torch_flash, cpu_flash_prefill.torch_flash_batch)}


def _reference(q, k, v, scale, q_offset, causal, window=None):
    """float64 softmax(q k^T) v per head, query i at position q_offset + i (a sliding window: keys
    more than `window` - 1 before it hidden too); and the log-sum-exp."""
    group = q.shape[1] // k.shape[1]
    kk = k.double().repeat_interleave(group, 1)
    vv = v.double().repeat_interleave(group, 1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), kk) * scale
    if causal:
        pos_q = torch.arange(q.shape[0]).unsqueeze(1) + q_offset
        scores = scores.masked_fill(torch.arange(k.shape[0]).unsqueeze(0) > pos_q, float("-inf"))
        if window:
            scores = scores.masked_fill(torch.arange(k.shape[0]).unsqueeze(0) <= pos_q - window, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), vv), scores.logsumexp(-1)


def _kernel(name: str, batch: bool = False):
    if name == "native" and cpu_flash_prefill.available() is not None:
        pytest.skip(str(cpu_flash_prefill.available()))
    return KERNELS[name][int(batch)]


@pytest.mark.parametrize("kernel", ["native", "torch"])
@pytest.mark.parametrize("heads,kv_heads,head_size", [(9, 3, 64), (4, 4, 64), (8, 2, 128)])
@pytest.mark.parametrize("tq,tk,causal", [(37, 37, True), (16, 16, True), (20, 53, True), (5, 300, False),
                                          (130, 130, True)])
def test_flash_prefill_matches_float64(kernel, heads, kv_heads, head_size, tq, tk, causal):
    """Fresh prompts (tq = tk), chunks after cached context (tq < tk, causal offset), a shared
    prefix seen whole (non-causal), lengths off the 16-key blocks and 8-row tiles."""
    flash_prefill = _kernel(kernel)
    torch.manual_seed(tq + tk)
    q = torch.randn(tq, heads, head_size).bfloat16()
    k = torch.randn(tk, kv_heads, head_size).bfloat16()
    v = torch.randn(tk, kv_heads, head_size).bfloat16()
    offset = tk - tq if causal else 0
    out, lse = flash_prefill(q, k, v, head_size ** -0.5, offset, causal, return_lse=True)
    ref, ref_lse = _reference(q, k, v, head_size ** -0.5, offset, causal)
    # bf16 output and bf16 probabilities in P.V: about 2^-8 relative
    assert (out.double() - ref).abs().max().item() < 2e-2
    assert (lse.double() - ref_lse).abs().max().item() < 1e-3
    sdpa = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None], scale=head_size ** -0.5,
        attn_mask=None if not causal else (torch.arange(tk)[None] <= torch.arange(tq)[:, None] + offset),
        enable_gqa=heads != kv_heads)[0].transpose(0, 1)
    assert (out.double() - ref).abs().max() <= 2 * (sdpa.double() - ref).abs().max() + 4e-3


@pytest.mark.parametrize("kernel", ["native", "torch"])
@pytest.mark.parametrize("lengths", [(24, 24, 24), (5, 40, 17, 1)])
def test_batch_of_prompts_matches_each_alone(kernel, lengths):
    """Prompts back to back, each attending to its own keys from position 0 (one length: one
    batched call for torch's kernel; mixed lengths: one each), with the log-sum-exp."""
    flash_batch = _kernel(kernel, batch=True)
    torch.manual_seed(len(lengths))
    total = sum(lengths)
    q, k, v = (torch.randn(total, h, 64).bfloat16() for h in (9, 3, 3))
    starts = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    out, lse = flash_batch(q, k, v, 0.125, starts, True, return_lse=True)
    for a, b in zip(starts.tolist(), starts.tolist()[1:]):
        ref, ref_lse = _reference(q[a:b], k[a:b], v[a:b], 0.125, 0, True)
        assert (out[a:b].double() - ref).abs().max().item() < 2e-2
        assert (lse[:, a:b].double() - ref_lse).abs().max().item() < 1e-3


@native_only
@pytest.mark.parametrize("head_size", [64, 128])
@pytest.mark.parametrize("tq,tk,window", [(100, 100, 24), (37, 37, 16), (20, 90, 33), (64, 64, 1), (9, 9, 50)])
def test_sliding_window_matches_float64(head_size, tq, tk, window):
    """The native tiles under a sliding window (a window narrower than a tile of rows, chunks after
    cached context, a window wider than the prompt); lse too; the batch entry the same per prompt."""
    if cpu_flash_prefill.available() is not None:
        pytest.skip(str(cpu_flash_prefill.available()))
    torch.manual_seed(tq * window)
    q = torch.randn(tq, 8, head_size).bfloat16()
    k, v = torch.randn(tk, 2, head_size).bfloat16(), torch.randn(tk, 2, head_size).bfloat16()
    out, lse = cpu_flash_prefill.flash_prefill(q, k, v, 0.1, tk - tq, True, return_lse=True, window=window)
    ref, ref_lse = _reference(q, k, v, 0.1, tk - tq, True, window)
    assert (out.double() - ref).abs().max().item() < 2e-2
    assert (lse.double() - ref_lse).abs().max().item() < 1e-3
    if tq == tk:
        starts = torch.tensor([0, tq, 2 * tq])
        both = cpu_flash_prefill.flash_prefill_batch(torch.cat((q, q)), torch.cat((k, k)), torch.cat((v, v)), 0.1,
                                                     starts, True, window=window)
        assert torch.equal(both[:tq], out) and torch.equal(both[tq:], out)


def test_strided_query_and_bad_head_size():
    """q, k, v as slices of fused projections, each its own token stride (the model's q and k
    come from the rotated [q | k] rows, v from the [q | k | v] rows); head size 80 refused."""
    torch.manual_seed(0)
    qkv = torch.randn(40, 9 + 3 + 3, 64).bfloat16()
    qk = qkv[:, :12].clone()
    q, k, v = qk[:, :9], qk[:, 9:], qkv[:, 12:]
    assert cpu_flash_prefill.covers(q, k, v)
    out = cpu_flash_prefill.flash_prefill(q, k, v, 0.125, 0, True)
    ref, _ = _reference(q.contiguous(), k.contiguous(), v.contiguous(), 0.125, 0, True)
    assert (out.double() - ref).abs().max().item() < 2e-2
    x = torch.randn(4, 2, 80).bfloat16()
    assert not cpu_flash_prefill.covers(x, x, x)
    with pytest.raises(ValueError, match="head size 80"):
        cpu_flash_prefill.flash_prefill(x, x, x, 0.1, 0, True)


@pytest.mark.parametrize("kernel", ["native", "torch"])
@pytest.mark.parametrize("causal", [True, False])
def test_scores_rising_far_above_the_first_keys(kernel, causal):
    """Later keys score up to ~60 nats above the first ones (large logits that grow along the
    prompt), so a row's running maximum moves many times, by more than the native AMX kernel's
    lazy-rescale margin (2^8) and by less: every move must rescale what was accumulated."""
    flash_prefill = _kernel(kernel)
    torch.manual_seed(7)
    tq = tk = 300
    q = (torch.randn(tq, 9, 64) + 2.0).bfloat16()
    ramp = torch.linspace(0.0, 4.0, tk)[:, None, None]
    k = (torch.randn(tk, 3, 64) * 0.5 + ramp).bfloat16()
    v = torch.randn(tk, 3, 64).bfloat16()
    out, lse = flash_prefill(q, k, v, 0.125, 0, causal, return_lse=True)
    ref, ref_lse = _reference(q, k, v, 0.125, 0, causal)
    assert (out.double() - ref).abs().max().item() < 3e-2
    assert ((lse.double() - ref_lse).abs() / ref_lse.abs().clamp(min=1)).max().item() < 1e-4


def test_a_chunk_after_cached_context_equals_the_same_rows_of_the_whole_prompt():
    """The AMX kernel's reference maxima are whole numbers in base 2, so P's bf16 rounding does
    not depend on which rows share a tile: a prompt's rows recomputed as a chunk after its cached
    context (a prefix-cache hit) come out bit-identical, lse included."""
    flash_prefill = _kernel("native")
    if not getattr(torch.cpu, "_is_amx_tile_supported", lambda: False)():
        pytest.skip("this CPU has no AMX tiles: the kernel's AVX512-BF16 path promises no such identity")
    torch.manual_seed(1)
    q = (torch.randn(100, 9, 64) * 4).bfloat16()
    k, v = torch.randn(100, 3, 64).bfloat16(), torch.randn(100, 3, 64).bfloat16()
    whole, whole_lse = flash_prefill(q, k, v, 0.125, 0, True, return_lse=True)
    for start, stop in ((98, 100), (37, 40), (0, 5), (50, 83)):
        part, part_lse = flash_prefill(q[start:stop], k[:stop], v[:stop], 0.125, start, True, return_lse=True)
        assert torch.equal(part, whole[start:stop]) and torch.equal(part_lse, whole_lse[:, start:stop])
