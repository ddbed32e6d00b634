"""The mixture-of-experts op's kernels against the torch reference (core/layers/moe.py
moe_reference) over random routings: every expert hit, some experts with no tokens, one token,
top-k = the number of experts, a prefill-sized batch; the cpu platform's native op
(platforms/cpu_moe.py) on bf16, int8 and int4 experts (quantization/cpu_int4.py Int4Experts, int8.py Int8Experts)."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from tokenmill.core.layers.moe import moe_reference, select_experts
from tokenmill.quantization.cpu_int4 import Int4Experts
from tokenmill.quantization.int8 import Int8Experts

NUM_EXPERTS, HIDDEN, INTER = 8, 64, 32
CASES = ["all_experts", "some_experts_idle", "one_token", "top_k_all", "prefill"]


def routing(case: str, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(hidden [T, H], weights [T, k], ids [T, k]) for one of CASES."""
    g = torch.Generator().manual_seed(seed)
    tokens, top_k = {"one_token": (1, 2), "top_k_all": (9, NUM_EXPERTS), "prefill": (150, 2)}.get(case, (40, 2))
    hidden = torch.randn(tokens, HIDDEN, generator=g)
    logits = torch.randn(tokens, NUM_EXPERTS, generator=g)
    if case == "some_experts_idle":
        logits[:, [1, 4, 6]] = -1e4
    weights, ids = select_experts(logits, top_k, renormalize=True)
    if case in ("all_experts", "prefill", "top_k_all"):
        assert set(ids.flatten().tolist()) == set(range(NUM_EXPERTS))
    if case == "some_experts_idle":
        assert not {1, 4, 6} & set(ids.flatten().tolist())
    return hidden, weights, ids


def experts(seed: int = 1) -> nn.Module:
    """A stand-in for FusedMoE's parameters (what the experts methods and kernels read)."""
    g = torch.Generator().manual_seed(seed)
    layer = nn.Module()
    layer.w13 = nn.Parameter(torch.randn(NUM_EXPERTS, 2 * INTER, HIDDEN, generator=g) * 0.2, requires_grad=False)
    layer.w2 = nn.Parameter(torch.randn(NUM_EXPERTS, HIDDEN, INTER, generator=g) * 0.2, requires_grad=False)
    return layer


def assert_rows_close(got: torch.Tensor, want: torch.Tensor, tol: float) -> None:
    """Every token's output within `tol` of the reference's, relative to that token's norm."""
    err = (got.float() - want.float()).norm(dim=-1) / want.float().norm(dim=-1).clamp(min=1e-6)
    assert err.max() < tol, f"worst token {int(err.argmax())}: relative error {float(err.max()):.4f}"


def native_moe():
    from tokenmill.platforms.cpu_moe import NativeMoe
    why = NativeMoe.available("q4")
    if why is not None:
        pytest.skip(f"native moe op unavailable: {why}")
    return NativeMoe()


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("fmt", ["bf16", "int8", "int4"])
def test_native_op_matches_the_reference(case, fmt):
    kernel = native_moe()
    layer = experts()
    hidden, weights, ids = routing(case)
    forms = None
    if fmt == "bf16":
        if kernel.available("bf16") is not None:
            pytest.skip(kernel.available("bf16"))
        w13, w2 = layer.w13.to(torch.bfloat16), layer.w2.to(torch.bfloat16)
        hidden = hidden.to(torch.bfloat16)
        tol = 1.5e-2        # the reference rounds each op to bf16; the kernel sums in float32
    else:
        method = Int8Experts() if fmt == "int8" else Int4Experts()
        method.process_weights_after_loading(layer)
        assert layer.w13.untyped_storage().nbytes() <= 4             # no float copy kept
        forms, (w13, w2) = method.forms(layer), method.weights(layer)     # the dequantized grid
        tol = 4e-2          # activations quantized to int8 per 32 inputs before each matmul
    prepared = kernel.prepare(w13, w2, forms)
    assert prepared is not None and prepared.weight_format == {"bf16": "bf16", "int8": "s8", "int4": "q4"}[fmt]
    for activation in ("silu", "gelu_tanh") if case == "all_experts" else ("silu",):
        got = kernel(hidden, w13, w2, weights, ids, activation, prepared=prepared)
        want = moe_reference(hidden.float(), w13.float(), w2.float(), weights, ids, activation)
        assert got.dtype == hidden.dtype and got.shape == hidden.shape
        assert_rows_close(got, want, tol)


@pytest.mark.parametrize("fmt", ["int4", "int8", "fp8"])
def test_quantized_experts_dequantize_the_experts_asked_for(fmt):
    """The torch op's weights (ExpertsMethod.weights): a subset of experts is exactly those experts of
    the whole stack, which is the quantization grid (close to the loaded weights)."""
    from tokenmill.quantization.fp8 import Fp8Experts
    layer = experts()
    original = layer.w13.clone()
    method = {"int4": Int4Experts, "int8": Int8Experts, "fp8": Fp8Experts}[fmt]()
    method.process_weights_after_loading(layer)
    assert not method.resident and layer.w13.untyped_storage().nbytes() <= 4
    w13, w2 = method.weights(layer)
    assert w13.shape == original.shape and w2.shape == (NUM_EXPERTS, HIDDEN, INTER)
    assert ((w13 - original).norm() / original.norm()) < (0.1 if fmt == "int4" else 0.05)
    chosen = torch.tensor([1, 5, 6])
    sub13, sub2 = method.weights(layer, chosen)
    assert torch.equal(sub13, w13[chosen]) and torch.equal(sub2, w2[chosen])


def test_native_op_result_does_not_depend_on_the_batch():
    """A token's output is the same alone, in a batch, or in any slice of one."""
    kernel = native_moe()
    layer = experts()
    Int4Experts().process_weights_after_loading(layer)
    prepared = kernel.prepare(layer.w13, layer.w2, Int4Experts().forms(layer))
    assert prepared is not None
    hidden, weights, ids = routing("prefill")
    whole = kernel(hidden, layer.w13, layer.w2, weights, ids, prepared=prepared)
    alone = torch.cat([kernel(hidden[i:i + 1], layer.w13, layer.w2, weights[i:i + 1], ids[i:i + 1],
                              prepared=prepared) for i in range(0, 150, 7)])
    assert torch.equal(whole[0:150:7], alone)


def test_native_op_declines_what_it_does_not_do():
    kernel = native_moe()
    layer = experts()
    hidden, weights, ids = routing("all_experts")
    # float32 weights (exact parity promised: the reference runs) unless told to round them to bf16
    assert kernel.prepare(layer.w13, layer.w2, None) is None
    prepared = kernel.prepare(layer.w13.to(torch.bfloat16), layer.w2.to(torch.bfloat16), None)
    w13, w2 = layer.w13.to(torch.bfloat16), layer.w2.to(torch.bfloat16)
    assert kernel(hidden, w13, w2, weights, ids, "silu", prepared=None) is NotImplemented
    assert kernel(hidden, w13, w2, weights, ids, "silu", prepared=prepared, unknown=1) is NotImplemented
    bias = torch.zeros(NUM_EXPERTS, INTER)                     # not [E, 2 * I]
    assert kernel(hidden, w13, w2, weights, ids, "silu", prepared=prepared, w13_bias=bias) is NotImplemented
    with pytest.raises(ValueError, match="topk_ids"):
        kernel(hidden, w13, w2, weights, torch.full_like(ids, NUM_EXPERTS), "silu", prepared=prepared)
    odd = experts()
    odd.w13 = nn.Parameter(torch.randn(NUM_EXPERTS, 2 * 24, HIDDEN), requires_grad=False)   # 24: not 32-aligned
    odd.w2 = nn.Parameter(torch.randn(NUM_EXPERTS, HIDDEN, 24), requires_grad=False)
    method = Int4Experts()
    method.process_weights_after_loading(odd)
    assert method.forms(odd) is None                   # kept dense: the torch op runs it


@pytest.mark.parametrize("fmt", ["bf16", "int4"])
def test_native_op_takes_expert_biases_and_swiglu_oai(fmt):
    """GPT-OSS's experts: biases on gate/up and down (the down bias alone absent at tensor-parallel
    ranks > 0) and the clamped SwiGLU, with a limit the values reach."""
    kernel = native_moe()
    if fmt == "bf16" and kernel.available("bf16") is not None:
        pytest.skip(kernel.available("bf16"))
    layer = experts()
    hidden, weights, ids = routing("some_experts_idle")
    g = torch.Generator().manual_seed(3)
    b13, b2 = torch.randn(NUM_EXPERTS, 2 * INTER, generator=g), torch.randn(NUM_EXPERTS, HIDDEN, generator=g)
    if fmt == "bf16":
        w13, w2, forms = layer.w13.to(torch.bfloat16), layer.w2.to(torch.bfloat16), None
    else:
        method = Int4Experts()
        method.process_weights_after_loading(layer)
        (w13, w2), forms = method.weights(layer), method.forms(layer)
    prepared = kernel.prepare(w13, w2, forms)
    for biases in (dict(w13_bias=b13, w2_bias=b2), dict(w13_bias=b13, w2_bias=None)):
        got = kernel(hidden, w13, w2, weights, ids, "swiglu_oai", prepared=prepared, swiglu_alpha=1.702,
                     swiglu_limit=0.5, **biases)
        want = moe_reference(hidden, w13.float(), w2.float(), weights, ids, "swiglu_oai", swiglu_alpha=1.702,
                             swiglu_limit=0.5, **biases)
        assert_rows_close(got, want, 1.5e-2 if fmt == "bf16" else 4e-2)


def test_rounding_mode_rounds_the_parameters_it_packs():
    """bf16 weights with float32 activations: the float32 parameters are rounded to bf16 in place,
    so the kernel and the reference multiply the same weights."""
    from tokenmill.platforms.cpu_moe import NativeMoe
    if NativeMoe.available("bf16") is not None:
        pytest.skip(NativeMoe.available("bf16"))
    layer = experts()
    prepared = NativeMoe(round_weights=True).prepare(layer.w13, layer.w2, None)
    assert prepared is not None and torch.equal(layer.w13, layer.w13.to(torch.bfloat16).float())
    hidden, weights, ids = routing("all_experts")
    got = NativeMoe()(hidden, layer.w13, layer.w2, weights, ids, prepared=prepared)
    assert_rows_close(got, moe_reference(hidden, layer.w13, layer.w2, weights, ids), 1.5e-2)


# ---- the Triton op (platforms/triton_moe.py), under TRITON_INTERPRET=1 (tests/conftest.py) ------

def triton_moe():
    pytest.importorskip("triton")
    from tokenmill.platforms import triton_moe as module
    if not module._interpreting():
        pytest.skip("TRITON_INTERPRET is not set: the Triton op runs on CPU tensors only under the interpreter")
    return module.fused_moe


@pytest.mark.parametrize("case", CASES)
def test_triton_op_matches_the_reference(case):
    fused_moe = triton_moe()
    layer = experts()
    hidden, weights, ids = routing(case)
    if case == "prefill":
        hidden, weights, ids = hidden[:40], weights[:40], ids[:40]     # the interpreter is slow
    for activation in ("silu", "gelu", "gelu_tanh", "relu") if case == "all_experts" else ("silu",):
        got = fused_moe(hidden, layer.w13, layer.w2, weights, ids, activation)
        torch.testing.assert_close(got, moe_reference(hidden, layer.w13, layer.w2, weights, ids, activation),
                                   rtol=1e-4, atol=1e-5)


def test_triton_op_takes_expert_biases_swiglu_oai_and_bf16():
    fused_moe = triton_moe()
    layer = experts()
    hidden, weights, ids = routing("some_experts_idle")
    g = torch.Generator().manual_seed(3)
    b13, b2 = torch.randn(NUM_EXPERTS, 2 * INTER, generator=g), torch.randn(NUM_EXPERTS, HIDDEN, generator=g)
    extra = dict(swiglu_alpha=1.702, swiglu_limit=0.5)            # a limit the values reach: clamping runs
    for args in (dict(w13_bias=b13, w2_bias=b2), dict(w13_bias=b13, w2_bias=None)):   # tp rank > 0: no down bias
        got = fused_moe(hidden, layer.w13, layer.w2, weights, ids, "swiglu_oai", **args, **extra)
        want = moe_reference(hidden, layer.w13, layer.w2, weights, ids, "swiglu_oai", **args, **extra)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    w13, w2 = layer.w13.to(torch.bfloat16), layer.w2.to(torch.bfloat16)
    got = fused_moe(hidden.to(torch.bfloat16), w13, w2, weights, ids)
    assert got.dtype == torch.bfloat16
    assert_rows_close(got, moe_reference(hidden.to(torch.bfloat16).float(), w13.float(), w2.float(), weights, ids),
                      1e-2)
    assert fused_moe(hidden, layer.w13, layer.w2, weights, ids, "silu", unknown=1) is NotImplemented


def test_gpu_platforms_offer_the_triton_op():
    pytest.importorskip("triton")
    from tokenmill.platforms.cuda import CudaPlatform
    from tokenmill.platforms.triton_moe import fused_moe
    assert CudaPlatform().layer_kernels(None).moe is fused_moe
