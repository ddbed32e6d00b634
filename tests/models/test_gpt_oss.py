"""GPT-OSS (core/models/gpt_oss.py) on random-weight checkpoints transformers writes: greedy tokens
identical to transformers' float32 `generate` with prompts longer than the sliding window (chunked
prefills, decodes, the prefix cache), yarn rope, attention sinks, biased router and experts with the
clamped SwiGLU; the expert layer alone against transformers' GptOssMLP; an MXFP4 checkpoint (experts
as fp4 blocks + e8m0 scales, packed here) loading into the weights transformers dequantizes them to;
through the server with the openai SDK."""
from __future__ import annotations

import json

import pytest
import torch

from model_helpers import (assert_greedy_twice, assert_server_greedy, generate, hf_greedy, make_llm, tiny_tokenizer)

from tokenmill.core.layers.moe import FusedMoE, moe_reference
from tokenmill.quantization.mxfp4 import FP4_VALUES, dequantize_mxfp4

VOCAB = 1000
WINDOW = 16
CONFIG = dict(vocab_size=VOCAB, bos_token_id=1, eos_token_id=2, pad_token_id=0, hidden_size=64, intermediate_size=32,
              num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
              max_position_embeddings=256, num_local_experts=8, num_experts_per_tok=2, sliding_window=WINDOW,
              # yarn as gpt-oss ships it, scaled down (factor 4 of 64 original positions)
              rope_parameters={"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0,
                               "truncate": False, "original_max_position_embeddings": 64, "rope_theta": 150000.0})
# Mixed lengths over 16-token blocks and 32-token prefill chunks, most longer than the window.
PROMPTS = [[3 + (i * 37 + j * 11) % (VOCAB - 3) for j in range(n)] for i, n in enumerate((45, 11, 23, 33))]


def hf_model(seed: int = 0, **overrides):
    """A random float32 transformers GPT-OSS: routers scaled up so experts win by clear margins, sinks
    large enough to move the attention weights."""
    import transformers
    torch.manual_seed(seed)
    config = transformers.AutoConfig.for_model("gpt_oss", **{**CONFIG, **overrides})
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.add_(torch.randn_like(param) * 0.05)
            if name.endswith("mlp.router.weight"):
                param.mul_(20.0)
            if name.endswith("self_attn.sinks"):
                param.copy_(torch.randn_like(param) * 2.0)
    return model


def save(model, directory) -> None:
    model.save_pretrained(str(directory))
    tiny_tokenizer(VOCAB).save_pretrained(str(directory))


def test_expert_layer_matches_transformers():
    """GptOssMoE loading transformers' fused, transposed, gate/up-interleaved experts and biased
    router: the output of transformers' GptOssMLP (routing, clamped SwiGLU, biases)."""
    from tokenmill.core.models.gpt_oss import GptOssForCausalLM, expert_target
    hf = hf_model()
    config, mlp = hf.config, hf.model.layers[0].mlp
    ours = GptOssForCausalLM.make_moe(config, 0, torch.float32, None)
    for name, tensor in mlp.state_dict().items():
        full = f"model.layers.0.mlp.{name}"
        target = expert_target(full)
        if target is None:
            param = ours.get_parameter(name.replace("router.", "gate."))
            param.data.copy_(tensor)
        else:
            param = ours.get_parameter(target[0].rpartition("mlp.")[2])
            param.weight_loader(param, tensor, target[1])
    x = torch.randn(37, config.hidden_size)
    x[:5] *= 40.0                       # large activations: the clamps bite
    with torch.no_grad():
        want, _ = mlp(x[None])
        torch.testing.assert_close(ours(x), want[0], atol=1e-5, rtol=1e-5)
    weights, ids = ours.route(x)
    plain = moe_reference(x, ours.w13, ours.w2, weights, ids, "swiglu_oai", w13_bias=ours.w13_bias,
                          w2_bias=ours.w2_bias, swiglu_alpha=config.swiglu_alpha, swiglu_limit=config.swiglu_limit)
    assert torch.equal(ours(x), plain)


def test_greedy_matches_transformers(tmp_path):
    """Prompts longer than the 16-token window, in 32-token chunks batched with decodes, then again
    from the prefix cache: transformers' float32 tokens; sliding layers in their own KV group."""
    hf = hf_model()
    save(hf, tmp_path)
    expected = hf_greedy(hf, PROMPTS)
    llm = make_llm(tmp_path)
    bundle = llm.engine.bundle
    assert type(bundle.model).__name__ == "GptOssForCausalLM"
    assert bundle.attention_backend.name == "cpu_sdpa"        # the CPU's own backend, sinks included
    layers = bundle.model.model.layers
    assert [layer.self_attn.attn.sliding_window for layer in layers] == [WINDOW, None, WINDOW, None]
    assert all(isinstance(layer.mlp, FusedMoE) and layer.structure.attention_sinks for layer in layers)
    assert_greedy_twice(llm, PROMPTS, expected)


@pytest.mark.parametrize("parallel", [{"tensor_parallel_size": 2}, {"pipeline_parallel_size": 2},
                                      {"tensor_parallel_size": 2, "enable_expert_parallel": True}])
def test_two_ranks_match_transformers(tmp_path, parallel):
    """Tensor parallel: each rank holds its heads' sinks and half of every expert (and of its gate/up
    bias), the down bias added once; pipeline parallel: each stage its layers' sinks; expert parallel:
    each rank half of the experts whole, with their biases (each down bias added by its expert's rank).
    transformers' tokens."""
    hf = hf_model()
    save(hf, tmp_path)
    expected = hf_greedy(hf, PROMPTS[:2])
    llm = make_llm(tmp_path, **parallel)
    try:
        assert [list(o.outputs[0].token_ids) for o in generate(llm, PROMPTS[:2])] == expected
    finally:
        llm.engine.executor.shutdown()


def test_sinks_change_the_tokens(tmp_path):
    """The same checkpoint with every sink at -inf (no sink at all) gives other tokens: the sinks
    the greedy test matches are doing something."""
    from safetensors.torch import load_file, save_file
    hf = hf_model()
    save(hf, tmp_path)
    expected = hf_greedy(hf, PROMPTS[:2])
    tensors = load_file(str(tmp_path / "model.safetensors"))
    for name in [n for n in tensors if n.endswith("self_attn.sinks")]:
        tensors[name] = torch.full_like(tensors[name], -torch.inf)
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    got = [list(o.outputs[0].token_ids) for o in generate(make_llm(tmp_path), PROMPTS[:2])]
    assert got != expected


def pack_mxfp4(codes: torch.Tensor, exponents: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp4 codes [..., N, K] (0..15) and e8m0 exponents [..., N, K / 32] -> (blocks [..., N, K / 32, 16]
    uint8, the even element in the low nibble; scales uint8), the layout OpenAI's checkpoints use."""
    grouped = codes.to(torch.uint8).reshape(*codes.shape[:-1], codes.shape[-1] // 32, 16, 2)
    return grouped[..., 0] | (grouped[..., 1] << 4), exponents.to(torch.uint8)


def test_dequantize_matches_transformers_layout():
    """Our dequantization of packed blocks equals transformers' own (which also transposes to its
    [E, K, N] parameter layout); each element is its fp4 value times 2^(scale - 127)."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors
    g = torch.Generator().manual_seed(0)
    codes = torch.randint(0, 16, (3, 8, 64), generator=g)
    exponents = torch.randint(118, 130, (3, 8, 2), generator=g)
    blocks, scales = pack_mxfp4(codes, exponents)
    ours = dequantize_mxfp4(blocks, scales)
    want = torch.tensor(FP4_VALUES)[codes] * torch.pow(2.0, exponents.double() - 127).repeat_interleave(32, -1).float()
    assert torch.equal(ours, want)
    assert torch.equal(ours.transpose(1, 2), convert_moe_packed_tensors(blocks, scales, dtype=torch.float32))
    with pytest.raises(ValueError, match="do not fit"):
        dequantize_mxfp4(blocks[..., :8], scales)


@pytest.mark.parametrize("tp", [1, 2])
def test_mxfp4_checkpoint_loads_and_matches_transformers(tmp_path, tp):
    """A checkpoint whose experts are MXFP4 (gate_up_proj_blocks / _scales, down_proj_blocks /
    _scales; quantization_config quant_method mxfp4) loads, dequantized (at tensor_parallel_size=2
    each rank keeps its half of every expert): the tokens transformers gives with those dequantized
    weights in float32."""
    from safetensors.torch import load_file, save_file
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors
    hf = hf_model(seed=2)
    g = torch.Generator().manual_seed(3)
    packed = {}
    with torch.no_grad():
        for i, layer in enumerate(hf.model.layers):
            for name in ("gate_up_proj", "down_proj"):
                param = getattr(layer.mlp.experts, name)                      # [E, K, N]
                e, k, n = param.shape
                codes = torch.randint(0, 16, (e, n, k), generator=g)
                blocks, scales = pack_mxfp4(codes, torch.randint(120, 124, (e, n, k // 32), generator=g))
                param.copy_(convert_moe_packed_tensors(blocks, scales, dtype=torch.float32))
                packed[f"model.layers.{i}.mlp.experts.{name}_blocks"] = blocks
                packed[f"model.layers.{i}.mlp.experts.{name}_scales"] = scales
    save(hf, tmp_path)
    expected = hf_greedy(hf, PROMPTS)
    tensors = {name: t for name, t in load_file(str(tmp_path / "model.safetensors")).items()
               if not name.endswith(("experts.gate_up_proj", "experts.down_proj"))}
    save_file({**tensors, **packed}, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((tmp_path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    (tmp_path / "config.json").write_text(json.dumps(config))
    llm = make_llm(tmp_path, tensor_parallel_size=tp)
    try:
        assert llm.engine.bundle.quantization is None          # dequantized at load: an unquantized run
        assert [list(o.outputs[0].token_ids) for o in generate(llm, PROMPTS)] == expected
    finally:
        llm.engine.executor.shutdown()


def test_mxfp4_checkpoint_missing_scales_is_refused(tmp_path):
    from safetensors.torch import load_file, save_file
    hf = hf_model()
    save(hf, tmp_path)
    tensors = load_file(str(tmp_path / "model.safetensors"))
    param = tensors.pop("model.layers.0.mlp.experts.down_proj")
    e, k, n = param.shape
    tensors["model.layers.0.mlp.experts.down_proj_blocks"] = torch.zeros(e, n, k // 32, 16, dtype=torch.uint8)
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "quantization_config": {"quant_method": "mxfp4"}}))
    with pytest.raises(ValueError, match=r"lacks weights for: .*layers\.0\.mlp\.w2\[scales\]"):
        make_llm(tmp_path)


def test_server_answers_as_transformers(tmp_path):
    """`tokenmill serve DIR` through the openai SDK: transformers' greedy tokens."""
    hf = hf_model()
    save(hf, tmp_path)
    prompts = PROMPTS[:2]
    expected = hf_greedy(hf, prompts)
    assert_server_greedy(tmp_path, prompts, expected)


def test_bf16_runs_as_the_eager_model(tmp_path):
    """bf16 on the cpu platform's decode path: the native step does not express attention sinks or
    expert FFNs, so every layer runs eagerly there: the tokens of the eager model (enforce_eager)."""
    save(hf_model(), tmp_path)
    fast = make_llm(tmp_path, dtype="bfloat16", max_num_batched_tokens=64)
    got = [list(o.outputs[0].token_ids) for o in generate(fast, PROMPTS, max_tokens=12)]
    eager = make_llm(tmp_path, dtype="bfloat16", max_num_batched_tokens=64, enforce_eager=True)
    assert got == [list(o.outputs[0].token_ids) for o in generate(eager, PROMPTS, max_tokens=12)]


@pytest.mark.parametrize("quantization", ["int4", "int8"])
def test_quantized_experts_stay_close_to_float32(tmp_path, quantization):
    """quantization int4 / int8 on GPT-OSS: its linear layers and experts quantized (the experts' biases,
    sinks and router kept), prompt log-probs close to float32's (transformers' own init, as the other MoE
    families' quantized test: the random-noise weights above quantize far worse than trained ones)."""
    import transformers
    from tokenmill.core.sampling_params import SamplingParams
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model("gpt_oss", **CONFIG),
                                                          dtype=torch.float32).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(("norm.weight", "bias")):
                param.add_(torch.randn_like(param) * (0.1 if name.endswith("norm.weight") else 0.02))
            if name.endswith("router.weight"):
                param.mul_(20.0)
            if name.endswith("sinks"):
                param.copy_(torch.randn_like(param) * 2.0)
    save(model, tmp_path)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, prompt_logprobs=0)

    def first_logprobs(llm) -> list[list[float]]:
        outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS[:2]], params, use_tqdm=False)
        return [[float(getattr(v, "logprob", v)) for d in o.prompt_logprobs if d for v in list(d.values())[:1]]
                for o in outputs]

    exact = first_logprobs(make_llm(tmp_path))
    llm = make_llm(tmp_path, quantization=quantization)
    experts = [m for m in llm.engine.bundle.model.modules() if isinstance(m, FusedMoE)]
    assert experts and all(m.quant_method.name == quantization for m in experts)
    from tokenmill.platforms.cpu_moe import NativeMoe
    if NativeMoe.available() is None:     # the native MoE op runs them, biases and clamped SwiGLU included
        assert all(m._kernel is not None and m._prepared is not None for m in experts)
    quant = first_logprobs(llm)
    worst = max(abs(x - y) for a, b in zip(exact, quant) for x, y in zip(a, b))
    assert worst < {"int4": 0.15, "int8": 0.05}[quantization]      # about half of each bound here


def test_features_and_registry():
    from tokenmill.core.models.features import model_features
    from tokenmill.plugins import discovery
    cls = discovery.model_architectures()["GptOssForCausalLM"]
    features = model_features(cls)
    assert features["sliding_window"]["supported"] is True
    assert features["fast_path"]["supported"] is False and "eagerly" in features["fast_path"]["detail"]
    assert features["quantization"]["supported"] is True and "MXFP4" in features["quantization"]["detail"]
