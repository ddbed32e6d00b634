"""Paged KV-cache bookkeeping: a pool of fixed-size blocks, per-sequence block tables,
reference counts, and prefix caching by a chained hash of each full block.

With a hybrid layout (core/kv_groups.py) each sequence has one table per layer group
(`seq.block_table` the first, `seq.group_tables` the others); a sliding group's table releases the
blocks every later token's window has left (NULL_BLOCK in their place), and each group caches its
blocks under its own hashes. Without one, one table and nothing else changes.

Freed blocks keep their hash and stay findable until the pool needs them back; the free list
is ordered by release time, so reuse evicts the least recently used cached block first. A block
released with nothing cached in it (a partial last block, any block once the cache is reset or
off) goes to the front instead: it is taken before blocks never used, whose memory the device
has not touched yet (a CPU pool's pages fault in on first write, a cost every run would pay again
if it took fresh blocks), and before cached ones.

A model with recurrent layers (core/state_cache.py) also holds one state slot per sequence: taken
with its first blocks, released with its blocks (finish, abort, preemption), and a sequence is not
admitted while no slot is free. With prefix caching, a cached block may also own a state checkpoint
(the recurrent state after it, see core/state_cache.py StateCheckpoints): a hit is cut back to the
longest prefix whose last block has one (its state is restored, the rest computed), and the
checkpoint is released when its block is evicted.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Optional

from .kv_groups import NULL_BLOCK, KVLayout
from .sequence import Sequence
from .state_cache import StateCheckpoints, StateSlots


def chain_hash(parent: Optional[int], token_ids: tuple[int, ...]) -> int:
    return hash((parent, token_ids))


class Block:
    __slots__ = ("block_id", "ref_count", "hash", "token_ids", "checkpoint")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_count = 0
        self.hash: Optional[int] = None
        self.token_ids: Optional[tuple[int, ...]] = None  # kept to rule out hash collisions
        self.checkpoint = -1      # the state slot holding the recurrent state after this block, -1: none


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 layout: Optional[KVLayout] = None, window_margin: int = 0, state_slots: int = 0,
                 state_checkpoints: int = 0) -> None:
        """`layout`: the model's KV groups (one group when None or not hybrid). `window_margin`:
        tokens kept beyond a window, for positions a speculative rollback may recompute.
        `state_slots`: the recurrent-state slots of a hybrid model (0: it has no recurrent layers);
        `state_checkpoints`: the state slots after them that hold cached prefixes' states."""
        self.layout = layout if layout is not None and layout.hybrid else None
        self.windows = [g.window for g in self.layout.groups] if self.layout else [None]
        reserved = 1 if self.layout else 0          # the null block
        if num_blocks - reserved <= 0:
            raise ValueError(f"the KV pool needs at least one block, got {num_blocks - reserved}")
        self.num_blocks = num_blocks - reserved     # the blocks sequences can hold
        self.block_size = block_size
        self.window_margin = window_margin
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_blocks: OrderedDict[int, None] = OrderedDict((i, None) for i in range(reserved, num_blocks))
        self.hash_to_block: dict[int, int] = {}
        # Counters, in tokens, mirroring vLLM's prefix_cache_queries/hits.
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0
        self.state_slots = StateSlots(state_slots) if state_slots else None
        self.checkpoints = (StateCheckpoints(state_slots, state_checkpoints)
                            if state_slots and state_checkpoints and enable_prefix_caching else None)

    # ------------------------------------------------------------------ accounting
    @property
    def num_free_blocks(self) -> int:
        return len(self.free_blocks)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self.free_blocks)

    @property
    def usage(self) -> float:
        return self.num_used_blocks / self.num_blocks

    def blocks_for_tokens(self, num_tokens: int, chunk: int = 0) -> int:
        """The most blocks one sequence of `num_tokens` holds (its prefill chunks at most `chunk`)."""
        if self.layout is None:
            return -(-num_tokens // self.block_size)
        return self.layout.blocks_for(num_tokens + self.window_margin, self.block_size, chunk)

    def tables(self, seq: Sequence) -> list[list[int]]:
        """seq's block table per group."""
        if len(seq.group_tables) < len(self.windows) - 1:
            seq.group_tables = [[] for _ in range(len(self.windows) - 1)]
            seq.window_trimmed = [0] * len(self.windows)
        return [seq.block_table, *seq.group_tables]

    def blocks_needed(self, seq: Sequence, num_new_tokens: int) -> int:
        total = -(-(seq.num_computed_tokens + num_new_tokens) // self.block_size)
        return sum(max(0, total - len(table)) for table in self.tables(seq))

    def can_allocate(self, seq: Sequence, num_new_tokens: int) -> bool:
        if self.state_slots is not None and seq.state_slot < 0 and not self.state_slots.num_free:
            return False          # no recurrent-state slot for a sequence that has none yet
        return self.blocks_needed(seq, num_new_tokens) <= len(self.free_blocks)

    # ------------------------------------------------------------------ prefix cache
    def _key(self, group: int, h: int) -> int:
        return h if group == 0 else hash(("kv group", group, h))

    def _cached(self, group: int, h: int, tokens: tuple[int, ...]) -> Optional[int]:
        block_id = self.hash_to_block.get(self._key(group, h))
        return block_id if block_id is not None and self.blocks[block_id].token_ids == tokens else None

    def _window_start(self, group: int, num_tokens: int, margin: int = 0) -> int:
        """First block the next token after `num_tokens` may read in `group` (0 without a window)."""
        window = self.windows[group]
        if self.layout is None or window is None:
            return 0
        return max(0, num_tokens - window + 1 - margin) // self.block_size

    def match_prefix(self, seq: Sequence) -> None:
        """At a sequence's first scheduling: adopt the cached blocks of its longest cached prefix
        (in every group: a sliding group needs only the blocks of the window before it).

        Leaves at least one token uncomputed, so the step that finishes the prompt has logits.
        """
        assert not seq.block_table and seq.num_computed_tokens == 0
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        max_blocks = (seq.num_tokens - 1) // bs
        self.prefix_cache_queries += seq.num_tokens
        hashes = self.full_block_hashes(seq)
        tokens = [tuple(seq.token_ids[i * bs:(i + 1) * bs]) for i in range(max_blocks)]
        groups = range(len(self.windows))
        found: list[list[Optional[int]]] = [[] for _ in groups]
        for g in groups:          # each group's cached blocks from the start, up to its first miss
            for i in range(max_blocks):
                block_id = self._cached(g, hashes[i], tokens[i])
                if block_id is None:
                    break
                found[g].append(block_id)
        # The longest prefix every group can serve: all blocks in full groups, the window's in sliding ones.
        matched = min((len(found[g]) for g in groups if self.windows[g] is None or self.layout is None),
                      default=max_blocks)
        while matched > 0 and not (all(self._serves(g, found[g], hashes, tokens, matched) for g in groups)
                                   and self._resumable(found[0], matched)):
            matched -= 1
        if matched and self.checkpoints is not None:     # its recurrent state starts from the checkpoint
            seq.state_restore = self.blocks[found[0][matched - 1]].checkpoint
            self.checkpoints.touch(seq.state_restore)
        tables = self.tables(seq)
        for g in groups:
            start = self._window_start(g, matched * bs)
            for i in range(matched):
                if i < start:
                    tables[g].append(NULL_BLOCK)
                    continue
                block_id = found[g][i] if i < len(found[g]) else self._cached(g, hashes[i], tokens[i])
                self._take(block_id)
                tables[g].append(block_id)
            if self.layout is not None:
                seq.window_trimmed[g] = start
        seq.block_hashes.extend(hashes[:matched])
        cached = matched * bs
        seq.num_computed_tokens = cached
        seq.num_cached_tokens = cached
        self.prefix_cache_hits += cached

    def _resumable(self, found: list[int], matched: int) -> bool:
        """A hit may end after `matched` blocks: no recurrent layers, or the state there is checkpointed."""
        return self.state_slots is None or self.blocks[found[matched - 1]].checkpoint >= 0

    def chunk_for_checkpoints(self, seq: Sequence, num_new: int) -> int:
        """With state checkpoints: a prefill chunk ends on a block boundary when it can (a chunk shorter
        than a block stays as it is), and the one that would finish the prompt stops at its last full
        block, the last boundary a later prompt can resume from (the tokens after it run next step)."""
        start, prompt, bs = seq.num_computed_tokens, seq.num_prompt_tokens, self.block_size
        if self.checkpoints is None or start >= prompt or seq.spec_token_ids:
            return num_new
        last_full, end = (prompt - 1) // bs * bs, start + num_new
        if end >= prompt:
            return last_full - start if start < last_full else num_new
        aligned = end // bs * bs
        return aligned - start if aligned > start else num_new

    def plan_state_save(self, seq: Sequence, num_new: int) -> None:
        """seq's next `num_new` tokens end on a block boundary of its prompt that a later prompt may
        resume from: reserve a checkpoint for the state there (copied after the step, kept by
        `commit_state_save` once the block is cached)."""
        end, bs = seq.num_computed_tokens + num_new, self.block_size
        if self.checkpoints is None or end % bs or not 0 < end <= (seq.num_prompt_tokens - 1) // bs * bs:
            return
        i = end // bs - 1
        cached = self._cached(0, self.full_block_hashes(seq)[i], tuple(seq.token_ids[i * bs:end]))
        if cached is not None and self.blocks[cached].checkpoint >= 0:
            return            # the same prefix's state is already kept
        slot, evicted = self.checkpoints.reserve()
        if evicted is not None:
            self.blocks[evicted].checkpoint = -1
        if slot >= 0:
            seq.state_save = (slot, i)

    def commit_state_save(self, seq: Sequence) -> None:
        """After the step that saved seq's state: the checkpoint goes to the cached block it follows
        (seq's own, or the one another sequence registered first), or back when that has one."""
        if seq.state_save is None:
            return
        (slot, i), seq.state_save = seq.state_save, None
        bs = self.block_size
        block_id = (self._cached(0, seq.block_hashes[i], tuple(seq.token_ids[i * bs:(i + 1) * bs]))
                    if i < len(seq.block_hashes) else None)
        if block_id is None or self.blocks[block_id].checkpoint >= 0:
            self.checkpoints.release(slot)
        else:
            self.blocks[block_id].checkpoint = slot
            self.checkpoints.commit(slot, block_id)

    def _serves(self, group: int, found: list[int], hashes: list[int], tokens: list[tuple[int, ...]],
                matched: int) -> bool:
        if self.layout is None or self.windows[group] is None:
            return len(found) >= matched
        start = self._window_start(group, matched * self.block_size)
        return all(i < len(found) or self._cached(group, hashes[i], tokens[i]) is not None
                   for i in range(start, matched))

    def full_block_hashes(self, seq: Sequence) -> list[int]:
        """Chained hashes of every full block of seq's tokens (memoized while the tokens grow)."""
        memo = getattr(seq, "_full_block_hashes", None)
        if memo is None:
            memo = seq._full_block_hashes = []
        num_full = seq.num_tokens // self.block_size
        for i in range(len(memo), num_full):
            tokens = tuple(seq.token_ids[i * self.block_size:(i + 1) * self.block_size])
            memo.append(chain_hash(memo[-1] if memo else seq.cache_salt, tokens))
        return memo

    def cache_full_blocks(self, seq: Sequence) -> None:
        """After seq's tokens were computed: register every newly filled block, and release the
        blocks that every later token's window has left."""
        if self.enable_prefix_caching:
            tables = self.tables(seq)
            num_full = seq.num_computed_tokens // self.block_size
            for i in range(len(seq.block_hashes), num_full):
                parent = seq.block_hashes[-1] if seq.block_hashes else seq.cache_salt   # an adapter's KV is its own
                tokens = tuple(seq.token_ids[i * self.block_size:(i + 1) * self.block_size])
                h = chain_hash(parent, tokens)
                seq.block_hashes.append(h)
                for g, table in enumerate(tables):
                    block = self.blocks[table[i]]
                    key = self._key(g, h)
                    if self._real(table[i]) and block.hash is None and key not in self.hash_to_block:
                        block.hash = key
                        block.token_ids = tokens
                        self.hash_to_block[key] = block.block_id
        if self.layout is not None:
            self._trim_windows(seq)

    def _trim_windows(self, seq: Sequence) -> None:
        tables = self.tables(seq)
        for g, table in enumerate(tables):
            start = min(len(table), self._window_start(g, seq.num_computed_tokens, self.window_margin))
            for i in range(seq.window_trimmed[g], start):
                if self._real(table[i]):
                    self._drop(table[i])
                    table[i] = NULL_BLOCK
            seq.window_trimmed[g] = max(seq.window_trimmed[g], start)

    # ------------------------------------------------------------------ allocation
    def allocate(self, seq: Sequence, num_new_tokens: int) -> None:
        """Make room in seq's block tables for its next `num_new_tokens` tokens."""
        needed = self.blocks_needed(seq, num_new_tokens)
        if needed > len(self.free_blocks):
            raise RuntimeError(f"out of KV blocks: need {needed}, have {len(self.free_blocks)}")
        if self.state_slots is not None and seq.state_slot < 0:
            seq.state_slot = self.state_slots.take()      # its state starts empty (the entry's start is 0)
        total = -(-(seq.num_computed_tokens + num_new_tokens) // self.block_size)
        for table in self.tables(seq):
            while len(table) < total:
                block_id = next(iter(self.free_blocks))   # least recently released first
                self._evict(block_id)
                self._take(block_id)
                table.append(block_id)

    def free(self, seq: Sequence) -> None:
        """Release seq's blocks. Blocks are released tail first, so the tail of a prefix is evicted before its head."""
        for table in self.tables(seq):
            for block_id in reversed(table):
                if self._real(block_id):
                    self._drop(block_id)
        seq.block_table = []
        seq.group_tables = []
        seq.block_hashes = []
        seq.num_computed_tokens = 0
        if self.state_slots is not None and seq.state_slot >= 0:   # the state goes with the blocks
            self.state_slots.release(seq.state_slot)
            seq.state_slot = -1
        seq.state_restore = -1
        if seq.state_save is not None:          # a save never committed
            self.checkpoints.release(seq.state_save[0])
            seq.state_save = None

    def truncate(self, seq: Sequence, num_tokens: int) -> None:
        """Keep only the K/V of seq's first `num_tokens` tokens (speculation rolled back): the
        blocks past them are released, and only the full blocks before them stay hashed."""
        keep = -(-num_tokens // self.block_size)
        for table in self.tables(seq):
            for block_id in reversed(table[keep:]):
                if self._real(block_id):
                    self._drop(block_id)
            del table[keep:]
        del seq.block_hashes[num_tokens // self.block_size:]
        seq.num_computed_tokens = min(seq.num_computed_tokens, num_tokens)

    def _real(self, block_id: int) -> bool:
        """Not the null block (which only a hybrid pool has)."""
        return block_id != NULL_BLOCK or self.layout is None

    def _drop(self, block_id: int) -> None:
        block = self.blocks[block_id]
        block.ref_count -= 1
        assert block.ref_count >= 0, f"block {block_id} released more often than taken"
        if block.ref_count == 0:
            self._release(block_id)

    def reset_prefix_cache(self) -> None:
        """Forget every cached block that no sequence holds. With nothing cached left, the free
        list's order carries no LRU meaning: it becomes ascending block ids, as in a new pool, so
        the sequences that follow get neighbouring blocks (a CPU's prefetchers follow a
        sequence's K/V from block to block; the order earlier runs left was scattered)."""
        for block_id in list(self.free_blocks):
            if self.blocks[block_id].hash is not None:
                self._evict(block_id)
        self.free_blocks = OrderedDict((i, None) for i in sorted(self.free_blocks))

    def _release(self, block_id: int) -> None:
        """Back on the free list: at the end (evicted last) when it holds a cached block, else at
        the front (reused first, see the module notes)."""
        self.free_blocks[block_id] = None
        if self.blocks[block_id].hash is None:
            self.free_blocks.move_to_end(block_id, last=False)

    def _take(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self.free_blocks[block_id]
        block.ref_count += 1

    def _evict(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.hash is not None:
            if self.hash_to_block.get(block.hash) == block_id:
                del self.hash_to_block[block.hash]
            block.hash = None
            block.token_ids = None
        if block.checkpoint >= 0:           # the state after a block goes with it
            self.checkpoints.release(block.checkpoint)
            block.checkpoint = -1

    def check_invariants(self, live: list[Sequence]) -> None:
        """free + used == total; no block owned twice by one sequence; ref counts match owners;
        the null block is never held nor free."""
        owners = [0] * len(self.blocks)
        for seq in live:
            held = [b for table in self.tables(seq) for b in table if self._real(b)]
            assert len(set(held)) == len(held), f"{seq} owns a block twice"
            for b in held:
                owners[b] += 1
        for block in self.blocks:
            if self.layout is not None and block.block_id == NULL_BLOCK:
                assert block.ref_count == 0 and NULL_BLOCK not in self.free_blocks
                continue
            assert block.ref_count >= 0
            assert block.ref_count == owners[block.block_id], (
                f"block {block.block_id}: ref_count {block.ref_count} != owners {owners[block.block_id]}")
            assert (block.ref_count == 0) == (block.block_id in self.free_blocks)
        assert self.num_free_blocks + sum(1 for b in self.blocks if b.ref_count > 0) == self.num_blocks
        if self.state_slots is not None:
            held = [seq.state_slot for seq in live if seq.state_slot >= 0]
            assert len(set(held)) == len(held), "a state slot held by two sequences"
            assert sorted(held + self.state_slots.free) == list(range(self.state_slots.num_slots))
        if self.checkpoints is not None:
            ckpt = self.checkpoints
            owned = {b.checkpoint: b.block_id for b in self.blocks if b.checkpoint >= 0}
            assert owned == {s: b for s, b in ckpt.owner.items() if b is not None}, "checkpoint owners disagree"
            assert all(self.blocks[b].hash is not None for b in owned.values()), "a checkpoint on an uncached block"
            assert sorted([*ckpt.owner, *ckpt.free]) == list(range(ckpt.first, ckpt.first + ckpt.count))
