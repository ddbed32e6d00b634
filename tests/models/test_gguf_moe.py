"""GGUF mixture-of-experts files as llama.cpp's converter writes them (core/loaders/gguf_families.py):
qwen2moe (a shared expert and its gate), qwen3moe, olmoe, and Mixtral as "llama" with expert_count; the
experts stacked per layer as blk.N.ffn_{gate,up,down}_exps [E, rows, cols], the router ffn_gate_inp
(float32, as the converter keeps it). F32 files give transformers' float32 greedy tokens; Q8_0
files, dequantized at load, logits close to them; kept quantized (quantization="gguf"), the
dequantized file's logits."""
from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q, GGUFWriter

from gguf_writers import quantize
from model_helpers import generate, hf_greedy, hf_last_logits, load_for_test, make_llm, run_prompt, tiny_tokenizer

torch.set_num_threads(1)

VOCAB = 1000
DIMS = dict(hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            max_position_embeddings=256, num_experts_per_tok=2, vocab_size=VOCAB, bos_token_id=1, eos_token_id=2,
            pad_token_id=0)
# case -> (HF model_type, GGUF architecture, config, our class)
CASES = {
    "qwen2_moe": ("qwen2_moe", "qwen2moe", dict(DIMS, num_experts=8, moe_intermediate_size=32,
                                                shared_expert_intermediate_size=64), "Qwen2MoeForCausalLM"),
    "qwen3_moe": ("qwen3_moe", "qwen3moe", dict(DIMS, num_experts=8, moe_intermediate_size=32, head_dim=16,
                                                norm_topk_prob=True), "Qwen3MoeForCausalLM"),
    "mixtral": ("mixtral", "llama", dict(DIMS, num_local_experts=8), "MixtralForCausalLM"),
    "olmoe": ("olmoe", "olmoe", dict(DIMS, num_experts=8), "OlmoeForCausalLM"),
}
PROMPTS = [[3 + (i * 37 + j * 11) % (VOCAB - 3) for j in range(n)] for i, n in enumerate((29, 13))]
EXPERT_PARTS = {"gate_proj": "gate", "up_proj": "up", "down_proj": "down", "w1": "gate", "w3": "up", "w2": "down"}


def save_hf(case: str, directory, seed: int = 0):
    """Random weights away from init, routers scaled so each token's experts win by clear margins."""
    import transformers
    model_type, _, config, _ = CASES[case]
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(model_type, **config),
                                                          dtype=torch.float32).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.add_(torch.randn_like(param) * 0.05)
            if name.endswith("gate.weight") and param.shape[0] == 8:
                param.mul_(20.0)
    model.save_pretrained(str(directory))
    tiny_tokenizer(VOCAB).save_pretrained(str(directory))
    return model


def write_gguf(hf_dir, path: str, arch: str, qtype: Q, stacked: bool = True) -> None:
    """The converter's layout: TextModel's keys plus expert_count / expert_used_count / the experts'
    (and shared expert's) FFN lengths; each layer's experts stacked per projection; the routers in
    float32; other matrices in `qtype`."""
    from safetensors.numpy import load_file
    from transformers import AutoConfig

    hp = AutoConfig.from_pretrained(str(hf_dir)).to_dict()
    w = GGUFWriter(path, arch)
    w.add_block_count(hp["num_hidden_layers"])
    w.add_context_length(hp["max_position_embeddings"])
    w.add_embedding_length(hp["hidden_size"])
    w.add_feed_forward_length(hp["intermediate_size"])
    w.add_head_count(hp["num_attention_heads"])
    w.add_head_count_kv(hp["num_key_value_heads"])
    w.add_rope_freq_base((hp.get("rope_parameters") or {}).get("rope_theta", 10000.0))
    w.add_layer_norm_rms_eps(hp["rms_norm_eps"])
    if hp.get("head_dim"):
        w.add_key_length(hp["head_dim"])
        w.add_value_length(hp["head_dim"])
    w.add_expert_count(hp.get("num_experts") or hp["num_local_experts"])
    w.add_expert_used_count(hp["num_experts_per_tok"])
    if hp.get("moe_intermediate_size"):
        w.add_expert_feed_forward_length(hp["moe_intermediate_size"])
    if hp.get("shared_expert_intermediate_size"):
        w.add_expert_shared_feed_forward_length(hp["shared_expert_intermediate_size"])
    if arch == "llama":
        w.add_vocab_size(hp["vocab_size"])
        w.add_rope_dimension_count(hp["hidden_size"] // hp["num_attention_heads"])
    names = gguf.get_tensor_name_map({v: k for k, v in gguf.MODEL_ARCH_NAMES.items()}[arch], hp["num_hidden_layers"])
    tensors, experts = {}, {}
    for name, value in load_file(f"{hf_dir}/model.safetensors").items():
        value = value.astype(np.float32)
        if arch == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):       # LlamaModel.permute
            heads = hp["num_attention_heads"] if "q_proj" in name else hp["num_key_value_heads"]
            value = value.reshape(heads, 2, value.shape[0] // heads // 2, -1).swapaxes(1, 2).reshape(value.shape)
        parts = name.split(".")
        if "experts" in parts:
            layer, e, proj = int(parts[2]), int(parts[parts.index("experts") + 1]), parts[-2]
            experts.setdefault((layer, EXPERT_PARTS[proj]), {})[e] = value
            continue
        name = name.replace(".block_sparse_moe.", ".mlp.")
        gguf_name = {"mlp.gate.weight": "ffn_gate_inp.weight",
                     "mlp.shared_expert_gate.weight": "ffn_gate_inp_shexp.weight"}.get(name.split(".", 3)[-1])
        if gguf_name is not None:
            tensors[f"blk.{parts[2]}.{gguf_name}"] = value
            continue
        tensors[names.get_name(name, try_suffixes=(".weight", ".bias"))] = value
    for (layer, part), by_expert in experts.items():
        if stacked:
            tensors[f"blk.{layer}.ffn_{part}_exps.weight"] = np.stack([by_expert[e] for e in sorted(by_expert)])
        else:       # older Mixtral files: one tensor per expert
            tensors.update({f"blk.{layer}.ffn_{part}.{e}.weight": value for e, value in by_expert.items()})
    for name, value in tensors.items():
        if qtype != Q.F32 and value.ndim > 1 and not name.endswith(("norm.weight", "ffn_gate_inp.weight",
                                                                    "ffn_gate_inp_shexp.weight")):
            rows = quantize(value.reshape(-1, value.shape[-1]), qtype, np.random.default_rng(0))
            w.add_tensor(name, rows.reshape(*value.shape[:-1], -1), raw_dtype=qtype)
        else:
            w.add_tensor(name, value)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _convert(tmp_path, case: str, qtype: Q = Q.F32):
    hf = save_hf(case, tmp_path / "hf")
    path = str(tmp_path / f"{case}.{qtype.name}.gguf")
    write_gguf(tmp_path / "hf", path, CASES[case][1], qtype)
    return hf, path, str(tmp_path / "hf")


@pytest.mark.parametrize("case", sorted(CASES))
def test_f32_greedy_matches_transformers(tmp_path, case):
    hf, path, hf_dir = _convert(tmp_path, case)
    llm = make_llm(path, tokenizer=hf_dir)
    assert type(llm.engine.bundle.model).__name__ == CASES[case][3]
    assert [list(o.outputs[0].token_ids) for o in generate(llm, PROMPTS, 8)] == hf_greedy(hf, PROMPTS, 8)
    torch.testing.assert_close(run_prompt(llm.engine.bundle.model, PROMPTS[0]), hf_last_logits(hf, PROMPTS[0]),
                               atol=2e-4, rtol=2e-4)


def test_mixtral_with_one_tensor_per_expert(tmp_path):
    """Mixtral files written before llama.cpp stacked the experts: blk.N.ffn_gate.{e}.weight."""
    hf = save_hf("mixtral", tmp_path / "hf")
    path = str(tmp_path / "mixtral-legacy.gguf")
    write_gguf(tmp_path / "hf", path, "llama", Q.F32, stacked=False)
    llm = make_llm(path, tokenizer=str(tmp_path / "hf"))
    assert [list(o.outputs[0].token_ids) for o in generate(llm, PROMPTS, 8)] == hf_greedy(hf, PROMPTS, 8)


@pytest.mark.parametrize("case", sorted(CASES))
def test_q8_0_dequantized_close_to_transformers(tmp_path, case):
    hf, path, hf_dir = _convert(tmp_path, case, Q.Q8_0)
    got, want = run_prompt(load_for_test(path, tokenizer=hf_dir).model, PROMPTS[0]), hf_last_logits(hf, PROMPTS[0])
    rel = ((got - want).norm() / want.norm()).item()
    assert rel < 0.06, rel          # 8-bit weights with fp16 block scales, the embedding and head too
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() >= 0.85


@pytest.mark.parametrize("case,qtype", [("qwen3_moe", Q.Q8_0), ("qwen2_moe", Q.Q4_0), ("mixtral", Q.Q4_1)])
def test_kept_quantized(tmp_path, case, qtype):
    """quantization="gguf": each expert's blocks kept as stored (cut from the stacked tensors by whole
    rows). Without native kernels the torch op on the experts dequantized: the dequantized file's
    logits; with the cpu platform's, the native MoE op over the packed experts, to their int8
    activation rounding."""
    from tokenmill.platforms.cpu import CpuPlatform
    from tokenmill.platforms.cpu_moe import NativeMoe
    from tokenmill.platforms.interface import LayerKernels, QuantKernels

    class TiledCpu(CpuPlatform):
        def quantization_kernels(self, name):
            return QuantKernels()

        def layer_kernels(self, config):
            return LayerKernels()

    _, path, hf_dir = _convert(tmp_path, case, qtype)
    want = run_prompt(load_for_test(path, tokenizer=hf_dir).model, PROMPTS[0])
    for platform, bound in ((TiledCpu(), 1e-5), (CpuPlatform(), 0.04)):
        kept = load_for_test(path, platform=platform, quantization="gguf", tokenizer=hf_dir).model
        layers = [m for m in kept.modules() if type(m).__name__ == "FusedMoE"]
        assert layers and all(len(m.gguf_w13) == 8 and m.w13.untyped_storage().nbytes() <= 4 for m in layers)
        if isinstance(platform, TiledCpu):
            assert all(m._kernel is None for m in layers)
        elif NativeMoe.available() is None:
            assert all(m._prepared is not None and m._prepared.weight_format == "gguf" for m in layers)
        got = run_prompt(kept, PROMPTS[0])
        assert ((got - want).norm() / want.norm()).item() < bound
        assert (got.argmax(-1) == want.argmax(-1)).float().mean() >= 0.85
