"""Block-manager and scheduler invariants under random schedules, aborts at every stage included."""
from __future__ import annotations

from hypothesis import given, settings, strategies as st

from tokenmill.core.block_manager import BlockManager
from tokenmill.core.config import SchedulerConfig
from tokenmill.core.step import StepOutput
from tokenmill.core.sampling.sampler import SamplerOutput
from tokenmill.core.sampling_params import SamplingParams
from tokenmill.core.scheduler import Scheduler
from tokenmill.core.sequence import Sequence, SequenceStatus


def make_seq(tokens, rid="r", arrival=0.0, priority=0, max_tokens=1000):
    return Sequence(rid, 0, tokens, SamplingParams(max_tokens=max_tokens), arrival, priority)


def fake_forward(batch):
    """What the model runner reports for a batch: every caught-up sequence gets a token (5)."""
    sampled = [i for i, (seq, n) in enumerate(batch.entries) if seq.num_computed_tokens + n == seq.num_tokens]
    return (StepOutput(logits=None, sampled=sampled),
            SamplerOutput(token_ids=[5] * len(sampled), sampled_logprobs=[None] * len(sampled),
                          top_logprobs=[None] * len(sampled)))


def test_prefix_cache_hit_shares_blocks_and_counts_tokens():
    bm = BlockManager(num_blocks=16, block_size=4)
    a = make_seq(list(range(10)))
    bm.match_prefix(a)
    bm.allocate(a, a.num_uncomputed_tokens)
    a.num_computed_tokens = 10
    bm.cache_full_blocks(a)
    b = make_seq(list(range(8)) + [99, 98, 97])
    bm.match_prefix(b)
    assert b.num_computed_tokens == 8 and b.block_table == a.block_table[:2]
    assert bm.blocks[a.block_table[0]].ref_count == 2
    assert bm.prefix_cache_hits == 8
    bm.allocate(b, b.num_uncomputed_tokens)
    bm.check_invariants([a, b])
    bm.free(a)
    bm.free(b)
    bm.check_invariants([])
    assert bm.num_free_blocks == 16


def test_full_prompt_hit_leaves_one_token_to_compute():
    bm = BlockManager(num_blocks=8, block_size=4)
    a = make_seq(list(range(8)))
    bm.match_prefix(a)
    bm.allocate(a, 8)
    a.num_computed_tokens = 8
    bm.cache_full_blocks(a)
    bm.free(a)
    b = make_seq(list(range(8)))
    bm.match_prefix(b)
    assert b.num_computed_tokens == 4   # the last block is recomputed so the step has logits


def _compute_all(bm, seq):
    bm.match_prefix(seq)
    bm.allocate(seq, seq.num_uncomputed_tokens)
    seq.num_computed_tokens = seq.num_tokens
    bm.cache_full_blocks(seq)


def test_evicts_least_recently_freed_first():
    bm = BlockManager(num_blocks=4, block_size=2)
    a, b = make_seq([0, 1, 2, 3]), make_seq([10, 11, 12, 13])
    _compute_all(bm, a)
    _compute_all(bm, b)
    bm.free(a)          # a released first: its blocks are the oldest cached ones
    bm.free(b)
    c = make_seq([50])
    _compute_all(bm, c)  # needs one block: takes a's tail block
    a2, b2 = make_seq([0, 1, 2, 3, 4]), make_seq([10, 11, 12, 13, 14])
    bm.match_prefix(a2)
    bm.match_prefix(b2)
    assert a2.num_computed_tokens == 2   # a's head block survived, its tail was evicted
    assert b2.num_computed_tokens == 4   # b, released later, is fully cached
    bm.check_invariants([c, a2, b2])


def test_disabled_prefix_caching_never_hits():
    bm = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=False)
    a = make_seq(list(range(9)))
    bm.match_prefix(a)
    bm.allocate(a, 9)
    a.num_computed_tokens = 9
    bm.cache_full_blocks(a)
    b = make_seq(list(range(9)))
    bm.match_prefix(b)
    assert b.num_computed_tokens == 0 and bm.prefix_cache_hits == 0


def _simulate(ops, num_blocks, block_size, budget, policy, prefix):
    bm = BlockManager(num_blocks, block_size, enable_prefix_caching=prefix)
    sched = Scheduler(SchedulerConfig(max_num_seqs=6, max_num_batched_tokens=budget, policy=policy,
                                      long_prefill_token_threshold=0), bm, max_model_len=10_000)
    live: dict[str, Sequence] = {}
    targets: dict[str, int] = {}
    counter = 0
    for op in ops:
        kind = op[0]
        if kind == "add":
            _, prompt_len, out_len, prio, shared = op
            rid = f"r{counter}"
            counter += 1
            prompt = ([7] * shared + list(range(1000 + counter * 50, 1000 + counter * 50 + prompt_len)))
            prompt = prompt[:max(1, prompt_len)]
            if -(-(len(prompt) + out_len) // block_size) > num_blocks:
                continue
            seq = make_seq(prompt, rid, arrival=float(counter), priority=prio, max_tokens=out_len)
            live[rid] = seq
            targets[rid] = out_len
            sched.add(seq)
        elif kind == "abort" and live:
            rid = sorted(live)[op[1] % len(live)]
            sched.finish(live.pop(rid))
        else:  # step
            batch = sched.schedule()
            seen = set()
            for seq, n in batch.entries:
                assert seq.seq_id not in seen
                seen.add(seq.seq_id)
                assert n >= 1 and seq.status == SequenceStatus.RUNNING
                assert seq.num_computed_tokens + n <= len(seq.block_table) * block_size
            assert batch.num_tokens <= budget
            assert all(n == 1 for _, n in batch.entries[:batch.num_decodes])
            result, sampled = fake_forward(batch)
            for update in sched.update_from_output(batch, result, sampled):
                assert update.delta.token_ids == [5]
                seq = update.seq
                if seq.num_output_tokens >= targets[seq.request_id]:
                    # update_from_output finished it (max_tokens) and gave its blocks back.
                    assert update.delta.finish_reason == "length" and seq.is_finished and not seq.block_table
                    live.pop(seq.request_id)
                else:
                    assert update.delta.finish_reason is None and not seq.is_finished
        bm.check_invariants(sched.running + sched.waiting)
        assert not (set(map(id, sched.running)) & set(map(id, sched.waiting)))
    for seq in list(live.values()):
        sched.finish(seq)
    bm.check_invariants([])
    assert bm.num_free_blocks == num_blocks
    return sched


op_strategy = st.one_of(
    st.tuples(st.just("add"), st.integers(1, 40), st.integers(1, 12), st.integers(0, 2), st.integers(0, 20)),
    st.tuples(st.just("abort"), st.integers(0, 10)),
    st.tuples(st.just("step")),
)


@settings(max_examples=150, deadline=None)
@given(ops=st.lists(op_strategy, max_size=80), num_blocks=st.integers(4, 24), block_size=st.sampled_from([2, 4, 16]),
       budget=st.integers(1, 64), policy=st.sampled_from(["fcfs", "priority"]), prefix=st.booleans())
def test_invariants_hold_under_random_schedules(ops, num_blocks, block_size, budget, policy, prefix):
    _simulate(ops, num_blocks, block_size, budget, policy, prefix)


def test_small_pool_forces_preemption_and_everything_finishes():
    ops = [("add", 12, 14, 0, 0) for _ in range(5)] + [("step",)] * 400
    sched = _simulate(ops, num_blocks=8, block_size=4, budget=32, policy="fcfs", prefix=True)
    assert sched.num_preemptions > 0
    assert not sched.running and not sched.waiting


def test_reset_prefix_cache_forgets_and_hands_out_neighbouring_blocks():
    """After runs that interleaved their sequences' blocks, a reset forgets every cached block no
    sequence holds and the next sequence gets ascending, neighbouring blocks (as in a new pool);
    a block still held stays out of the free list and keeps its hash."""
    bm = BlockManager(num_blocks=32, block_size=4)
    seqs = [make_seq(list(range(100 * i, 100 * i + 4)), rid=str(i)) for i in range(4)]
    for _ in range(3):                          # decode-like growth: blocks interleave across sequences
        for seq in seqs:
            bm.allocate(seq, 4)
            seq.num_computed_tokens += 4
            seq.token_ids.extend([7] * 4)
    held = seqs[0]
    for seq in seqs[1:]:
        bm.cache_full_blocks(seq)
        bm.free(seq)
    bm.reset_prefix_cache()
    assert all(bm.blocks[b].hash is None for b in bm.free_blocks)
    assert list(bm.free_blocks) == sorted(bm.free_blocks)
    assert not set(held.block_table) & set(bm.free_blocks) and all(bm.blocks[b].ref_count for b in held.block_table)
    fresh = make_seq(list(range(1000, 1016)), rid="fresh")
    bm.allocate(fresh, 16)
    assert fresh.block_table == [b for b in range(32) if b not in held.block_table][:4]
    bm.check_invariants([held, fresh])
