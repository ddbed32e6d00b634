"""The cpu platform's fused decode step (platforms/cpu_fused_decode.py): its matmul layouts agree
with a torch emulation of their numerics; a whole decode step agrees with the eager model on every
architecture; the engine falls back to eager, saying why, where the step cannot run."""
from __future__ import annotations

import ctypes
import logging

import pytest
import torch

from model_helpers import fused_and_eager_decode, save_tiny_checkpoint

from tokenmill import LLM, SamplingParams
from tokenmill.platforms import cpu_decode_kernels as native
from tokenmill.platforms import cpu_fused_decode as fused
from tokenmill.quantization.cpu_int4 import CpuInt4Quantization

pytestmark = pytest.mark.skipif(native.NativeHeadKernel.available() is not None,
                                reason=f"fused decode kernels unavailable: {native.NativeHeadKernel.available()}")


def _q8_activation(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel's activation operand: int8 per 32 inputs, scale amax / 127."""
    groups = x.reshape(x.shape[0], -1, 32)
    sa = groups.abs().amax(dim=-1) / 127
    a8 = torch.round(groups / torch.where(sa > 0, sa, torch.ones_like(sa)).unsqueeze(-1))
    return a8, sa


def _run(linear: "native.NativeLinear", x: torch.Tensor) -> torch.Tensor:
    y = torch.empty((x.shape[0], linear.n), dtype=torch.float32)
    native.LIBRARY.require().fused_matmul(ctypes.byref(linear), x.data_ptr(), x.shape[0], y.data_ptr())
    return y


@pytest.mark.parametrize("tokens", [1, 3, 4, 7])
def test_q4_matmul_is_scale_q_plus_low_times_q8_activations(tokens):
    torch.manual_seed(0)
    n, k = 48, 96
    weight = torch.randn(n, k)
    q, scale, low = CpuInt4Quantization.quantize(weight, bf16_params=True)
    packed = native.pack_q4(q.to(torch.uint8), scale, low)
    linear = native.NativeLinear(kind=native.Q4, n=n, k=k, weight=packed[0].data_ptr(), scales=packed[1].data_ptr(),
                           lows=packed[2].data_ptr(), bias=None)
    x = torch.randn(tokens, k)
    a8, sa = _q8_activation(x)
    s16, l16 = scale.half().float(), low.half().float()                  # the kernel keeps them in fp16
    dots = torch.einsum("ngk,tgk->tng", q.reshape(n, -1, 32).float(), a8)
    expected = (dots * s16 * sa.unsqueeze(1) + l16 * (sa * a8.sum(-1)).unsqueeze(1)).sum(-1)
    torch.testing.assert_close(_run(linear, x), expected, rtol=1e-4, atol=1e-4)
    # And it is a close approximation of the 4-bit weights times the exact activations.
    dense = x @ CpuInt4Quantization.dequantize(q, scale, low).t()
    assert (_run(linear, x) - dense).abs().max() < 0.02 * dense.abs().max()


@pytest.mark.parametrize("tokens", [1, 2, 5, 9, 16])
def test_q8_head_matches_int8_groups(tokens):
    torch.manual_seed(1)
    n, k = 64, 64
    weight = torch.randn(n, k)
    kernel = native.NativeHeadKernel("q8")
    prepared = kernel.prepare(weight)
    x = torch.randn(tokens, k)
    groups = weight.reshape(n, -1, 32)
    scale = (groups.abs().amax(-1) / 127).half().float()
    w8 = torch.round(groups / scale.unsqueeze(-1)).clamp(-127, 127)
    a8, sa = _q8_activation(x)
    expected = (torch.einsum("ngk,tgk->tng", w8, a8) * scale * sa.unsqueeze(1)).sum(-1)
    torch.testing.assert_close(kernel(x, prepared, None), expected, rtol=1e-4, atol=1e-4)
    assert (kernel(x, prepared, None) - x @ weight.t()).abs().max() < 0.02 * (x @ weight.t()).abs().max()
    # Shapes outside the blocks, bf16 inputs and more rows than max_rows go back to the layer's
    # own method.
    assert kernel(x, kernel.prepare(torch.randn(40, 64)), None) is NotImplemented
    assert kernel(x.bfloat16(), prepared, None) is NotImplemented
    assert kernel(torch.randn(kernel.max_rows + 1, k), prepared, None) is NotImplemented


@pytest.mark.skipif(not native.LIBRARY.require().fused_decode_caps() & 2, reason="no AVX512-BF16")
@pytest.mark.parametrize("tokens", [1, 4, 6, 8, 13, 64])
def test_bf16_matmul_matches_bf16_operands(tokens):
    torch.manual_seed(2)
    n, k = 32, 64
    weight = torch.randn(n, k)
    packed = native.pack_bf16(weight)
    linear = native.NativeLinear(kind=native.BF16, n=n, k=k, weight=packed.data_ptr())
    x = torch.randn(tokens, k)
    expected = x.bfloat16().float() @ weight.bfloat16().float().t()
    torch.testing.assert_close(_run(linear, x), expected, rtol=1e-5, atol=1e-5)
    head = native.NativeHeadKernel("bf16")
    torch.testing.assert_close(head(x.bfloat16(), head.prepare(weight.bfloat16()), None), expected,
                               rtol=1e-5, atol=1e-5)
    # Batches of 8+ rows take the two-block tiles: every row bit-identical to the row alone.
    together = _run(linear, x)
    assert all(torch.equal(together[i], _run(linear, x[i:i + 1])[0]) for i in range(tokens))


@pytest.mark.parametrize("kind,overrides", [
    ("llama", {}), ("llama", {"vocab_size": 1024, "tie_word_embeddings": True}), ("mistral", {"sliding_window": 8}),
    ("qwen2", {}), ("qwen3", {}),
])
@pytest.mark.parametrize("mode", ["int4", "int8", "bfloat16", "int4+fp8"])
def test_fused_step_agrees_with_the_eager_model(kind, overrides, mode, tmp_path):
    """int8: every linear in S8 (its int8 per-channel weights, activations per 32 inputs where the
    eager path quantizes per token). int4+fp8: an fp8 e4m3 KV cache, written and read by the
    step's native attention entry."""
    if mode == "bfloat16" and not native.LIBRARY.require().fused_decode_caps() & 2:
        pytest.skip("no AVX512-BF16")
    save_tiny_checkpoint(kind, str(tmp_path), **overrides)
    kwargs = (dict(dtype="bfloat16") if mode == "bfloat16"
              else dict(quantization="int4", kv_cache_dtype="fp8") if mode == "int4+fp8"
              else dict(quantization=mode, kv_cache_dtype="bfloat16"))
    llm = LLM(str(tmp_path), kv_cache_memory=16 << 20, generation_config="none", **kwargs)
    prompt = torch.randint(10, 1000, (20,), generator=torch.Generator().manual_seed(3)).tolist()
    if mode == "int8":
        assert llm.engine.runner.forward.fused_step._layers[0].qkv.kind == native.S8
    if mode == "int4+fp8":
        assert llm.engine.runner.layers[0].kv_cache.dtype == torch.float8_e4m3fn
        assert hasattr(llm.engine.runner.forward, "fused_step")
    fused_out, eager_out = fused_and_eager_decode(llm, prompt)
    cosine = torch.nn.functional.cosine_similarity(fused_out, eager_out, dim=-1)
    assert cosine.min() > 0.995, cosine
    # The engine's own decode steps take the fused path and produce tokens.
    out = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),
                       use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 6


@pytest.mark.parametrize("mode", [{"quantization": "int4"}, {"dtype": "bfloat16"}])
@pytest.mark.parametrize("lengths", [(5, 17, 33, 9, 12, 3), (5, 17, 33, 9, 12, 3, 40, 8, 21, 2, 14, 30)])
def test_batched_fused_step_equals_one_at_a_time(tmp_path, mode, lengths):
    """Sequences batched in one fused step get the same hidden states as each alone (12 rows:
    the per-token loops on all threads and, in bf16, the two-block GEMM tiles)."""
    from tokenmill.attention_backends.interface import build_metadata

    if mode.get("dtype") == "bfloat16" and not native.LIBRARY.require().fused_decode_caps() & 2:
        pytest.skip("no AVX512-BF16")
    save_tiny_checkpoint("llama", str(tmp_path))
    llm = LLM(str(tmp_path), kv_cache_memory=16 << 20, generation_config="none", **mode)
    runner = llm.engine.runner
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(10, 1000, (n,), generator=g).tolist() for n in lengths]
    tables, lens, alone = [], [], []
    next_block = 0
    with torch.inference_mode():
        for p in prompts:
            n = len(p) + 1
            table = list(range(next_block, next_block + (n + 15) // 16))
            next_block += len(table)
            runner.forward(torch.tensor(p), torch.arange(n - 1), build_metadata([n - 1], [n - 1], [table], 16))
            decode = build_metadata([1], [n], [table], 16, num_decodes=1)
            alone.append(runner.forward(torch.tensor([p[-1]]), torch.tensor([n - 1]), decode))
            tables.append(table)
            lens.append(n)
        def step(rows: list[int]) -> torch.Tensor:
            batch = build_metadata([1] * len(rows), [lens[i] for i in rows], [tables[i] for i in rows], 16,
                                   num_decodes=len(rows))
            return runner.forward(torch.tensor([prompts[i][-1] for i in rows]),
                                  torch.tensor([lens[i] - 1 for i in rows]), batch)

        together = step(list(range(len(prompts))))
        if mode.get("quantization") == "int4" and len(prompts) >= fused.BATCH_ROWS:
            # Batches of BATCH_ROWS and more run the int8 (S8) weights, one row alone the 4-bit
            # ones: the same rows must come out of any two batches, and close to each alone.
            width, n = fused.BATCH_ROWS, len(prompts)
            first, last = step(list(range(width))), step(list(range(n - width, n)))
            assert torch.equal(together, torch.cat((first, last[2 * width - n:])))
            cosine = torch.nn.functional.cosine_similarity(together, torch.cat(alone), dim=-1)
            assert cosine.min() > 0.99, cosine
            return
    assert torch.equal(together, torch.cat(alone))


@pytest.mark.parametrize("rows", [1, 5, 6, 13, 64])
def test_s8_matmul_is_the_integer_product_per_32_inputs(rows):
    """S8: activations to int8 per 32 inputs, int8 weights per output row; equals that product
    computed in float64, and a row's result does not depend on the rows beside it."""
    if not native.LIBRARY.require().fused_decode_caps() & 1:
        pytest.skip("no AVX512-VNNI")
    g = torch.Generator().manual_seed(7)
    n, k = 96, 160
    q = torch.randint(-127, 128, (n, k), generator=g).to(torch.int8)
    scale = torch.rand(n, generator=g) / 100
    bias = torch.randn(n, generator=g)
    x = torch.randn(rows, k, generator=g) * torch.linspace(0.1, 30, k)     # a few large channels
    weight = native.pack_s8_weight(q, scale)
    y = native.matmul_s8(x, weight, bias)
    groups = x.double().reshape(rows, k // 32, 32)
    sa = groups.abs().amax(dim=-1, keepdim=True) / 127
    a8 = torch.round(groups / sa)
    dots = torch.einsum("rgi,ngi->rng", a8, q.double().reshape(n, k // 32, 32))
    ref = (dots * sa.squeeze(-1)[:, None, :]).sum(-1) * scale.double() + bias.double()
    assert torch.allclose(y.double(), ref, rtol=1e-5, atol=1e-5)
    assert torch.equal(native.matmul_s8(x[-1:], weight, bias), y[-1:])
    assert native.pack_s8_weight(q[:90], scale[:90]) is None          # rows outside blocks of 16


def test_falls_back_to_eager_and_says_why(tmp_path, caplog):
    save_tiny_checkpoint("llama", str(tmp_path))
    with caplog.at_level(logging.INFO, logger="tokenmill.platforms.cpu"):
        llm = LLM(str(tmp_path), quantization="int4", attention_backend="reference", kv_cache_memory=16 << 20,
                  generation_config="none")
    assert not hasattr(llm.engine.runner.forward, "fused_step")
    assert any("attention backend 'reference' has no native decode" in r.getMessage() for r in caplog.records)
    out = llm.generate([{"prompt_token_ids": [5, 6, 7]}], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True),
                       use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4


def test_float32_stays_eager_and_refuses_fused_decode(tmp_path):
    save_tiny_checkpoint("llama", str(tmp_path))
    llm = LLM(str(tmp_path), dtype="float32", kv_cache_memory=16 << 20, generation_config="none")
    assert not hasattr(llm.engine.runner.forward, "fused_step")
    with pytest.raises(ValueError, match="graph_capture 'fused_decode' needs"):
        LLM(str(tmp_path), dtype="float32", graph_capture="fused_decode", kv_cache_memory=16 << 20)


def test_several_tokens_of_one_sequence_are_rows_of_one_fused_step(tmp_path):
    """Verified drafts or a short chunk: a sequence's new tokens in one fused call give exactly
    what the fused step gives them one at a time (each row is computed on its own), and agree
    with the eager model."""
    from tokenmill.attention_backends.interface import build_metadata

    save_tiny_checkpoint("qwen3", str(tmp_path))
    llm = LLM(str(tmp_path), quantization="int4", kv_cache_memory=16 << 20, generation_config="none")
    runner = llm.engine.runner
    tokens = torch.randint(10, 1000, (25,), generator=torch.Generator().manual_seed(5)).tolist()
    table = [0, 1]
    with torch.inference_mode():
        runner.forward(torch.tensor(tokens[:20]), torch.arange(20), build_metadata([20], [20], [table], 16))
        one_by_one = [runner.forward(torch.tensor([tokens[p]]), torch.tensor([p]),
                                     build_metadata([1], [p + 1], [table], 16, num_decodes=1))
                      for p in range(20, 25)]
        chunk_meta = build_metadata([5], [25], [table], 16)
        together = runner.forward(torch.tensor(tokens[20:]), torch.arange(20, 25), chunk_meta)
        eager = runner._forward_eager(torch.tensor(tokens[20:]), torch.arange(20, 25), chunk_meta)
    assert torch.equal(together, torch.cat(one_by_one))
    assert torch.nn.functional.cosine_similarity(together, eager, dim=-1).min() > 0.995


def test_ngram_speculation_is_exact_on_the_fused_path(tmp_path):
    """Drafts verified through the fused step: greedy output identical with and without
    speculation, one stream at a time (W5's case). (In a batch the eager int4 prefill picks its
    outlier channels per batch, so batched int4 runs can differ at near-ties whatever the drafts.)"""
    save_tiny_checkpoint("llama", str(tmp_path))
    g = torch.Generator().manual_seed(6)
    base = torch.randint(10, 1000, (12,), generator=g).tolist()
    prompts = [{"prompt_token_ids": base * 3 + torch.randint(10, 1000, (3,), generator=g).tolist()} for _ in range(4)]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    kwargs = dict(quantization="int4", kv_cache_memory=16 << 20, generation_config="none")
    plain_llm = LLM(str(tmp_path), **kwargs)
    spec_llm = LLM(str(tmp_path), speculative_config={"method": "ngram", "num_speculative_tokens": 3}, **kwargs)
    for prompt in prompts:
        plain = plain_llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
        assert spec_llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids == plain
    stats = spec_llm.engine.stats()
    assert stats.spec_num_draft_tokens > 0
