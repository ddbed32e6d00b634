"""Paged KV-cache bookkeeping: a pool of fixed-size blocks, per-sequence block tables,
reference counts, and prefix caching by a chained hash of each full block.

Freed blocks keep their hash and stay findable until the pool needs them back; the free list
is ordered by release time, so reuse evicts the least recently used cached block first. A block
released with nothing cached in it (a partial last block, any block once the cache is reset or
off) goes to the front instead: it is taken before blocks never used, whose memory the device
has not touched yet (a CPU pool's pages fault in on first write: ~2 ms per MB measured on a
2-core VM, 0.7 s a W1 run when every run took fresh blocks), and before cached ones.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Optional

from .sequence import Sequence


def chain_hash(parent: Optional[int], token_ids: tuple[int, ...]) -> int:
    return hash((parent, token_ids))


class Block:
    __slots__ = ("block_id", "ref_count", "hash", "token_ids")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_count = 0
        self.hash: Optional[int] = None
        self.token_ids: Optional[tuple[int, ...]] = None  # kept to rule out hash collisions


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        if num_blocks <= 0:
            raise ValueError(f"the KV pool needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_blocks: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.hash_to_block: dict[int, int] = {}
        # Counters, in tokens, mirroring vLLM's prefix_cache_queries/hits.
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0

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

    def blocks_needed(self, seq: Sequence, num_new_tokens: int) -> int:
        total = seq.num_computed_tokens + num_new_tokens
        return max(0, -(-total // self.block_size) - len(seq.block_table))

    def can_allocate(self, seq: Sequence, num_new_tokens: int) -> bool:
        return self.blocks_needed(seq, num_new_tokens) <= len(self.free_blocks)

    # ------------------------------------------------------------------ prefix cache
    def match_prefix(self, seq: Sequence) -> None:
        """At a sequence's first scheduling: adopt the cached blocks of its longest cached prefix.

        Leaves at least one token uncomputed, so the step that finishes the prompt has logits.
        """
        assert not seq.block_table and seq.num_computed_tokens == 0
        if not self.enable_prefix_caching:
            return
        max_blocks = (seq.num_tokens - 1) // self.block_size
        self.prefix_cache_queries += seq.num_tokens
        hashes = self.full_block_hashes(seq)
        for i in range(max_blocks):
            h = hashes[i]
            block_id = self.hash_to_block.get(h)
            tokens = tuple(seq.token_ids[i * self.block_size:(i + 1) * self.block_size])
            if block_id is None or self.blocks[block_id].token_ids != tokens:
                break
            self._take(block_id)
            seq.block_table.append(block_id)
            seq.block_hashes.append(h)
        cached = len(seq.block_table) * self.block_size
        seq.num_computed_tokens = cached
        seq.num_cached_tokens = cached
        self.prefix_cache_hits += cached

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
        """Register every newly filled block of `seq` (after its tokens were computed)."""
        if not self.enable_prefix_caching:
            return
        num_full = seq.num_computed_tokens // self.block_size
        for i in range(len(seq.block_hashes), num_full):
            parent = seq.block_hashes[-1] if seq.block_hashes else seq.cache_salt   # an adapter's KV is its own
            tokens = tuple(seq.token_ids[i * self.block_size:(i + 1) * self.block_size])
            h = chain_hash(parent, tokens)
            seq.block_hashes.append(h)
            block = self.blocks[seq.block_table[i]]
            if block.hash is None and h not in self.hash_to_block:
                block.hash = h
                block.token_ids = tokens
                self.hash_to_block[h] = block.block_id

    # ------------------------------------------------------------------ allocation
    def allocate(self, seq: Sequence, num_new_tokens: int) -> None:
        """Make room in seq's block table for its next `num_new_tokens` tokens."""
        needed = self.blocks_needed(seq, num_new_tokens)
        if needed > len(self.free_blocks):
            raise RuntimeError(f"out of KV blocks: need {needed}, have {len(self.free_blocks)}")
        for _ in range(needed):
            block_id = next(iter(self.free_blocks))   # least recently released first
            self._evict(block_id)
            self._take(block_id)
            seq.block_table.append(block_id)

    def free(self, seq: Sequence) -> None:
        """Release seq's blocks. Blocks are released tail first, so the tail of a prefix is evicted before its head."""
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            assert block.ref_count >= 0, f"block {block_id} released more often than taken"
            if block.ref_count == 0:
                self._release(block_id)
        seq.block_table = []
        seq.block_hashes = []
        seq.num_computed_tokens = 0

    def truncate(self, seq: Sequence, num_tokens: int) -> None:
        """Keep only the K/V of seq's first `num_tokens` tokens (speculation rolled back): the
        blocks past them are released, and only the full blocks before them stay hashed."""
        keep = -(-num_tokens // self.block_size)
        for block_id in reversed(seq.block_table[keep:]):
            block = self.blocks[block_id]
            block.ref_count -= 1
            assert block.ref_count >= 0, f"block {block_id} released more often than taken"
            if block.ref_count == 0:
                self._release(block_id)
        del seq.block_table[keep:]
        del seq.block_hashes[num_tokens // self.block_size:]
        seq.num_computed_tokens = min(seq.num_computed_tokens, num_tokens)

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

    def check_invariants(self, live: list[Sequence]) -> None:
        """free + used == total; no block owned twice by one sequence; ref counts match owners."""
        owners = [0] * self.num_blocks
        for seq in live:
            assert len(set(seq.block_table)) == len(seq.block_table), f"{seq} owns a block twice"
            for b in seq.block_table:
                owners[b] += 1
        for block in self.blocks:
            assert block.ref_count >= 0
            assert block.ref_count == owners[block.block_id], (
                f"block {block.block_id}: ref_count {block.ref_count} != owners {owners[block.block_id]}")
            assert (block.ref_count == 0) == (block.block_id in self.free_blocks)
        assert self.num_free_blocks + sum(1 for b in self.blocks if b.ref_count > 0) == self.num_blocks
