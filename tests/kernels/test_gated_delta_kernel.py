"""The cpu platform's native Gated DeltaNet decode step (platforms/cpu_recurrent.py) against the torch
reference (core/layers/gated_deltanet.py gated_delta_rule_reference, recurrent form): a batch of
sequences whose states sit in scattered slots of a state cache, GQA (fewer key heads than value
heads, passed un-repeated as the layer passes them), the layer's strided views of one projection,
value dims that fill whole and partial column tiles, several tokens in one call, bf16 activations;
the state updated in place; what it does not take falls back; the platform offers it."""
from __future__ import annotations

import pytest
import torch

from tokenmill.core.layers.gated_deltanet import gated_delta_rule_reference
from tokenmill.platforms import cpu_recurrent
from tokenmill.platforms.cpu_recurrent import NativeGatedDeltaRule

pytestmark = pytest.mark.skipif(cpu_recurrent.available() is not None,
                                reason=f"native delta rule unavailable: {cpu_recurrent.available()}")


def inputs(batch: int, tokens: int, hk: int, hv: int, dk: int, dv: int, dtype=torch.float32, seed: int = 0):
    """(q, k, v, g, beta) as GatedDeltaNet hands them over: q, k, v strided views of one [B, n, conv]
    projection, g float32 (log decay), beta = sigmoid in the activation dtype."""
    gen = torch.Generator().manual_seed(seed)
    mixed = torch.randn(batch, tokens, 2 * hk * dk + hv * dv, generator=gen).to(dtype)
    q, k, v = mixed.split([hk * dk, hk * dk, hv * dv], dim=-1)
    a = torch.randn(batch, tokens, hv, generator=gen)
    g = -torch.rand(hv, generator=gen).exp() * torch.nn.functional.softplus(a)
    beta = torch.randn(batch, tokens, 2 * hv, generator=gen).to(dtype)[..., hv:].sigmoid()
    return (q.reshape(batch, tokens, hk, dk), k.reshape(batch, tokens, hk, dk), v.reshape(batch, tokens, hv, dv),
            g, beta)


def close(actual: torch.Tensor, expected: torch.Tensor, rel: float = 1e-5) -> None:
    """Within `rel` of the expected tensor's scale (relative, robust to entries near zero)."""
    scale = expected.abs().max().item()
    assert (actual.float() - expected.float()).abs().max().item() <= rel * scale, (actual - expected).abs().max()


@pytest.mark.parametrize("hk,hv,dk,dv", [(2, 4, 32, 48), (4, 16, 128, 128), (3, 3, 16, 80)])
def test_decode_step_matches_the_reference_on_scattered_slots(hk, hv, dk, dv):
    """One token for each of 5 sequences whose states are slots 6, 0, 3, 7, 2 of a cache: the layer
    gathers them, the kernel updates the gathered copy in place, the layer writes it back by slot."""
    slots = torch.tensor([6, 0, 3, 7, 2])
    cache = torch.randn(8, hv, dk, dv, generator=torch.Generator().manual_seed(1)) * 0.5
    q, k, v, g, beta = inputs(len(slots), 1, hk, hv, dk, dv)
    want_out, want_state = gated_delta_rule_reference(q, k, v, g, beta, cache[slots], chunked=False)

    gathered = cache[slots]
    out, state = NativeGatedDeltaRule()(q, k, v, g, beta, gathered, chunked=False)
    assert state is gathered and out.shape == want_out.shape and out.dtype == torch.float32
    close(out, want_out)
    close(state, want_state)
    before = cache.clone()
    cache.index_copy_(0, slots, state)
    close(cache[slots], want_state)
    untouched = [s for s in range(8) if s not in slots.tolist()]
    assert torch.equal(cache[untouched], before[untouched])


def test_several_tokens_carry_the_state():
    q, k, v, g, beta = inputs(3, 4, 2, 4, 32, 64, seed=2)
    initial = torch.randn(3, 4, 32, 64) * 0.3
    want_out, want_state = gated_delta_rule_reference(q, k, v, g, beta, initial, chunked=False)
    out, state = NativeGatedDeltaRule()(q, k, v, g, beta, initial.clone(), chunked=False)
    close(out, want_out)
    close(state, want_state)


def test_bf16_activations():
    """bf16 q, k, v, beta (g and the state float32): the same float32 math, the output rounded to bf16."""
    q, k, v, g, beta = inputs(4, 1, 2, 4, 64, 64, dtype=torch.bfloat16, seed=3)
    initial = torch.randn(4, 4, 64, 64) * 0.3
    want_out, want_state = gated_delta_rule_reference(q, k, v, g, beta, initial, chunked=False)
    out, state = NativeGatedDeltaRule()(q, k, v, g, beta, initial.clone(), chunked=False)
    assert out.dtype == torch.bfloat16
    close(state, want_state)
    close(out, want_out, rel=1 / 128)        # one bf16 rounding apart at most


def test_what_it_does_not_take_falls_back():
    kernel = NativeGatedDeltaRule()
    q, k, v, g, beta = inputs(2, 1, 2, 4, 16, 32)
    state = torch.zeros(2, 4, 16, 32)
    assert kernel(q, k, v, g, beta, state, chunked=True) is NotImplemented              # prefill: torch chunked form
    assert kernel(q.half(), k.half(), v.half(), g, beta.half(), state, False) is NotImplemented
    assert kernel(q, k, v, g, beta, state.transpose(2, 3).contiguous().transpose(2, 3), False) is NotImplemented
    assert kernel(q, k, v, g, beta, state.double(), False) is NotImplemented
    q2, k2, v2, g2, b2 = inputs(2, 1, 2, 4, 16, 24)                                       # v_dim not 16-aligned
    assert kernel(q2, k2, v2, g2, b2, torch.zeros(2, 4, 16, 24), False) is NotImplemented
    assert kernel(q[..., ::2], k[..., ::2], v, g, beta, torch.zeros(2, 4, 8, 32), False) is NotImplemented
    assert torch.equal(state, torch.zeros_like(state))


def test_the_cpu_platform_offers_it():
    from tokenmill.core.config import EngineConfig
    from tokenmill.platforms.cpu import CpuPlatform
    kernels = CpuPlatform().layer_kernels(EngineConfig.from_kwargs(dtype="float32"))
    assert isinstance(kernels.gated_delta_rule, NativeGatedDeltaRule)


def test_without_avx512f_the_library_is_refused_with_a_reason(tmp_path, monkeypatch):
    from tokenmill.platforms.native_build import DISABLE_ENV, NativeLibrary, source
    monkeypatch.setenv("TOKENMILL_KERNEL_CACHE", str(tmp_path))
    monkeypatch.setenv(DISABLE_ENV, "1")
    library = NativeLibrary(source("cpu_recurrent.cpp"), cpu_recurrent.ABI_VERSION, cpu_recurrent._declare,
                            extra_flags=("-mno-avx512f",))
    assert library.load() == (None, "the build target (-march=native -mno-avx512f) has no AVX512F")
    assert not list(tmp_path.glob("*.so"))
