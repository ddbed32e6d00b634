"""The mixture-of-experts op and families (core/layers/moe.py, core/models/moe_families.py): the
router and the grouped reference op against naive per-token loops; the experts' weight loaders
(per-expert tensors, Mixtral's names, transformers' fused layout, tensor-parallel slices); Mixtral,
Qwen2-MoE, Qwen3-MoE and OLMoE on random-weight checkpoints transformers writes, greedy tokens
identical to transformers' float32 `generate` over chunked prefills, from the prefix cache and at
tensor_parallel_size=2; a platform's moe kernel taken through the kernel door; MoE layers run
eagerly between the native layers of the cpu fast decode path."""
from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from model_helpers import (assert_greedy_twice, generate, hf_greedy, make_llm, save_moe_checkpoint)

from tokenmill.core import distributed
from tokenmill.core.layers.kernels import apply_layer_kernels
from tokenmill.core.layers.moe import (MIXTRAL_EXPERT_NAMES, FusedMoE, expert_checkpoint_target, moe_reference,
                                       select_experts)
from tokenmill.quantization.interface import QuantizationMethod

VOCAB = 1000
SPECIAL = dict(vocab_size=VOCAB, bos_token_id=1, eos_token_id=2, pad_token_id=0)
DIMS = dict(hidden_size=64, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
            max_position_embeddings=256, num_experts_per_tok=2, **SPECIAL)
FAMILIES = {
    "mixtral": dict(DIMS, num_local_experts=8),
    # A shared expert with its gate; layer 1 dense (mlp_only_layers).
    "qwen2_moe": dict(DIMS, num_experts=8, moe_intermediate_size=32, shared_expert_intermediate_size=64,
                      mlp_only_layers=[1]),
    # Every second layer sparse (decoder_sparse_step), the top-k weights renormalized.
    "qwen3_moe": dict(DIMS, num_experts=8, moe_intermediate_size=32, head_dim=16, decoder_sparse_step=2,
                      norm_topk_prob=True),
    "olmoe": dict(DIMS, num_experts=8),
}
ARCHITECTURES = {"mixtral": "MixtralForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM",
                 "qwen3_moe": "Qwen3MoeForCausalLM", "olmoe": "OlmoeForCausalLM"}
# Mixed lengths over 16-token blocks and 32-token prefill chunks.
PROMPTS = [[3 + (i * 37 + j * 11) % (VOCAB - 3) for j in range(n)] for i, n in enumerate((45, 11, 23, 33))]


def save_family(model_type: str, directory, seed: int = 0, **overrides):
    """A random-weight transformers model saved with a tokenizer (routers decisive); the float32 model."""
    return save_moe_checkpoint(model_type, {**FAMILIES[model_type], **overrides}, directory, seed, VOCAB)


def naive_moe(hidden, w13, w2, weights, ids, activation="silu"):
    """Token by token, expert by expert."""
    act = {"silu": F.silu, "gelu": F.gelu}[activation]
    out = torch.zeros_like(hidden)
    for t in range(hidden.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            gate, up = (w13[e] @ hidden[t]).chunk(2)
            out[t] += weights[t, j] * (w2[e] @ (act(gate) * up))
    return out


def naive_select(logits, top_k, scoring="softmax", renormalize=False, num_groups=None, topk_groups=None,
                 bias=None, scaling=1.0):
    """The router one token at a time, in Python lists."""
    all_weights, all_ids = [], []
    for row in logits.float():
        scores = (row.softmax(-1) if scoring == "softmax" else row.sigmoid()).tolist()
        choice = [s + (float(bias[e]) if bias is not None else 0.0) for e, s in enumerate(scores)]
        eligible = list(range(len(scores)))
        if num_groups:
            size = len(scores) // num_groups
            groups = [choice[g * size:(g + 1) * size] for g in range(num_groups)]
            rank = [sum(sorted(g)[-2:]) if bias is not None else max(g) for g in groups]
            kept = sorted(range(num_groups), key=lambda g: -rank[g])[:topk_groups]
            eligible = [e for e in eligible if e // size in kept]
        ids = sorted(eligible, key=lambda e: -choice[e])[:top_k]
        weights = [scores[e] for e in ids]
        if renormalize:
            weights = [w / sum(weights) for w in weights]
        all_weights.append([w * scaling for w in weights])
        all_ids.append(ids)
    return torch.tensor(all_weights), torch.tensor(all_ids)


def random_experts(num_experts=8, hidden=32, size=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(num_experts, 2 * size, hidden, generator=g) * 0.2,
            torch.randn(num_experts, hidden, size, generator=g) * 0.2)


@pytest.mark.parametrize("case", ["all_experts", "some_experts_idle", "one_token", "top_k_all", "gelu"])
def test_reference_op_matches_a_per_token_loop(case):
    num_experts, top_k, tokens = 8, 2, 40
    g = torch.Generator().manual_seed(1)
    if case == "one_token":
        tokens = 1
    if case == "top_k_all":
        top_k = num_experts
    w13, w2 = random_experts(num_experts)
    hidden = torch.randn(tokens, 32, generator=g)
    logits = torch.randn(tokens, num_experts, generator=g)
    if case == "some_experts_idle":               # experts 1, 4 and 6 picked by no token
        logits[:, [1, 4, 6]] = -1e4
    weights, ids = select_experts(logits, top_k, renormalize=True)
    if case == "all_experts":
        assert set(ids.flatten().tolist()) == set(range(num_experts))
    if case == "some_experts_idle":
        assert not {1, 4, 6} & set(ids.flatten().tolist())
    activation = "gelu" if case == "gelu" else "silu"
    got = moe_reference(hidden, w13, w2, weights, ids, activation)
    torch.testing.assert_close(got, naive_moe(hidden, w13, w2, weights, ids, activation), atol=1e-5, rtol=1e-5)


def test_reference_op_runs_each_expert_once_and_skips_idle_ones(monkeypatch):
    w13, w2 = random_experts()
    hidden = torch.randn(10, 32)
    ids = torch.tensor([[0, 3]] * 5 + [[3, 5]] * 5)
    calls = []
    real = F.linear
    monkeypatch.setattr(F, "linear", lambda x, w, *a: calls.append(x.shape[0]) or real(x, w, *a))
    moe_reference(hidden, w13, w2, torch.full((10, 2), 0.5), ids)
    assert calls == [5, 5, 10, 10, 5, 5]          # experts 0, 3, 5: gate_up and down each, on their tokens
    assert moe_reference(hidden[:0], w13, w2, torch.zeros(0, 2), ids[:0]).shape == (0, 32)


@pytest.mark.parametrize("scoring", ["softmax", "sigmoid"])
@pytest.mark.parametrize("renormalize", [False, True])
def test_router_matches_a_per_token_loop(scoring, renormalize):
    logits = torch.randn(30, 8, generator=torch.Generator().manual_seed(2))
    weights, ids = select_experts(logits, 2, scoring, renormalize)
    want_weights, want_ids = naive_select(logits, 2, scoring, renormalize)
    assert torch.equal(ids, want_ids)
    torch.testing.assert_close(weights, want_weights)
    if renormalize:
        torch.testing.assert_close(weights.sum(-1), torch.ones(30))


@pytest.mark.parametrize("with_bias", [False, True])
def test_grouped_top_k_matches_a_per_token_loop(with_bias):
    """DeepSeek V3's router: 16 experts in 4 groups, the best 2 groups eligible (ranked by their best
    two bias-corrected scores), top-4 of those; the weights are the uncorrected sigmoid scores,
    renormalized and scaled by routed_scaling_factor."""
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(50, 16, generator=g)
    bias = torch.randn(16, generator=g) * 0.5 if with_bias else None
    kwargs = dict(num_groups=4, topk_groups=2, routed_scaling_factor=2.5)
    weights, ids = select_experts(logits, 4, "sigmoid", True, correction_bias=bias, **kwargs)
    want_weights, want_ids = naive_select(logits, 4, "sigmoid", True, 4, 2, bias, 2.5)
    assert torch.equal(ids, want_ids)
    torch.testing.assert_close(weights, want_weights)
    groups = (ids // 4).tolist()
    assert all(len(set(row)) <= 2 for row in groups)          # from at most topk_groups groups
    if with_bias:              # the bias changes which experts win
        assert not torch.equal(ids, select_experts(logits, 4, "sigmoid", True, **kwargs)[1])


def test_expert_checkpoint_names():
    assert expert_checkpoint_target("model.layers.3.mlp.experts.12.gate_proj.weight") == \
        ("model.layers.3.mlp.w13", (12, "gate"))
    assert expert_checkpoint_target("model.layers.3.mlp.experts.1.down_proj.weight") == \
        ("model.layers.3.mlp.w2", (1, "down"))
    assert expert_checkpoint_target("model.layers.0.mlp.experts.7.w3.weight", MIXTRAL_EXPERT_NAMES) == \
        ("model.layers.0.mlp.w13", (7, "up"))
    assert expert_checkpoint_target("model.layers.0.mlp.experts.gate_up_proj") == ("model.layers.0.mlp.w13", None)
    for other in ("model.layers.0.mlp.gate.weight", "model.layers.0.mlp.shared_expert.gate_proj.weight",
                  "model.layers.0.mlp.gate_proj.weight"):
        assert expert_checkpoint_target(other) is None


@pytest.mark.parametrize("rank", [0, 1])
def test_weight_loader_takes_each_form_and_this_ranks_slice(monkeypatch, rank):
    """Per-expert tensors and the fused [E, 2I, H] / [E, H, I] layout fill the same stacked weights:
    at tensor_parallel_size=2 this rank's rows of gate and of up, its columns of down."""
    monkeypatch.setattr(distributed, "_STATE", distributed.ParallelState(tp_rank=rank, tp_size=2))
    w13, w2 = random_experts(num_experts=4, hidden=8, size=6)
    per_expert, fused = (FusedMoE(8, 6, 4, 2, torch.float32) for _ in range(2))
    for e in range(4):
        per_expert.weight_loader(per_expert.w13, w13[e, :6], (e, "gate"))
        per_expert.weight_loader(per_expert.w13, w13[e, 6:], (e, "up"))
        per_expert.weight_loader(per_expert.w2, w2[e], (e, "down"))
    fused.weight_loader(fused.w13, w13)
    fused.weight_loader(fused.w2, w2)
    rows = slice(3 * rank, 3 * rank + 3)
    want13 = torch.cat((w13[:, :6][:, rows], w13[:, 6:][:, rows]), dim=1)
    for layer in (per_expert, fused):
        assert torch.equal(layer.w13, want13) and torch.equal(layer.w2, w2[:, :, rows])
    with pytest.raises(ValueError, match="expected 6 along dim 0"):
        per_expert.weight_loader(per_expert.w13, w13[0, :5], (0, "gate"))


def test_quantized_experts_are_refused():
    class Int4(QuantizationMethod):
        name = "int4"
    with pytest.raises(ValueError, match="quantization 'int4' does not cover mixture-of-experts"):
        FusedMoE(64, 32, 8, 2, torch.float32, Int4())


@pytest.mark.parametrize("model_type", sorted(FAMILIES))
def test_greedy_matches_transformers(tmp_path, model_type):
    """Chunked prefills (32-token chunks) of mixed-length prompts batched with decodes, then the
    same prompts again from the prefix cache: transformers' float32 tokens."""
    hf = save_family(model_type, tmp_path)
    expected = hf_greedy(hf, PROMPTS)
    llm = make_llm(tmp_path)
    model = llm.engine.bundle.model
    assert type(model).__name__ == ARCHITECTURES[model_type]
    sparse = [i for i, layer in enumerate(model.model.layers) if isinstance(layer.mlp, FusedMoE)]
    assert sparse == {"qwen2_moe": [0, 2, 3], "qwen3_moe": [1, 3]}.get(model_type, [0, 1, 2, 3])
    assert_greedy_twice(llm, PROMPTS, expected)


@pytest.mark.parametrize("model_type", sorted(FAMILIES))
def test_logits_match_transformers(tmp_path, model_type):
    from model_helpers import hf_last_logits, load_for_test, run_prompt
    hf = save_family(model_type, tmp_path, seed=1)
    model = load_for_test(tmp_path).model
    torch.testing.assert_close(run_prompt(model, PROMPTS[0]), hf_last_logits(hf, PROMPTS[0]), atol=2e-4, rtol=2e-4)


def test_fused_expert_checkpoint_layout(tmp_path):
    """A checkpoint with transformers' fused experts (mlp.experts.gate_up_proj [E, 2I, H] and
    down_proj [E, H, I]) loads into the same weights: the same tokens."""
    from safetensors.torch import load_file, save_file
    hf = save_family("qwen3_moe", tmp_path)
    tensors = load_file(str(tmp_path / "model.safetensors"))
    for layer in (1, 3):
        prefix = f"model.layers.{layer}.mlp.experts"
        gate, up, down = ([tensors.pop(f"{prefix}.{e}.{name}.weight") for e in range(8)]
                          for name in ("gate_proj", "up_proj", "down_proj"))
        tensors[f"{prefix}.gate_up_proj"] = torch.stack([torch.cat(pair) for pair in zip(gate, up)])
        tensors[f"{prefix}.down_proj"] = torch.stack(down)
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    llm = make_llm(tmp_path)
    assert [list(o.outputs[0].token_ids) for o in generate(llm, PROMPTS[:2])] == hf_greedy(hf, PROMPTS[:2])


def test_a_platform_moe_kernel_is_taken_and_may_decline(tmp_path):
    save_family("mixtral", tmp_path)
    model = make_llm(tmp_path).engine.bundle.model
    seen = []

    def kernel(hidden, w13, w2, weights, ids, activation):
        seen.append((hidden.shape[0], activation))
        return NotImplemented if len(seen) > 1 else torch.zeros_like(hidden)

    assert apply_layer_kernels(model, {"moe": kernel}) == 4
    layer = model.model.layers[0].mlp
    x = torch.randn(3, 64)
    assert torch.equal(layer(x), torch.zeros(3, 64))                     # the kernel's output
    weights, ids = layer.route(x)
    torch.testing.assert_close(layer(x), moe_reference(x, layer.w13, layer.w2, weights, ids))   # declined
    assert seen == [(3, "silu"), (3, "silu")]


@pytest.mark.parametrize("model_type", ["mixtral", "qwen2_moe", "qwen3_moe"])
def test_tp2_matches_transformers(tmp_path, model_type):
    """At tensor_parallel_size=2 each rank holds half of every expert's (and the shared expert's)
    intermediate size: transformers' tokens."""
    hf = save_family(model_type, tmp_path)
    prompts = PROMPTS[:2]
    expected = hf_greedy(hf, prompts)
    llm = make_llm(tmp_path, tensor_parallel_size=2)
    try:
        assert [list(o.outputs[0].token_ids) for o in generate(llm, prompts)] == expected
    finally:
        llm.engine.executor.shutdown()


def test_olmoe_refuses_what_it_cannot_run(tmp_path, monkeypatch):
    """q/k norms over the whole projection at tensor parallelism; clip_qkv."""
    from model_helpers import load_for_test
    save_family("olmoe", tmp_path)
    with monkeypatch.context() as patch:          # a rank of two, as a worker of a tp=2 run builds it
        patch.setattr(distributed, "_STATE", distributed.ParallelState(tp_size=2))
        with pytest.raises(ValueError, match="do not split over tensor-parallel ranks"):
            load_for_test(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "clip_qkv": 8.0}))
    with pytest.raises(ValueError, match="clip_qkv"):
        make_llm(tmp_path)


def test_features_say_what_is_not_supported():
    from tokenmill.core.models.features import model_features
    from tokenmill.plugins import discovery
    registered = discovery.model_architectures()
    for name in ARCHITECTURES.values():
        features = model_features(registered[name])
        assert features["lora"] == {"supported": False, "detail": "experts: not supported"}
        assert features["quantization"]["supported"] is True and "int4 / int8" in features["quantization"]["detail"]
        assert features["fast_path"]["supported"] is True and "expert FFNs" in features["fast_path"]["detail"]
    assert model_features(registered["OlmoeForCausalLM"])["tp"]["supported"] is False


def test_bf16_fast_path_runs_moe_layers_eagerly_between_native_ones(tmp_path, monkeypatch):
    """bf16 on the cpu fused decode path: Qwen3-MoE's dense layers (0, 2) native, its sparse layers
    (1, 3) eager in between; the same tokens as the eager model in bf16. Both runs take the torch
    MoE op, whose bf16 roundings the native dense layers match: the native MoE op (float32 sums,
    tests/kernels/test_moe_kernels.py) meets an exact bf16 logit tie on this random model."""
    from tokenmill.platforms import cpu_decode_kernels as native
    from tokenmill.platforms import cpu_moe
    monkeypatch.setattr(cpu_moe, "moe_kernel", lambda *args, **kwargs: None)
    why = native.NativeHeadKernel.available()
    if why is not None or not native.LIBRARY.require().fused_decode_caps() & 2:
        pytest.skip(f"no fused bf16 decode here: {why or 'no AVX512-BF16'}")
    save_family("qwen3_moe", tmp_path)
    fast = make_llm(tmp_path, dtype="bfloat16", max_num_batched_tokens=64, disable_hybrid_kv_cache_manager=True)
    runner = fast.engine.runner
    assert runner.fast_path_report()["took_the_model"]
    assert runner.decode_program.eager_layers == [1, 3]
    got = [list(o.outputs[0].token_ids) for o in generate(fast, PROMPTS, max_tokens=12)]
    assert runner.forward.last_path == "fused_decode"
    eager = make_llm(tmp_path, dtype="bfloat16", max_num_batched_tokens=64, enforce_eager=True)
    assert got == [list(o.outputs[0].token_ids) for o in generate(eager, PROMPTS, max_tokens=12)]


def test_lora_on_attention_of_a_moe_model_matches_peft(tmp_path):
    """LoRA on Qwen3-MoE's attention (the experts stay unadapted): peft's greedy tokens."""
    from lora_helpers import make_adapter

    from tokenmill.core.lora.request import LoRARequest
    from tokenmill.core.sampling_params import SamplingParams
    base = save_moe_checkpoint("qwen3_moe", FAMILIES["qwen3_moe"], tmp_path / "base")
    peft_model = make_adapter(str(tmp_path / "base"), str(tmp_path / "adapter"), seed=7,
                              targets=["q_proj", "k_proj", "v_proj", "o_proj"])
    prompts = [[1, 5, 9, 33, 7], [1, 400, 3, 3, 99, 12, 8]]
    expected = hf_greedy(peft_model, prompts)
    assert expected != hf_greedy(base, prompts)                      # the adapter changes the tokens
    llm = make_llm(tmp_path / "base", enable_lora=True, max_lora_rank=8)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True),
                        lora_request=LoRARequest("a", 1, str(tmp_path / "adapter")), use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outs] == expected


def test_lora_on_experts_is_refused_with_a_clear_error(tmp_path):
    """An adapter with expert tensors (per-expert modules, or peft's target_parameters on the stacked
    experts) is refused by name rather than as an unknown module."""
    import safetensors.torch

    from tokenmill.core.lora.adapter import LoRAAdapterError
    from tokenmill.core.lora.request import LoRARequest
    save_moe_checkpoint("olmoe", FAMILIES["olmoe"], tmp_path / "base")
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    config = {"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": ["q_proj"], "bias": "none"}
    prefix = "base_model.model.model.layers.0"
    tensors = {f"{prefix}.self_attn.q_proj.lora_A.weight": torch.zeros(4, 64),
               f"{prefix}.self_attn.q_proj.lora_B.weight": torch.zeros(64, 4),
               f"{prefix}.mlp.experts.3.gate_proj.lora_A.weight": torch.zeros(4, 64),
               f"{prefix}.mlp.experts.3.gate_proj.lora_B.weight": torch.zeros(64, 4)}
    safetensors.torch.save_file(tensors, str(adapter / "adapter_model.safetensors"))
    llm = make_llm(tmp_path / "base", enable_lora=True, max_lora_rank=8)
    for extra in ({}, {"target_parameters": ["mlp.experts.gate_up_proj"]}):
        (adapter / "adapter_config.json").write_text(json.dumps({**config, **extra}))
        with pytest.raises(LoRAAdapterError, match="mixture-of-experts experts is not supported"):
            llm.engine.add_lora(LoRARequest(f"a{len(extra)}", 1 + len(extra), str(adapter)))
