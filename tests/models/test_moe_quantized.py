"""Quantization methods on mixture-of-experts layers: quantization="int4" / "int8" quantize the
stacked experts at load (Int4Experts, Int8Experts in quantization/) and the cpu platform's native
MoE op runs them (platforms/cpu_moe.py); "fp8" keeps them float8 for the torch op (Fp8Experts).
Prompt log-probs stay as close to float32's as the int4 dense test asks
(tests/models/test_int4_quantization.py)."""
from __future__ import annotations

import pytest
import torch

from model_helpers import tiny_tokenizer

from tokenmill.core.sampling_params import SamplingParams
from tokenmill.entrypoints.llm import LLM

VOCAB = 1000
CONFIGS = {
    "qwen3_moe": dict(num_experts=8, moe_intermediate_size=32, head_dim=16, norm_topk_prob=True),
    "mixtral": dict(num_local_experts=8),
}
DIMS = dict(hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            max_position_embeddings=256, num_experts_per_tok=2, vocab_size=VOCAB, bos_token_id=1, eos_token_id=2,
            pad_token_id=0)
PROMPTS = [list(range(10, 10 + n)) for n in (5, 40)]


def save_moe(model_type: str, directory, expert_scale: float = 1.0) -> None:
    """transformers' own random init (as the dense int4 test's checkpoints), norms perturbed, the
    routers scaled up so each token's experts win by clear margins, the experts by `expert_scale`."""
    import transformers
    torch.manual_seed(0)
    config = transformers.AutoConfig.for_model(model_type, **DIMS, **CONFIGS[model_type])
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.add_(torch.randn_like(param) * 0.1)
            if name.endswith("gate.weight") and param.shape[0] == 8:
                param.mul_(20.0)
            if ".experts." in name:
                param.mul_(expert_scale)
    model.save_pretrained(str(directory))
    tiny_tokenizer(VOCAB).save_pretrained(str(directory))


def run(path, quantization):
    llm = LLM(str(path), quantization=quantization, kv_cache_memory=16 << 20, generation_config="none")
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, prompt_logprobs=0)
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    return llm, outputs


def first_logprobs(output) -> list[float]:
    return [float(getattr(v, "logprob", v)) for d in output.prompt_logprobs if d for v in list(d.values())[:1]]


@pytest.mark.parametrize("model_type", sorted(CONFIGS))
@pytest.mark.parametrize("quantization", ["int4", "int8", "fp8"])
def test_quantized_experts_stay_close_to_float32(tmp_path, model_type, quantization):
    from tokenmill.platforms.cpu_moe import NativeMoe
    save_moe(model_type, tmp_path)
    _, exact = run(tmp_path, None)
    llm, quant = run(tmp_path, quantization)
    layers = [m for m in llm.engine.bundle.model.modules() if type(m).__name__ == "FusedMoE"]
    assert layers and all(m.quant_method.name == quantization for m in layers)
    assert all(getattr(m, f"{quantization}_experts") is not None for m in layers)
    assert all(m.w13.untyped_storage().nbytes() <= 4 for m in layers)          # no float copy kept
    if quantization == "fp8":
        assert all(m._prepared is None for m in layers)        # no fp8 kernel: the torch op, dequantized
    elif NativeMoe.available() is None:
        assert all(m._kernel is not None and m._prepared is not None for m in layers)
        assert {m._prepared.weight_format for m in layers} == {"q4" if quantization == "int4" else "s8"}
    for a, b in zip(exact, quant):
        assert len(b.outputs[0].token_ids) == 6
        assert max(abs(x - y) for x, y in zip(first_logprobs(a), first_logprobs(b))) < 0.05


@pytest.mark.parametrize("model_type", sorted(CONFIGS))
def test_native_op_computes_the_quantized_experts(tmp_path, monkeypatch, model_type):
    """The native op against the torch op on the same int4 experts, on a model whose experts weigh
    enough that running the wrong experts moves the log-probs by ~0.5 (quantization itself, ~0.12)."""
    from tokenmill.platforms import cpu_moe
    if cpu_moe.NativeMoe.available() is not None:
        pytest.skip(cpu_moe.NativeMoe.available())
    save_moe(model_type, tmp_path, expert_scale=3.0)
    native_llm, native = run(tmp_path, "int4")
    monkeypatch.setattr(cpu_moe, "moe_kernel", lambda *args, **kwargs: None)
    torch_llm, torch_op = run(tmp_path, "int4")
    assert {type(m._kernel).__name__ for m in native_llm.engine.bundle.model.modules()
            if type(m).__name__ == "FusedMoE"} == {"NativeMoe"}
    assert all(m._kernel is None for m in torch_llm.engine.bundle.model.modules() if type(m).__name__ == "FusedMoE")
    for a, b in zip(torch_op, native):
        assert max(abs(x - y) for x, y in zip(first_logprobs(a), first_logprobs(b))) < 0.05
