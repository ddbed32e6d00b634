"""Hybrid KV (core/kv_groups.py, core/block_manager.py): layers grouped by attention type, sliding
groups holding only their window. The grouping and its arithmetic (a 32k-token Gemma 3 request
holds about a fifth of the all-global KV), block accounting invariants through windows and prefix
hits, and end to end: the same memory gives a sliding-window model more blocks, a long request that
fits only because sliding layers are bounded, transformers' tokens with and without prefix hits."""
from __future__ import annotations

import logging
import random

import pytest

from model_helpers import generate, hf_greedy, make_llm, save_random_checkpoint

from tokenmill.core.block_manager import BlockManager
from tokenmill.core.kv_groups import NULL_BLOCK, kv_layout
from tokenmill.core.sampling_params import SamplingParams
from tokenmill.core.sequence import Sequence


def gemma3_windows(num_layers: int, window: int, pattern: int = 6) -> list:
    return [None if (i + 1) % pattern == 0 else window for i in range(num_layers)]


def test_layout_groups_by_type_in_groups_of_the_rarest_type():
    layout = kv_layout(gemma3_windows(62, 1024))            # Gemma 3 27B: 10 global layers, 52 sliding
    assert layout.group_size == 10
    assert [g.window for g in layout.groups] == [None] + [1024] * 6
    assert sorted(i for g in layout.groups for i in g.layers) == list(range(62))
    assert set(layout.tensor_of_layer().values()) == set(range(10))
    # A 32k-token request: about 1/5 of the KV it would hold with all 62 layers global.
    assert 0.15 < layout.kv_fraction(32768, 16) < 0.22
    assert not kv_layout([None] * 8).hybrid and not kv_layout([4096] * 8).hybrid
    assert not kv_layout(gemma3_windows(12, 512), hybrid=False).hybrid


def make_seq(tokens: list[int], seq_id: int = 0) -> Sequence:
    return Sequence(seq_id, "r", tokens, SamplingParams(max_tokens=64), 0.0)


def run_to(bm: BlockManager, seq: Sequence, total: int, chunk: int = 8) -> None:
    while seq.num_computed_tokens < total:
        n = min(chunk, total - seq.num_computed_tokens)
        bm.allocate(seq, n)
        seq.num_computed_tokens += n
        bm.cache_full_blocks(seq)


def test_sliding_groups_keep_only_the_window():
    layout = kv_layout([8, None, 8, 8])                     # window 8: one full group, three sliding
    bm = BlockManager(64, 4, layout=layout)
    assert bm.num_blocks == 63                              # the null block is no one's
    seq = make_seq(list(range(100)))
    bm.match_prefix(seq)
    run_to(bm, seq, 100)
    full, *sliding = bm.tables(seq)
    assert len(full) == 25 and NULL_BLOCK not in full
    for table in sliding:
        assert len(table) == 25
        held = [b for b in table if b != NULL_BLOCK]
        assert len(held) <= 8 // 4 + 2                     # the window's blocks and the one being written
        assert table[:20] == [NULL_BLOCK] * 20
    assert bm.num_used_blocks == 25 + sum(len([b for b in t if b]) for t in sliding)
    assert bm.num_used_blocks <= bm.blocks_for_tokens(100, chunk=8)
    bm.check_invariants([seq])
    bm.free(seq)
    bm.check_invariants([])
    assert bm.num_free_blocks == 63


def test_prefix_hit_needs_only_the_window_in_sliding_groups():
    bm = BlockManager(64, 4, layout=kv_layout([8, None]))
    a = make_seq(list(range(40)))
    bm.match_prefix(a)
    run_to(bm, a, 40)
    b = make_seq(list(range(36)) + [99, 98])
    bm.match_prefix(b)
    assert b.num_computed_tokens == 36
    full, sliding = bm.tables(b)
    assert full == a.block_table[:9]
    start = (36 - 8 + 1) // 4
    assert sliding[:start] == [NULL_BLOCK] * start and NULL_BLOCK not in sliding[start:]
    bm.check_invariants([a, b])
    # Once the cached window blocks of the sliding group are evicted, the hit shrinks to what both groups serve.
    bm.free(a)
    bm.free(b)
    for h in bm.full_block_hashes(a)[6:9]:                 # the sliding group's blocks just before token 36
        bm._evict(bm.hash_to_block[bm._key(1, h)])
    c = make_seq(list(range(36)) + [7])
    bm.match_prefix(c)
    assert c.num_computed_tokens < 36
    bm.check_invariants([c])


@pytest.mark.parametrize("seed", range(4))
def test_random_schedules_keep_the_invariants(seed):
    rng = random.Random(seed)
    bm = BlockManager(48, 4, layout=kv_layout([6, None, 6, 6, None, 6]))
    live: list[Sequence] = []
    prefixes = [list(range(rng.randrange(4, 30))) for _ in range(3)]
    for step in range(200):
        if live and rng.random() < 0.2:
            bm.free(live.pop(rng.randrange(len(live))))
        elif rng.random() < 0.3:
            seq = make_seq(rng.choice(prefixes) + [rng.randrange(1000) for _ in range(rng.randrange(1, 12))], step)
            bm.match_prefix(seq)
            if bm.can_allocate(seq, seq.num_uncomputed_tokens):
                bm.allocate(seq, seq.num_uncomputed_tokens)
                seq.num_computed_tokens = seq.num_tokens
                bm.cache_full_blocks(seq)
                live.append(seq)
            else:
                bm.free(seq)
        for seq in live:
            if bm.can_allocate(seq, 1):
                seq.token_ids.append(rng.randrange(1000))
                bm.allocate(seq, 1)
                seq.num_computed_tokens += 1
                bm.cache_full_blocks(seq)
            if rng.random() < 0.05:               # a speculative rollback of up to 3 tokens
                bm.truncate(seq, max(1, seq.num_computed_tokens - rng.randrange(4)))
        bm.check_invariants(live)


# Gemma 3's shape at toy size: five sliding layers to each global one, a window of 8.
GEMMA3 = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2,
              head_dim=16, query_pre_attn_scalar=16, sliding_window=8, max_position_embeddings=512,
              vocab_size=1000, bos_token_id=1, eos_token_id=2, pad_token_id=0)
BLOCK_BYTES = 16 * 2 * 2 * 16 * 4           # a 16-token block of one float32 layer: K and V, 2 heads of 16


def test_same_memory_more_blocks_and_a_request_only_hybrid_holds(tmp_path, caplog):
    hf = save_random_checkpoint("gemma3_text", GEMMA3, str(tmp_path))
    prompt = [3 + (j * 13) % 990 for j in range(200)]
    expected = hf_greedy(hf, [prompt], max_tokens=6)
    memory = 40 * BLOCK_BYTES
    with caplog.at_level(logging.INFO, logger="tokenmill.model_runner"):
        llm = make_llm(tmp_path, kv_cache_memory=memory, max_model_len=512)
    assert llm.engine.num_kv_blocks == 40                   # a block is one layer's: 40 of them
    assert any("hybrid KV: 1 full-attention and 5 sliding-window" in r.message for r in caplog.records)
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    out = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
    assert list(out[0].outputs[0].token_ids) == expected[0]
    again = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)     # from the prefix cache
    assert list(again[0].outputs[0].token_ids) == expected[0] and again[0].num_cached_tokens >= 160
    llm.engine.scheduler.block_manager.check_invariants([])
    del llm

    every = make_llm(tmp_path, kv_cache_memory=memory, max_model_len=512, disable_hybrid_kv_cache_manager=True)
    assert every.engine.num_kv_blocks == 40 // 6            # a block holds all six layers
    with pytest.raises(ValueError, match="KV blocks but the pool has only 6"):
        every.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)


def test_mixed_batches_with_speculation_match_transformers(tmp_path):
    hf = save_random_checkpoint("gemma3_text", GEMMA3, str(tmp_path))
    prompts = [[3 + (i * 31 + j * 7) % 990 for j in range(n)] for i, n in enumerate((70, 9, 41))]
    expected = hf_greedy(hf, prompts, max_tokens=12)
    llm = make_llm(tmp_path, speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                                 "prompt_lookup_max": 3, "prompt_lookup_min": 1})
    assert [list(o.outputs[0].token_ids) for o in generate(llm, prompts, max_tokens=12)] == expected
