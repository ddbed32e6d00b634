"""Hybrid Gated DeltaNet models (core/models/qwen3_next.py: Qwen3-Next, Qwen3.5 dense and MoE) on the
recurrent state cache (core/state_cache.py): the delta rule's chunked and recurrent forms against
transformers' and each other across a state handed over between chunks; each family on a random
checkpoint transformers writes, greedy tokens identical to transformers' float32 `generate` for
mixed-length prompts split over several prefill chunks and batched with decodes; state slots capping
the running sequences (and the start-up log's arithmetic); preemption under a small pool; n > 1;
the refusals (speculative decoding) and what is turned off (the fast decode path); the server once.
(Prefix caching through state checkpoints: tests/models/test_hybrid_prefix_cache.py.)"""
from __future__ import annotations

import logging

import pytest
import torch

from model_helpers import (assert_server_greedy, generate, hf_greedy, make_llm, save_moe_checkpoint,
                           save_random_checkpoint)

from tokenmill.core.layers.gated_deltanet import gated_delta_rule_reference
from tokenmill.core.state_cache import RecurrentStateSpec, StateCache, StateLayout, StateSlots

VOCAB = 1000
BASE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, max_position_embeddings=256, vocab_size=VOCAB, bos_token_id=1, eos_token_id=2, pad_token_id=0,
            linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
            linear_conv_kernel_dim=4)
MOE = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=64)
FAMILIES = {
    # Three DeltaNet layers to one gated-attention layer (the default interval); layer 1 dense.
    "qwen3_next": dict(BASE, **MOE, mlp_only_layers=[1], norm_topk_prob=True),
    "qwen3_5_text": dict(BASE, layer_types=["linear_attention", "full_attention"] * 2),
    "qwen3_5_moe_text": dict(BASE, **MOE, layer_types=["linear_attention", "linear_attention", "full_attention",
                                                       "linear_attention"]),
}
# Mixed lengths over 16-token blocks and 16-token prefill chunks (the longest takes three).
PROMPTS = [[3 + (i * 37 + j * 11) % (VOCAB - 3) for j in range(n)] for i, n in enumerate((45, 11, 23, 33))]
CHUNK = dict(max_num_batched_tokens=16)


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request, tmp_path_factory):
    """(checkpoint path, transformers' greedy tokens for PROMPTS) of one family."""
    kind = request.param
    path = tmp_path_factory.mktemp(kind)
    save = save_random_checkpoint if kind == "qwen3_5_text" else save_moe_checkpoint
    hf = save(kind, FAMILIES[kind], str(path))
    return path, hf_greedy(hf, PROMPTS)


def tokens(outputs) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in outputs]


def test_family_matches_transformers_over_chunked_prompts(family, caplog):
    path, expected = family
    with caplog.at_level(logging.INFO):
        llm = make_llm(path, **CHUNK)
    assert tokens(generate(llm, PROMPTS)) == expected
    again = generate(llm, PROMPTS)            # full prompt blocks resume from their state checkpoints
    assert tokens(again) == expected and [o.num_cached_tokens for o in again] == [32, 0, 16, 32]
    assert "prefix-cache state checkpoints" in caplog.text
    bm = llm.engine.scheduler.block_manager
    assert bm.enable_prefix_caching and bm.state_slots.num_free == bm.state_slots.num_slots
    bm.check_invariants([])


def test_state_slots_cap_running_sequences_and_the_log_states_the_arithmetic(family, caplog):
    """A budget with room for two sequences' states: max_num_seqs capped at 2, the four prompts still
    give transformers' tokens, at most two run at once, and the blocks plus the slots fit the budget."""
    path, expected = family
    llm = make_llm(path, kv_cache_memory=16 << 20, **CHUNK)
    layout = llm.engine.runner.state_layout
    budget = 6 * layout.bytes_per_seq - 1       # states may take half: room for 2 (not 3) slots
    with caplog.at_level(logging.INFO):        # (no prefix caching: its state checkpoints would take a quarter more)
        llm = make_llm(path, kv_cache_memory=budget, max_num_seqs=8, enable_prefix_caching=False, **CHUNK)
    runner, scheduler = llm.engine.runner, llm.engine.scheduler
    assert runner.num_state_slots == 2 and scheduler.config.max_num_seqs == 2
    assert runner.num_blocks * runner.bytes_per_block + 2 * layout.bytes_per_seq <= budget
    assert f"{layout.bytes_per_seq} bytes per sequence" in caplog.text
    assert "2 sequence slots" in caplog.text and "max_num_seqs capped from 8 to 2" in caplog.text
    running: list[int] = []
    schedule = scheduler.schedule

    def watched():
        batch = schedule()
        running.append(len(scheduler.running))
        scheduler.block_manager.check_invariants(scheduler.running)
        return batch
    scheduler.schedule = watched
    assert tokens(generate(llm, PROMPTS)) == expected
    assert max(running) == 2


def test_preemption_under_a_small_pool_keeps_the_tokens(family):
    path, expected = family
    llm = make_llm(path, num_gpu_blocks_override=6, kv_cache_memory=None, **CHUNK)   # 96 tokens of KV, ~150 in flight
    assert tokens(generate(llm, PROMPTS)) == expected
    assert llm.engine.scheduler.num_preemptions > 0
    bm = llm.engine.scheduler.block_manager
    assert bm.state_slots.num_free == bm.state_slots.num_slots


def test_n_choices_each_run_their_own_state(family):
    from tokenmill.core.sampling_params import SamplingParams
    path, expected = family
    llm = make_llm(path, **CHUNK)
    out = llm.generate([{"prompt_token_ids": PROMPTS[0]}], SamplingParams(n=2, temperature=0.0, max_tokens=10,
                                                                          ignore_eos=True), use_tqdm=False)
    assert [list(c.token_ids) for c in out[0].outputs] == [expected[0]] * 2


def test_a_platform_delta_rule_kernel_through_the_door(family):
    """A platform's `gated_delta_rule` op (LayerKernels) reaches every DeltaNet layer, prefill chunks and
    decodes; where it returns NotImplemented the torch reference runs."""
    from tokenmill.core.layers.kernels import apply_layer_kernels
    path, expected = family
    llm = make_llm(path, **CHUNK)
    calls: list[bool] = []

    def kernel(q, k, v, g, beta, state, chunked):
        calls.append(chunked)
        return NotImplemented if len(calls) % 3 == 0 else gated_delta_rule_reference(q, k, v, g, beta, state, chunked)
    model = llm.engine.runner.model
    assert apply_layer_kernels(model, {"gated_delta_rule": kernel}) == len(model.recurrent_layers)
    assert tokens(generate(llm, PROMPTS)) == expected
    assert True in calls and False in calls


def test_refusals_and_the_eager_decode_path(tmp_path):
    save_random_checkpoint("qwen3_5_text", FAMILIES["qwen3_5_text"], str(tmp_path))
    with pytest.raises(ValueError, match="speculative decoding.*rolled back"):
        make_llm(tmp_path, speculative_config={"method": "ngram", "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        make_llm(tmp_path, tensor_parallel_size=2)
    # The cpu platform's native decode step declines the model (eager steps), with the reason.
    llm = make_llm(tmp_path, dtype="bfloat16", graph_capture="fused_decode")
    report = llm.engine.runner.fast_path_report()
    assert report["decode_program"] == "fused_decode" and not report["took_the_model"]
    assert "2 recurrent (gated_deltanet) layers" in report["eager_reason"]
    assert len(generate(llm, PROMPTS[:2])[1].outputs[0].token_ids) == 10


def test_server_greedy(tmp_path_factory):
    path = tmp_path_factory.mktemp("server")
    hf = save_moe_checkpoint("qwen3_next", FAMILIES["qwen3_next"], str(path))
    assert_server_greedy(path, PROMPTS[:2], hf_greedy(hf, PROMPTS[:2]))


def _inputs(n: int, hk: int = 2, hv: int = 4, d: int = 8, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(1, n, hk, d, generator=g) for _ in range(2))
    v = torch.randn(1, n, hv, d, generator=g)
    decay = -torch.rand(1, n, hv, generator=g)
    beta = torch.rand(1, n, hv, generator=g)
    return q, k, v, decay, beta


def test_delta_rule_forms_agree_and_continue_from_a_state():
    """The chunked form over 100 tokens == transformers' chunked form; over 37 + 63 tokens with the state
    handed over == the same; token by token (the decode form) == transformers' recurrent form."""
    from transformers.models.qwen3_next import modeling_qwen3_next as ref
    q, k, v, g, beta = _inputs(100)
    zero = torch.zeros(1, 4, 8, 8)
    whole, state = gated_delta_rule_reference(q, k, v, g, beta, zero, chunked=True)
    theirs, their_state = ref.torch_chunk_gated_delta_rule(q, k, v, g, beta, initial_state=None,
                                                           output_final_state=True, use_qk_l2norm_in_kernel=True)
    torch.testing.assert_close(whole, theirs)
    torch.testing.assert_close(state, their_state)
    first, mid = gated_delta_rule_reference(*(x[:, :37] for x in (q, k, v, g, beta)), zero, chunked=True)
    second, end = gated_delta_rule_reference(*(x[:, 37:] for x in (q, k, v, g, beta)), mid, chunked=True)
    torch.testing.assert_close(torch.cat((first, second), dim=1), whole, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(end, state, atol=1e-5, rtol=1e-4)
    steps, s = [], zero
    for i in range(100):
        o, s = gated_delta_rule_reference(*(x[:, i:i + 1] for x in (q, k, v, g, beta)), s, chunked=False)
        steps.append(o)
    torch.testing.assert_close(torch.cat(steps, dim=1), whole, atol=1e-5, rtol=1e-4)
    theirs, _ = ref.torch_recurrent_gated_delta_rule(q, k, v, g, beta, initial_state=None, output_final_state=True,
                                                     use_qk_l2norm_in_kernel=True)
    torch.testing.assert_close(torch.cat(steps, dim=1), theirs)


def test_state_slots_and_the_guard_against_a_foreign_state():
    slots = StateSlots(2)
    a, b = slots.take(), slots.take()
    assert (a, b) == (0, 1) and slots.num_free == 0
    with pytest.raises(RuntimeError, match="no free"):
        slots.take()
    slots.release(a)
    assert slots.take() == a
    spec = RecurrentStateSpec.conv_and_recurrent("gated_deltanet", 6, 4, torch.float32, (2, 3, 5))
    assert spec.nbytes == 6 * 3 * 4 + 2 * 3 * 5 * 4
    layout = StateLayout((spec, spec))
    assert layout.num_slots(10 * layout.bytes_per_seq, 256) == 5 and layout.num_slots(100, 8) == 0
    layers = [torch.nn.Module(), torch.nn.Module()]
    for layer in layers:
        layer.state_spec = spec
    cache = StateCache(layers, layout, 3, lambda shape, dtype: torch.zeros(shape, dtype=dtype))
    assert layers[0].state["ssm"].shape == (3, 2, 3, 5) and layers[1].state["conv"].shape == (3, 6, 3)
    cache.batch([0, 1], [0, 0], [5, 7], 0, torch.device("cpu"))
    cache.batch([0], [5], [1], 1, torch.device("cpu"))
    with pytest.raises(RuntimeError, match="holds 7 tokens.*position 3"):
        cache.batch([1], [3], [1], 1, torch.device("cpu"))       # e.g. a prefix-cache hit: not this state
    with pytest.raises(RuntimeError, match="without a recurrent-state slot"):
        cache.batch([-1], [0], [4], 0, torch.device("cpu"))
