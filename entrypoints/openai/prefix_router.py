"""Which data-parallel replica gets a request: the one holding the longest cached prefix of its prompt,
then the least loaded — the cache-aware routing production routers do (SGLang's router, llm-d).

The router cannot ask an engine what its prefix cache holds, so each replica keeps a *shadow*: the
chained block hashes (core/block_manager.chain_hash, the engine's own) of the prompts it was sent,
in a bounded LRU about the size of the replica's KV pool. A replica's real cache may have evicted a
block the shadow still lists; the cost of that guess is one recomputed prefix, never a wrong answer.

Prefix affinity gives way to load when it would pile work on one replica: a replica whose load is
more than BALANCE_ABS_THRESHOLD requests above the least loaded one is not chosen for its prefix.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Optional, Sequence

from ...core.block_manager import chain_hash

BALANCE_ABS_THRESHOLD = 16      # requests; SGLang's cache-aware router uses an absolute threshold too


def prompt_block_hashes(token_ids: Sequence[int], block_size: int, salt: Optional[int] = None) -> list[int]:
    """The chained hashes of a prompt's full blocks, as the engine's block manager computes them. `salt` starts
    the chain (the engine starts a LoRA adapter's from the adapter: an adapter never shares the base's KV)."""
    hashes: list[int] = []
    parent: Optional[int] = salt
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = chain_hash(parent, tuple(token_ids[start:start + block_size]))
        hashes.append(parent)
    return hashes


class PrefixShadow:
    """The block hashes one replica was sent, least recently used first, at most `capacity` of them."""

    def __init__(self, capacity: int) -> None:
        if capacity <= 0:
            raise ValueError(f"capacity must be positive, got {capacity}")
        self.capacity = capacity
        self._hashes: OrderedDict[int, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._hashes)

    def match(self, hashes: Sequence[int]) -> int:
        """How many leading blocks of `hashes` this replica has (chained: a miss ends the prefix)."""
        n = 0
        for h in hashes:
            if h not in self._hashes:
                break
            n += 1
        return n

    def insert(self, hashes: Sequence[int]) -> None:
        for h in hashes:
            self._hashes[h] = None
            self._hashes.move_to_end(h)
        while len(self._hashes) > self.capacity:
            self._hashes.popitem(last=False)

    def clear(self) -> None:
        self._hashes.clear()


@dataclass(frozen=True)
class ReplicaLoad:
    """What the router knows of one replica's load: requests in flight there, and its KV-pool use."""
    in_flight: int
    kv_usage: float = 0.0
    alive: bool = True
    cached_blocks: int = 0      # the size of its shadow: a new prefix goes where it evicts the least


@dataclass(frozen=True)
class Decision:
    replica: int
    reason: str             # "prefix": chosen for its cached prefix; "load": the least loaded
    matched_blocks: int


def choose_replica(matches: Sequence[int], loads: Sequence[ReplicaLoad],
                   balance_threshold: int = BALANCE_ABS_THRESHOLD) -> Decision:
    """The replica for a request whose prompt prefix replica i holds `matches[i]` blocks of. Dead replicas
    are never chosen (ValueError when none is alive). Ties, and prompts no replica has seen, go to the
    least loaded: fewest requests in flight, then lowest KV use, then fewest cached blocks, then the lowest index."""
    alive = [i for i, load in enumerate(loads) if load.alive]
    if not alive:
        raise ValueError("no replica is alive")

    def load_key(i: int) -> tuple[int, float, int, int]:
        return loads[i].in_flight, loads[i].kv_usage, loads[i].cached_blocks, i

    least = min(alive, key=load_key)
    best = max(matches[i] for i in alive)
    if best > 0:
        holders = [i for i in alive if matches[i] == best]
        pick = min(holders, key=load_key)
        if loads[pick].in_flight - loads[least].in_flight <= balance_threshold:
            return Decision(pick, "prefix", best)
    return Decision(least, "load", matches[least])
