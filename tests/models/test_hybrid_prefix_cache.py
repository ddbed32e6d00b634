"""Prefix caching on a hybrid Gated DeltaNet model (Qwen3.5) through recurrent-state checkpoints at
block boundaries (core/state_cache.py StateCheckpoints): a second request sharing a 512-token prefix
computes only its own tokens (usage, RequestOutput.num_cached_tokens, the prefix-cache metrics) and
gives transformers' float32 greedy tokens, as without the cache; a prefix shared up to a block
without a checkpoint resumes from the last one that has it; eviction under a small pool, preemption
and n > 1 keep the tokens; the checkpoint bookkeeping itself."""
from __future__ import annotations

import logging

import pytest
import torch

from model_helpers import generate, hf_greedy, make_llm, save_random_checkpoint

from tokenmill.core.block_manager import BlockManager
from tokenmill.core.sampling_params import SamplingParams
from tokenmill.core.sequence import Sequence
from tokenmill.core.state_cache import RecurrentStateSpec, StateCache, StateCheckpoints, StateLayout

VOCAB = 1000
CONFIG = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
              head_dim=16, max_position_embeddings=1024, vocab_size=VOCAB, bos_token_id=1, eos_token_id=2,
              pad_token_id=0, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
              linear_value_head_dim=16, linear_conv_kernel_dim=4,
              layer_types=["linear_attention", "full_attention"] * 2)


def _tokens(seed: int, n: int) -> list[int]:
    return [3 + (seed * 131 + j * 17 + j * j * seed) % (VOCAB - 3) for j in range(n)]


PREFIX = _tokens(1, 512)
A = PREFIX + _tokens(2, 20)           # 532 tokens: checkpoints at 256, 512 (chunk ends) and 528 (last full block)
B = PREFIX + _tokens(3, 30)           # shares A's 512-token prefix
C = PREFIX[:300] + _tokens(4, 40)     # shares 300 tokens: resumes from the checkpoint at 256
E = PREFIX + _tokens(5, 60)
MAX_TOKENS = 24
CHUNK = dict(max_num_batched_tokens=256)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen3_5_prefix")
    hf = save_random_checkpoint("qwen3_5_text", CONFIG, str(path))
    prompts = [A, B, C, E]
    return path, dict(zip(map(tuple, prompts), hf_greedy(hf, prompts, MAX_TOKENS)))


def run(llm, prompts):
    return [list(o.outputs[0].token_ids) for o in generate(llm, prompts, MAX_TOKENS)]


def test_a_shared_prefix_skips_its_prefill(model, caplog):
    path, expected = model
    with caplog.at_level(logging.INFO):
        llm = make_llm(path, **CHUNK)
    runner, scheduler = llm.engine.runner, llm.engine.scheduler
    # Checkpoints from the same budget, at most a quarter of it, stated in the start-up log.
    checkpoints = runner.num_state_checkpoints
    assert checkpoints > 0 and scheduler.block_manager.checkpoints.count == checkpoints
    assert checkpoints * runner.state_layout.bytes_per_seq <= (16 << 20) // 4
    assert f"{checkpoints} prefix-cache state checkpoints" in caplog.text
    assert run(llm, [A]) == [expected[tuple(A)]]
    computed = scheduler.num_prompt_tokens
    out = generate(llm, [B], MAX_TOKENS)[0]
    assert list(out.outputs[0].token_ids) == expected[tuple(B)]
    assert out.num_cached_tokens == 512 and scheduler.num_prompt_tokens - computed == len(B) - 512
    stats = llm.engine.stats()
    assert stats.prefix_cache_hits == 512 and stats.prefix_cache_queries >= len(A) + len(B)
    # Cached blocks up to 512, but the last checkpoint inside C's 300 shared tokens is at 256.
    out = generate(llm, [C], MAX_TOKENS)[0]
    assert list(out.outputs[0].token_ids) == expected[tuple(C)] and out.num_cached_tokens == 256
    scheduler.block_manager.check_invariants([])
    # The same tokens without the cache.
    plain = make_llm(path, enable_prefix_caching=False, **CHUNK)
    assert run(plain, [B, C]) == [expected[tuple(B)], expected[tuple(C)]]


def test_eviction_and_preemption_under_a_small_pool_keep_the_tokens(model):
    """40 blocks (640 tokens): A, B, C, E together preempt one another and evict each other's
    cached blocks (and their checkpoints); every one still gives transformers' tokens."""
    path, expected = model
    llm = make_llm(path, num_gpu_blocks_override=40, kv_cache_memory=None, max_num_seqs=4, **CHUNK)
    scheduler = llm.engine.scheduler
    schedule = scheduler.schedule

    def watched():
        batch = schedule()
        scheduler.block_manager.check_invariants(scheduler.running)
        return batch
    scheduler.schedule = watched
    prompts = [A, B, C, E]
    assert run(llm, prompts) == [expected[tuple(p)] for p in prompts]
    assert scheduler.num_preemptions > 0
    assert run(llm, [E, C]) == [expected[tuple(E)], expected[tuple(C)]]
    bm = scheduler.block_manager
    assert bm.state_slots.num_free == bm.state_slots.num_slots
    assert len(bm.checkpoints.owner) == sum(b.checkpoint >= 0 for b in bm.blocks)


def test_n_children_share_the_prompt_state(model):
    path, expected = model
    llm = make_llm(path, **CHUNK)
    params = SamplingParams(n=2, temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    out = llm.generate([{"prompt_token_ids": B}], params, use_tqdm=False)[0]
    assert [list(c.token_ids) for c in out.outputs] == [expected[tuple(B)]] * 2
    # The second child resumed from the checkpoint after the prompt's last full block (528 tokens).
    assert llm.engine.stats().prompt_tokens == len(B) + (len(B) - 528)


def test_checkpoints_are_evicted_with_their_blocks_and_restored_by_copy():
    spec = RecurrentStateSpec.conv_and_recurrent("gated_deltanet", 3, 2, torch.float32, (2, 2))
    layers = [torch.nn.Module()]
    layers[0].state_spec = spec
    cache = StateCache(layers, StateLayout((spec,)), 3, lambda shape, dtype: torch.zeros(shape, dtype=dtype))
    cache.batch([0], [0], [16], 0, torch.device("cpu"), saves=[2])
    layers[0].state["ssm"][0].fill_(7.0)          # the step's forward
    cache.batch([1], [16], [4], 0, torch.device("cpu"), restores=[2])   # save copied first, then restored
    assert cache.held[1] == 20 and layers[0].state["ssm"][1].eq(7.0).all()

    bm = BlockManager(4, 4, state_slots=1, state_checkpoints=1)
    seq = Sequence("a", 0, list(range(10, 19)), SamplingParams(max_tokens=1), 0.0)
    bm.allocate(seq, 8)
    bm.plan_state_save(seq, 8)
    assert seq.state_save == (1, 1)
    seq.num_computed_tokens = 8
    bm.cache_full_blocks(seq)
    bm.commit_state_save(seq)
    owner = bm.hash_to_block[seq.block_hashes[1]]
    assert bm.blocks[owner].checkpoint == 1 and bm.checkpoints.owner[1] == owner
    bm.free(seq)
    again = Sequence("b", 0, list(range(10, 19)) + [5], SamplingParams(max_tokens=1), 0.0)
    bm.match_prefix(again)
    assert again.num_cached_tokens == 8 and again.state_restore == 1
    bm.free(again)
    other = Sequence("c", 0, list(range(50, 66)), SamplingParams(max_tokens=1), 0.0)
    bm.allocate(other, 16)                         # takes every block: the cached ones are evicted
    assert bm.checkpoints.free == [1] and not bm.checkpoints.owner
    bm.check_invariants([other])
    pool = StateCheckpoints(5, 2)
    first, _ = pool.reserve()
    second, _ = pool.reserve()
    pool.commit(first, 10)
    pool.commit(second, 11)
    assert pool.reserve() == (first, 10)           # full: the least recently used checkpoint goes
