"""The cpu platform's native batched LoRA op (platforms/cpu_lora.py) against the torch op
(core/lora/punica.py) and a per-row float64 reference."""
from __future__ import annotations

import random

import pytest
import torch

from tokenmill.core.lora.punica import add_lora as torch_add_lora, build_mapping
from tokenmill.platforms import cpu_lora

pytestmark = pytest.mark.skipif(cpu_lora.available() is not None, reason=f"native kernels: {cpu_lora.available()}")

def fused_weights(num_slots: int, k_in: int, output_sizes: list[int], max_rank: int, ranks: list[list[int]],
                  dtype: torch.dtype, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """A^T [slots, in, shards * max_rank], B^T block-diagonal, as core/lora/layers.py lays them out:
    slot s's shard i has rank ranks[s][i] (<= max_rank), the rest of its rank slice zero."""
    width = len(output_sizes) * max_rank
    a = torch.zeros(num_slots, k_in, width)
    b = torch.zeros(num_slots, width, sum(output_sizes))
    for slot in range(num_slots):
        col = 0
        for i, size in enumerate(output_sizes):
            r, lo = ranks[slot][i], i * max_rank
            a[slot, :, lo:lo + r] = torch.randn(k_in, r, generator=g) / k_in ** 0.5
            b[slot, lo:lo + r, col:col + size] = torch.randn(r, size, generator=g)
            col += size
    return a.to(dtype), b.to(dtype)


def reference(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
              rows: list[tuple[int, int]]) -> torch.Tensor:
    out, row = y.double().clone(), 0
    for slot, n in rows:
        if slot >= 0:
            out[row:row + n] += x[row:row + n].double() @ a[slot].double() @ b[slot].double()
        row += n
    return out


def check(rows: list[tuple[int, int]], dtype: torch.dtype, k_in: int, output_sizes: list[int], max_rank: int,
          ranks: list[list[int]], seed: int, pass_sizes: bool = True) -> None:
    g = torch.Generator().manual_seed(seed)
    a, b = fused_weights(len(ranks), k_in, output_sizes, max_rank, ranks, dtype, g)
    num = sum(n for _, n in rows)
    x = torch.randn(num, k_in, generator=g).to(dtype)
    y = torch.randn(num, sum(output_sizes), generator=g).to(dtype)
    mapping = build_mapping(rows, torch.device("cpu"))
    assert mapping is not None
    want, got = y.clone(), y.clone()
    torch_add_lora(want, x, a, b, mapping)
    cpu_lora.add_lora(got, x, a, b, mapping, output_sizes if pass_sizes else None)
    exact = reference(y, x, a, b, rows)
    adapted = torch.tensor([s >= 0 for s, n in rows for _ in range(n)])
    assert torch.equal(got[~adapted], y[~adapted]), "base rows must stay untouched"
    if dtype == torch.float32:
        assert torch.allclose(got.double(), exact, atol=1e-5, rtol=1e-5), (got.double() - exact).abs().max()
        assert torch.allclose(got, want, atol=1e-5, rtol=1e-5), (got - want).abs().max()
    else:
        # float32 accumulation, one rounding to bf16 at the end: within half a bf16 ulp of the exact
        # sum (plus float32 noise). The torch op also rounds x A and the delta to bf16: it may be off
        # by a few bf16 ulps of the delta's terms on top of its final rounding.
        ulp = exact.abs().clamp_min(1e-30).log2().floor().exp2() * 2.0 ** -7
        assert ((got.double() - exact).abs() <= 0.5 * ulp + 1e-6).all(), (got.double() - exact).abs().max()
        terms = reference(torch.zeros_like(y), x.abs(), a.abs(), b.abs(), rows)
        assert ((got.double() - want.double()).abs() <= 2 * ulp + 2.0 ** -6 * terms).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mixed_groups_with_base_rows(dtype: torch.dtype) -> None:
    rows = [(1, 1), (-1, 1), (0, 1), (1, 3), (2, 20), (-1, 5), (0, 1), (3, 9), (2, 1)]
    check(rows, dtype, 96, [80], 16, [[16], [16], [16], [16]], seed=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_one_contiguous_group(dtype: torch.dtype) -> None:
    check([(-1, 3), (2, 37), (-1, 2)], dtype, 64, [48], 16, [[16], [16], [16]], seed=1)
    check([(0, 130)], dtype, 64, [48], 16, [[8]], seed=2)        # a prefill chunk, rank below the max


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_block_diagonal_shards(dtype: torch.dtype) -> None:
    """qkv-like (3 shards, odd widths, not multiples of the 16-lane vectors) and gate_up-like (2),
    ranks below max_rank and one shard not adapted, with and without the shard sizes."""
    qkv, qkv_ranks = [72, 24, 40], [[16, 8, 16], [5, 0, 16], [16, 16, 3]]
    rows = [(0, 4), (-1, 2), (2, 13), (1, 7), (0, 2)]
    for pass_sizes in (True, False):
        check(rows, dtype, 80, qkv, 16, qkv_ranks, seed=3, pass_sizes=pass_sizes)
    check(rows, dtype, 48, [200, 200], 8, [[8, 8], [1, 8], [8, 2]], seed=4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_random_mappings(dtype: torch.dtype) -> None:
    rng = random.Random(5)
    for trial in range(12):
        num_slots = rng.randint(1, 5)
        rows = [(rng.randint(-1, num_slots - 1), rng.choice([1, 1, 1, 2, 7, 33, 150]))
                for _ in range(rng.randint(1, 24))]
        if all(slot < 0 for slot, _ in rows):
            rows.append((0, 1))
        shards = rng.choice([[33], [64, 16, 16], [130, 130], [576]])
        max_rank = rng.choice([4, 8, 16, 32])
        ranks = [[rng.randint(1, max_rank) for _ in shards] for _ in range(num_slots)]
        check(rows, dtype, rng.choice([17, 64, 160]), shards, max_rank, ranks, seed=10 + trial)


def test_strided_input_and_output() -> None:
    """x and y as column slices of wider tensors (row stride != width)."""
    g = torch.Generator().manual_seed(6)
    a, b = fused_weights(2, 32, [40], 8, [[8], [6]], torch.float32, g)
    rows = [(1, 5), (-1, 3), (0, 4)]
    mapping = build_mapping(rows, torch.device("cpu"))
    x_wide = torch.randn(12, 50, generator=g)
    y_wide = torch.randn(12, 70, generator=g)
    x, y = x_wide[:, 5:37], y_wide[:, 10:50]
    want = reference(y, x, a, b, rows)
    before = y_wide.clone()
    cpu_lora.add_lora(y, x, a, b, mapping, [40])
    assert torch.allclose(y.double(), want, atol=1e-5, rtol=1e-5)
    assert torch.equal(y_wide[:, :10], before[:, :10]) and torch.equal(y_wide[:, 50:], before[:, 50:])
    y_t = torch.randn(40, 12, generator=g).t()          # y with a non-unit column stride
    want = reference(y_t, x, a, b, rows)
    cpu_lora.add_lora(y_t, x, a, b, mapping)
    assert torch.allclose(y_t.double(), want, atol=1e-5, rtol=1e-5)


def test_bad_input_is_a_value_error() -> None:
    g = torch.Generator().manual_seed(7)
    a, b = fused_weights(1, 16, [32], 8, [[8]], torch.float32, g)
    mapping = build_mapping([(0, 2)], torch.device("cpu"))
    x, y = torch.randn(2, 16), torch.randn(2, 32)
    with pytest.raises(ValueError, match="bfloat16"):
        cpu_lora.add_lora(y, x.bfloat16(), a, b, mapping)
    with pytest.raises(ValueError, match="output_sizes"):
        cpu_lora.add_lora(y, x, a, b, mapping, [16, 8])
    with pytest.raises(ValueError, match="shapes"):
        cpu_lora.add_lora(y, torch.randn(2, 15), a, b, mapping)


def test_cpu_platform_offers_the_native_op() -> None:
    from tokenmill.platforms.cpu import CpuPlatform

    assert CpuPlatform().lora_kernels() is cpu_lora.add_lora
