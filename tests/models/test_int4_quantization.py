"""quantization="int4" on the CPU platform: 4-bit weight groups of 32 (the GGUF Q4_0/Q4_1 layout)."""
from __future__ import annotations

import pytest
import torch

from tokenmill import LLM, SamplingParams
from tokenmill.core.layers.linear import Linear
from tokenmill.quantization.cpu_int4 import CpuInt4Quantization

pytestmark = pytest.mark.skipif(CpuInt4Quantization.available() is not None,
                                reason=str(CpuInt4Quantization.available()))


def _int4_linear(weight: torch.Tensor, method: CpuInt4Quantization) -> Linear:
    """A Linear under the int4 method, loaded with `weight` and post-processed, as load_model does."""
    layer = Linear(weight.shape[1], weight.shape[0], quant_method=method)
    layer.weight.weight_loader(layer.weight, weight)
    method.process_weights_after_loading(layer)
    return layer


def _q4_1_like(n: int, k: int, seed: int = 0, return_q: bool = False):
    """A weight as llama.cpp's Q4_1 stores it: per group of 32, d * q + m with q in 0..15,
    every group using both q=0 and q=15 (its min and max)."""
    g = torch.Generator().manual_seed(seed)
    groups = k // 32
    d = (torch.rand(n, groups, 1, generator=g) * 0.02 + 0.001).half().float()
    m = (torch.randn(n, groups, 1, generator=g) * 0.05).half().float()
    q = torch.randint(0, 16, (n, groups, 32), generator=g)
    q[..., 0], q[..., 1] = 0, 15
    w = (d * q + m).reshape(n, k)
    return (w, q.reshape(n, k)) if return_q else w


def test_quantize_recovers_a_q4_1_grid_up_to_bf16_scales():
    w, stored_q = _q4_1_like(64, 128, return_q=True)
    groups = w.reshape(64, 4, 32)
    for bf16_params, rel in ((False, 2 ** -20), (True, 2 ** -7)):
        q, scale, low = CpuInt4Quantization.quantize(w, bf16_params=bf16_params)
        assert torch.equal(q, stored_q.to(q.dtype))      # the very nibbles the file stored
        back = CpuInt4Quantization.dequantize(q, scale, low)
        # float32 parameters: the file's values to rounding; bf16 ones (torch's int4 kernel):
        # off by the bf16 rounding of each group's scale and zero point.
        bound = (groups.amax(-1) - groups.amin(-1) + groups.abs().amax(-1)) * rel
        assert ((back - w).abs().reshape(64, 4, 32).amax(-1) <= bound).all()


@pytest.mark.parametrize("native", [True, False])
def test_both_paths_multiply_by_the_same_4bit_weights(native):
    """native: the int8 path's quantize/dequantize ends are the cpu platform's C++ kernels
    (handed over as the platform does); else torch ops."""
    from tokenmill.platforms import cpu_kernels
    from tokenmill.platforms.cpu import CpuPlatform
    if native and cpu_kernels.available() is not None:
        pytest.skip(cpu_kernels.available())
    method = CpuInt4Quantization(small_batch_rows=8)
    method.use_kernels(CpuPlatform().quantization_kernels("int4") if native else {})
    assert bool(method.kernels) == native
    layer = _int4_linear(_q4_1_like(96, 256, seed=1), method)
    assert layer.int4_state is not None                # packed: 96 % 16 == 0, 256 % 32 == 0
    x = torch.randn(40, 256, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        exact = x @ layer.weight.t()                    # the parameter now holds the 4-bit values
        batched = layer(x)                              # 40 rows: int8 x int8 GEMM
        small = torch.cat([layer(x[i:i + 4]) for i in range(0, 40, 4)])   # int4 kernel
        scale = exact.abs().max()
        assert (batched - exact).abs().max() < 0.01 * scale
        assert (small - exact).abs().max() < 0.01 * scale  # bf16 activations
        bias = torch.randn(96)
        torch.testing.assert_close(method.apply(layer, x[:4], bias), small[:4] + bias)
        torch.testing.assert_close(method.apply(layer, x, bias), batched + bias, atol=1e-4, rtol=1e-5)


def test_shapes_the_packed_format_cannot_hold_stay_dense():
    weight = torch.randn(100, 64)                       # 100 rows: not a multiple of 16
    layer = _int4_linear(weight, CpuInt4Quantization())
    assert layer.int4_state is None
    x = torch.randn(2, 64)
    with torch.no_grad():
        torch.testing.assert_close(layer(x), x @ weight.t())


def test_int4_mode_goes_through_the_quantization_seam(tmp_path):
    """load_model on the cpu platform: every Linear under the int4 method, the LM head under
    its int8 head method, kernels handed by the platform."""
    from model_helpers import load_for_test, save_tiny_checkpoint
    from tokenmill.platforms.cpu import CpuPlatform
    from tokenmill.quantization.cpu_int4 import Int8HeadMethod

    save_tiny_checkpoint("llama", str(tmp_path), tie_word_embeddings=True)
    bundle = load_for_test(tmp_path, dtype="auto", platform=CpuPlatform(), quantization="int4")
    model = bundle.model
    assert bundle.quantization == "int4" and bundle.weight_dtype == torch.float32
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    assert linears and all(isinstance(m.quant_method, CpuInt4Quantization) for m in linears)
    assert all(m.int4_state is not None for m in linears)
    assert isinstance(model.lm_head.quant_method, Int8HeadMethod)
    assert model.lm_head.weight is model.model.embed_tokens.weight


def test_engine_runs_int4_and_rejects_unknown_quantization():
    llm = LLM(quantization="int4", max_model_len=512, kv_cache_memory=32 << 20)
    outs = llm.generate(["The capital of France is"] * 2 + ["1, 2, 3, 4,"],
                        SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    assert "Paris" in outs[0].outputs[0].text
    assert outs[0].outputs[0].token_ids == outs[1].outputs[0].token_ids
    assert "5" in outs[2].outputs[0].text
    with pytest.raises(ValueError, match="quantization"):
        LLM(quantization="awq-bogus", max_model_len=512, kv_cache_memory=32 << 20)
    with pytest.raises(ValueError, match="dtype"):
        LLM(quantization="int4", dtype="bfloat16", max_model_len=512, kv_cache_memory=32 << 20)


@pytest.mark.parametrize("kind", ["llama", "mistral", "qwen2", "qwen3"])
def test_int4_runs_every_architecture_close_to_float32(kind, tmp_path):
    """Biases, q/k norms (3-D inputs the fused norm leaves to torch), sliding windows and a tied
    head all go through the quantized path; prompt log-probs stay near float32's."""
    from model_helpers import save_tiny_checkpoint

    save_tiny_checkpoint(kind, str(tmp_path))
    prompts = [{"prompt_token_ids": list(range(10, 10 + n))} for n in (5, 40)]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, prompt_logprobs=0)
    runs = []
    for quantization in (None, "int4"):
        llm = LLM(str(tmp_path), quantization=quantization, kv_cache_memory=16 << 20, generation_config="none")
        runs.append(llm.generate(prompts, params, use_tqdm=False))
    for exact, quant in zip(*runs):
        assert len(quant.outputs[0].token_ids) == 6
        a = [next(iter(d.values())) for d in exact.prompt_logprobs if d]
        b = [next(iter(d.values())) for d in quant.prompt_logprobs if d]
        assert max(abs(x - y) for x, y in zip(a, b)) < 0.05
