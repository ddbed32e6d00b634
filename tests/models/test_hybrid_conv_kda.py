"""Hybrid short-conv and Kimi Delta Attention models on the recurrent state cache (core/state_cache.py):
LFM2 and LFM2-MoE (core/models/lfm2.py, gated short convs: core/layers/short_conv.py) and Kimi Linear
(core/models/kimi_linear.py: KDA, core/layers/kimi_delta.py, between NoPE MLA layers, DeepSeek-V3
experts). Each family on a random checkpoint transformers writes, greedy tokens identical to
transformers' float32 `generate` for mixed-length prompts split over several prefill chunks and batched
with decodes; the KDA rule's chunked and recurrent forms against transformers' and each other across a
state handed over between chunks; prefix caching through state checkpoints; preemption; the platform kernel door;
the refusals; LFM2 through the server once."""
from __future__ import annotations

import pytest
import torch

from model_helpers import (assert_greedy_twice, assert_server_greedy, generate, hf_greedy, make_llm,
                           save_moe_checkpoint, save_random_checkpoint)

from tokenmill.core.layers.kimi_delta import kimi_delta_rule_reference
from tokenmill.core.layers.short_conv import DepthwiseConv

VOCAB = 1000
IDS = dict(vocab_size=VOCAB, bos_token_id=1, eos_token_id=2, pad_token_id=0, max_position_embeddings=256)
LFM2 = dict(IDS, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, conv_L_cache=3, layer_types=["conv", "conv", "full_attention", "conv"])
FAMILIES = {
    # intermediate_size 128 -> 2/3 -> rounded up to block_multiple_of: a 96-wide SwiGLU.
    "lfm2": dict(LFM2, block_multiple_of=16),
    "lfm2_moe": dict(LFM2, conv_bias=True, num_dense_layers=1, num_experts=8, num_experts_per_tok=2,
                     moe_intermediate_size=32, layer_types=["conv", "full_attention", "conv", "conv"]),
    "kimi_linear": dict(IDS, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=4,
                        num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=32, q_lora_rank=None,
                        qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16, num_local_experts=8,
                        num_experts_per_tok=2, n_group=2, topk_group=1, n_shared_experts=1,
                        linear_num_heads=4, linear_head_dim=16, linear_conv_kernel_dim=4,
                        layer_types=["linear_attention", "full_attention", "linear_attention", "linear_attention"]),
}
# Mixed lengths over 16-token blocks and 16-token prefill chunks (the longest takes three).
PROMPTS = [[3 + (i * 37 + j * 11) % (VOCAB - 3) for j in range(n)] for i, n in enumerate((45, 11, 23, 33))]
CHUNK = dict(max_num_batched_tokens=16)


def _save(kind: str, path) -> torch.nn.Module:
    if kind == "lfm2":
        return save_random_checkpoint(kind, FAMILIES[kind], str(path))
    if kind == "kimi_linear":
        return save_moe_checkpoint(kind, FAMILIES[kind], path, correction_bias_scale=0.1)
    hf = save_moe_checkpoint(kind, FAMILIES[kind], path, router="feed_forward.gate.weight")
    with torch.no_grad():         # LFM2-MoE's expert bias (feed_forward.expert_bias) picks experts too
        for name, buffer in hf.named_buffers():
            if name.endswith("expert_bias"):
                buffer.copy_(torch.randn_like(buffer) * 0.1)
    hf.save_pretrained(str(path))
    return hf


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request, tmp_path_factory):
    """(kind, checkpoint path, transformers' greedy tokens for PROMPTS) of one family."""
    kind = request.param
    path = tmp_path_factory.mktemp(kind)
    return kind, path, hf_greedy(_save(kind, path), PROMPTS)


def tokens(outputs) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in outputs]


def test_family_matches_transformers_over_chunked_prompts(family):
    """Greedy tokens == transformers' over prompts split into chunks, batched with decodes, and again from
    the prefix cache (the recurrent states checkpointed at block boundaries); again with a platform kernel for
    the recurrence (KDA's door) answering every other call."""
    from tokenmill.core.layers.kernels import apply_layer_kernels
    kind, path, expected = family
    llm = make_llm(path, **CHUNK)
    # Twice: the second pass resumes the prompts from the state checkpoints of their cached blocks.
    assert_greedy_twice(llm, PROMPTS, expected)
    bm = llm.engine.scheduler.block_manager
    assert bm.enable_prefix_caching and bm.state_slots.num_free == bm.state_slots.num_slots
    model = llm.engine.runner.model
    kinds = {layer.state_spec.kind for layer in model.recurrent_layers}
    assert kinds == ({"kda"} if kind == "kimi_linear" else {"short_conv"})
    if kind != "kimi_linear":
        return
    calls: list[bool] = []

    def kernel(q, k, v, g, beta, state, chunked):
        calls.append(chunked)
        return NotImplemented if len(calls) % 2 else kimi_delta_rule_reference(q, k, v, g, beta, state, chunked)
    assert apply_layer_kernels(model, {"kimi_delta_rule": kernel}) == len(model.recurrent_layers) == 3
    assert tokens(generate(llm, PROMPTS)) == expected
    assert True in calls and False in calls


def test_preemption_under_a_small_pool_keeps_the_tokens(family):
    _, path, expected = family
    llm = make_llm(path, num_gpu_blocks_override=6, kv_cache_memory=None, **CHUNK)   # 96 tokens of KV, ~150 in flight
    assert tokens(generate(llm, PROMPTS)) == expected
    assert llm.engine.scheduler.num_preemptions > 0
    bm = llm.engine.scheduler.block_manager
    assert bm.state_slots.num_free == bm.state_slots.num_slots


def test_refusals(family):
    kind, path, _ = family
    with pytest.raises(ValueError, match="speculative decoding.*rolled back"):
        make_llm(path, speculative_config={"method": "ngram", "num_speculative_tokens": 2})


def test_server_greedy(tmp_path_factory):
    path = tmp_path_factory.mktemp("server")
    hf = _save("lfm2", path)
    assert_server_greedy(path, PROMPTS[:2], hf_greedy(hf, PROMPTS[:2]))


def test_short_conv_continues_from_its_state():
    """The conv over 10 inputs at once == over 4, then 6 from the state, == one token at a time."""
    torch.manual_seed(0)
    conv = DepthwiseConv(6, 3, True, torch.float32)
    conv.weight.normal_(), conv.bias.normal_()
    x = torch.randn(10, 6)
    state = torch.zeros(6, 2)
    whole = conv.prefill(x, state.clone(), fresh=True)
    ref = torch.nn.functional.conv1d(x.t().unsqueeze(0), conv.weight, conv.bias, padding=2, groups=6)[0, :, :10].t()
    torch.testing.assert_close(whole, ref)
    parts = torch.cat((conv.prefill(x[:4], state, fresh=True), conv.prefill(x[4:], state, fresh=False)))
    torch.testing.assert_close(parts, whole)
    states, steps = torch.zeros(2, 6, 2), []
    for i in range(10):
        steps.append(conv.decode(x[i:i + 1], states, torch.tensor([1]), [0] if i == 0 else []))
    torch.testing.assert_close(torch.cat(steps), whole)
    torch.testing.assert_close(states[1], state)


def _inputs(n: int, h: int = 2, d: int = 8, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(1, n, h, d, generator=g) for _ in range(3))
    decay = -torch.rand(1, n, h, d, generator=g) * 0.5           # per key channel
    beta = torch.rand(1, n, h, generator=g)
    return q, k, v, decay, beta


def test_kda_forms_agree_and_continue_from_a_state():
    """The chunked form over 150 tokens (three 64-token chunks) == transformers' chunked form; over 37 +
    113 tokens with the state handed over == the same; token by token == transformers' recurrent form."""
    from transformers.models.kimi_linear import modeling_kimi_linear as ref
    q, k, v, g, beta = _inputs(150)
    zero = torch.zeros(1, 2, 8, 8)
    whole, state = kimi_delta_rule_reference(q, k, v, g, beta, zero, chunked=True)
    theirs, their_state = ref.chunk_kimi_delta_attention(q, k, v, g, beta, initial_state=None, output_final_state=True,
                                                         use_qk_l2norm_in_kernel=True)
    torch.testing.assert_close(whole, theirs, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(state, their_state, atol=1e-5, rtol=1e-4)
    first, mid = kimi_delta_rule_reference(*(x[:, :37] for x in (q, k, v, g, beta)), zero, chunked=True)
    second, end = kimi_delta_rule_reference(*(x[:, 37:] for x in (q, k, v, g, beta)), mid, chunked=True)
    torch.testing.assert_close(torch.cat((first, second), dim=1), whole, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(end, state, atol=1e-5, rtol=1e-4)
    steps, s = [], zero
    for i in range(150):
        o, s = kimi_delta_rule_reference(*(x[:, i:i + 1] for x in (q, k, v, g, beta)), s, chunked=False)
        steps.append(o)
    torch.testing.assert_close(torch.cat(steps, dim=1), whole, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(s, state, atol=1e-5, rtol=1e-4)
    theirs, _ = ref.recurrent_kimi_delta_attention(q, k, v, g, beta, initial_state=None, output_final_state=True,
                                                   use_qk_l2norm_in_kernel=True)
    torch.testing.assert_close(torch.cat(steps, dim=1), theirs)
