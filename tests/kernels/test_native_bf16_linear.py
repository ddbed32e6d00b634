"""The eager bf16 linears on AMX tiles (platforms/cpu_decode_kernels.py NativeBf16Linear): what a
user sees is F.linear's result to bf16 rounding, whatever the number of rows, and the layer's
own method for the inputs the kernel leaves."""
from __future__ import annotations

import pytest
import torch

from tokenmill.core.layers.linear import Linear
from tokenmill.platforms.cpu_decode_kernels import NativeBf16Linear, PackedBf16

pytestmark = pytest.mark.skipif(NativeBf16Linear.available() is not None,
                                reason=f"no AMX here: {NativeBf16Linear.available()}")


def _reference(x: torch.Tensor, w: torch.Tensor, b) -> torch.Tensor:
    y = x.double() @ w.double().t()
    return y + b.double() if b is not None else y


@pytest.mark.parametrize("rows", [1, 5, 16, 17, 64, 100, 256])
@pytest.mark.parametrize("bias", [False, True])
def test_matches_float64_to_bf16_rounding(rows, bias):
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(96, 160, generator=g).bfloat16()
    b = torch.randn(96, generator=g).bfloat16() if bias else None
    x = torch.randn(rows, 160, generator=g).bfloat16()
    kernel = NativeBf16Linear()
    prepared = kernel.prepare(w)
    assert isinstance(prepared, PackedBf16)
    y = kernel(x, prepared, b)
    assert y.dtype == torch.bfloat16 and y.shape == (rows, 96)
    ref = _reference(x, w, b)
    # float32 accumulation, then one bf16 rounding (relative 2^-8) of the result
    assert ((y.double() - ref).abs() <= ref.abs() * 2 ** -8 + 1e-3).all()


def test_a_row_does_not_depend_on_its_batch():
    g = torch.Generator().manual_seed(1)
    w = torch.randn(64, 128, generator=g).bfloat16()
    x = torch.randn(200, 128, generator=g).bfloat16()
    kernel = NativeBf16Linear()
    prepared = kernel.prepare(w)
    whole = kernel(x, prepared, None)
    for start, stop in ((0, 1), (37, 54), (199, 200), (16, 48)):
        assert torch.equal(kernel(x[start:stop], prepared, None), whole[start:stop])


def test_inputs_it_leaves_fall_back_to_the_layer_method():
    kernel = NativeBf16Linear(max_rows=8)
    assert kernel.prepare(torch.randn(20, 64).bfloat16()) is None          # 20 rows: not blocks of 16
    assert kernel.prepare(torch.randn(32, 64)) is None                     # float32 weights
    layer = Linear(64, [32], bias=True, dtype=torch.bfloat16)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(32, 64))
        layer.bias.copy_(torch.randn(32))
    expected = torch.nn.functional.linear
    layer.use_kernel(kernel)
    assert isinstance(layer.prepared, PackedBf16)
    x = torch.randn(9, 64).bfloat16()                                      # more rows than max_rows
    assert torch.equal(layer(x), expected(x, layer.weight, layer.bias))
    small = torch.randn(2, 3, 64).bfloat16()                               # a batch of matrices
    ref = _reference(small.reshape(6, 64), layer.weight, layer.bias).reshape(2, 3, 32)
    assert ((layer(small).double() - ref).abs() <= ref.abs() * 2 ** -8 + 1e-3).all()
