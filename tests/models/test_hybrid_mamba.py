"""Mamba-2 families (core/models/mamba_hybrids.py: Mamba-2 alone, Bamba, Granite 4, Nemotron-H;
core/models/falcon_h1.py: Falcon-H1) on the
recurrent state cache: the SSD scan's chunked and recurrent forms against transformers' and each other
across a state handed over between chunks; each family on a random checkpoint transformers writes,
greedy tokens identical to transformers' float32 `generate` for mixed-length prompts split over
several prefill chunks (and several SSD chunks) and batched with decodes, and again from the
prefix cache (the Mamba-2 states checkpointed at block boundaries); preemption under a small
pool; a platform's scan kernel through the door; the server once."""
from __future__ import annotations

import pytest
import torch

from model_helpers import assert_greedy_twice, assert_server_greedy, generate, hf_greedy, make_llm, save_moe_checkpoint

from tokenmill.core.layers.mamba2 import ssd_scan_reference

VOCAB = 1000
IDS = dict(vocab_size=VOCAB, bos_token_id=1, eos_token_id=2, pad_token_id=0)
ATTN = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
            max_position_embeddings=256)
MAMBA = dict(mamba_n_heads=8, mamba_d_head=16, mamba_d_state=16, mamba_n_groups=2, mamba_d_conv=4, mamba_expand=2,
             mamba_chunk_size=8)
FAMILIES = {
    "mamba2": dict(IDS, hidden_size=64, num_hidden_layers=3, num_heads=8, head_dim=16, expand=2, state_size=16,
                   n_groups=2, chunk_size=8),
    "bamba": dict(IDS, **ATTN, **MAMBA, num_hidden_layers=4, attn_layer_indices=[2]),
    # Granite's multipliers, rope attention, experts and the shared MLP; and the dense form (no experts, NoPE).
    "granitemoehybrid": dict(IDS, **ATTN, **MAMBA, num_hidden_layers=4, layer_types=["mamba", "mamba", "attention",
                                                                                      "mamba"],
                             num_local_experts=4, num_experts_per_tok=2, shared_intermediate_size=64,
                             embedding_multiplier=2.0, attention_multiplier=0.2, residual_multiplier=0.5,
                             logits_scaling=2.0, position_embedding_type="rope"),
    "granitemoehybrid-dense": dict(IDS, **ATTN, **MAMBA, num_hidden_layers=3, layer_types=["mamba", "attention",
                                                                                            "mamba"],
                                   num_local_experts=0, shared_intermediate_size=96, residual_multiplier=0.5),
    "nemotron_h": dict(IDS, **ATTN, head_dim=16, hybrid_override_pattern="M*M-", mamba_num_heads=8,
                       mamba_head_dim=16, ssm_state_size=16, n_groups=2, conv_kernel=4, chunk_size=8,
                       mlp_hidden_act="relu2"),
    "falcon_h1": dict(IDS, **ATTN, num_hidden_layers=3, mamba_d_ssm=128, **{k: v for k, v in MAMBA.items()
                                                                          if k != "mamba_expand"},
                      mamba_rms_norm=True, mamba_norm_before_gate=True, key_multiplier=0.7, embedding_multiplier=1.5,
                      lm_head_multiplier=0.8, mlp_multipliers=[0.9, 1.1], attention_in_multiplier=1.2,
                      attention_out_multiplier=0.8, ssm_in_multiplier=1.3, ssm_out_multiplier=0.7,
                      ssm_multipliers=[1.1, 0.9, 1.2, 0.8, 1.05]),
}
# Mixed lengths over 16-token blocks and 16-token prefill chunks (the longest takes three).
PROMPTS = [[3 + (i * 37 + j * 11) % (VOCAB - 3) for j in range(n)] for i, n in enumerate((45, 11, 23, 33))]
CHUNK = dict(max_num_batched_tokens=16)


def _save(kind: str, path):
    return save_moe_checkpoint(kind.split("-")[0], FAMILIES[kind], str(path), router="router.weight")


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request, tmp_path_factory):
    """(checkpoint path, transformers' greedy tokens for PROMPTS) of one family."""
    path = tmp_path_factory.mktemp(request.param)
    return path, hf_greedy(_save(request.param, path), PROMPTS)


def tokens(outputs) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in outputs]


def test_family_matches_transformers_over_chunked_prompts(family):
    path, expected = family
    llm = make_llm(path, **CHUNK)
    # Twice: the second pass resumes the prompts from the state checkpoints of their cached blocks.
    assert_greedy_twice(llm, PROMPTS, expected)
    bm = llm.engine.scheduler.block_manager
    assert bm.enable_prefix_caching and bm.state_slots.num_free == bm.state_slots.num_slots


def test_preemption_under_a_small_pool_and_the_scan_kernel_door(tmp_path):
    """Nemotron-H (every mixer kind) recomputed after preemption gives the same tokens; a platform's
    `ssd_scan` op reaches every Mamba-2 layer, prefill chunks and decodes, NotImplemented falling back."""
    from tokenmill.core.layers.kernels import apply_layer_kernels
    expected = hf_greedy(_save("nemotron_h", tmp_path), PROMPTS)
    llm = make_llm(tmp_path, num_gpu_blocks_override=6, kv_cache_memory=None, **CHUNK)
    assert tokens(generate(llm, PROMPTS)) == expected
    assert llm.engine.scheduler.num_preemptions > 0
    calls: list[bool] = []

    def kernel(*args):
        calls.append(args[9])
        return NotImplemented if len(calls) % 3 == 0 else ssd_scan_reference(*args)
    model = llm.engine.runner.model
    assert apply_layer_kernels(model, {"ssd_scan": kernel}) == len(model.recurrent_layers) == 2
    assert tokens(generate(llm, PROMPTS)) == expected
    assert True in calls and False in calls


def test_refusals(tmp_path):
    _save("bamba", tmp_path)
    with pytest.raises(ValueError, match="speculative decoding.*rolled back"):
        make_llm(tmp_path, speculative_config={"method": "ngram", "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        make_llm(tmp_path, tensor_parallel_size=2)


def test_server_greedy(tmp_path_factory):
    path = tmp_path_factory.mktemp("server")
    hf = _save("granitemoehybrid", path)
    assert_server_greedy(path, PROMPTS[:2], hf_greedy(hf, PROMPTS[:2]))


def test_scan_forms_agree_and_continue_from_a_state():
    """The chunked form over 100 tokens == transformers' mamba2_chunk_scan; over 37 + 63 tokens with
    the state handed over == the same; token by token (the decode form) == the same."""
    from transformers.models.mamba2 import modeling_mamba2 as ref
    g = torch.Generator().manual_seed(0)
    x, dt = torch.randn(1, 100, 4, 8, generator=g), torch.randn(1, 100, 4, generator=g)
    B, C = torch.randn(1, 100, 2, 16, generator=g), torch.randn(1, 100, 2, 16, generator=g)
    A, D, dt_bias = -torch.rand(4, generator=g) - 0.5, torch.randn(4, generator=g), torch.randn(4, generator=g)
    limit, zero = (0.0, float("inf")), torch.zeros(1, 4, 8, 16)

    def scan(lo, hi, state, chunked):
        return ssd_scan_reference(x[:, lo:hi], dt[:, lo:hi], A, B[:, lo:hi], C[:, lo:hi], D, dt_bias, limit, state,
                                  chunked, 32)
    whole, state = scan(0, 100, zero, True)
    theirs, their_state = ref.mamba2_chunk_scan(x, dt, A, B, C, 32, D=D, dt_bias=dt_bias, dt_softplus=True,
                                                return_final_states=True)
    torch.testing.assert_close(whole, theirs)
    torch.testing.assert_close(state, their_state)
    first, mid = scan(0, 37, zero, True)
    second, end = scan(37, 100, mid, True)
    torch.testing.assert_close(torch.cat((first, second), dim=1), whole, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(end, state, atol=1e-4, rtol=1e-4)
    steps, s = [], zero
    for i in range(100):
        o, s = scan(i, i + 1, s, False)
        steps.append(o)
    torch.testing.assert_close(torch.cat(steps, dim=1), whole, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(s, state, atol=1e-4, rtol=1e-4)
