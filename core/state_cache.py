"""The recurrent state cache: fixed-size per-sequence state of linear-attention / state-space layers.

A hybrid model (Qwen3-Next, Qwen3.5: Gated DeltaNet layers between full-attention ones; later
Mamba-2, short-conv and KDA layers) keeps, per sequence and per recurrent layer, a state whose size
does not grow with the sequence: for Gated DeltaNet the causal conv's last kernel-1 inputs
[conv_dim, kernel - 1] and the delta-rule state [heads, k_dim, v_dim] in float32. Each layer states
its geometry as a `RecurrentStateSpec` (named tensors, shapes, dtypes), the way MLA states its latent
cache (core/kv_groups.py MLAKVSpec); a `StateLayout` is the model's specs together.

The states live in sequence slots: one tensor per layer and state name, [num_slots, *shape]. The
model runner takes the slots' bytes from the KV cache's memory budget (`StateLayout.num_slots`) and
states the arithmetic in the start-up log; the block manager hands a slot to a sequence with its
first blocks and takes it back with them (finish, abort, preemption: a preempted sequence is
recomputed from its first token, so its state is simply dropped). `RecurrentBatch` is what one step
tells the recurrent layers: each entry's slot and whether it starts from an empty state.

Prefix caching on these models (`StateCheckpoints`): a cached block's K/V alone cannot resume a
sequence, its recurrent layers need their state after that block. So the state is checkpointed at
block boundaries: extra slots in the same tensors (index num_slots.., sized from the same budget and
stated in the start-up log), each holding every recurrent layer's state after some cached block,
and belonging to that block (evicted with it; when the pool of checkpoints is full the least
recently used one goes, its block stays cached for its K/V). Only chunk ends are checkpointed, no
state is extracted from inside a chunk, so this needs nothing from any layer kind: the scheduler
ends a caching prefill's chunks on block boundaries and splits the last chunk at the prompt's last
full block (core/scheduler.py), and a chunk's end that is a block boundary of the prompt is saved.
A new sequence whose prompt hits cached blocks resumes from the longest hit whose last block has a
checkpoint (core/block_manager.py match_prefix): the checkpoint is copied into its slot before the
step and only the rest is computed. A save is copied at the start of the next step (`StateCache.batch`
runs the pending saves first, then the restores), so the forward path is untouched. n > 1 needs no
fork of its own: the engine runs n sequences of one prompt that share it through the prefix cache,
so each child after the first restores the parent prompt's checkpoint (copied into its own slot).
"""
from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Optional

import torch


@dataclass(frozen=True)
class StateTensorSpec:
    name: str                       # "conv", "ssm", ...: the layer reads `layer.state[name]`
    shape: tuple[int, ...]          # per sequence
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * torch.empty((), dtype=self.dtype).element_size()


@dataclass(frozen=True)
class RecurrentStateSpec:
    """One recurrent layer's per-sequence state: its kind ("gated_deltanet", later "mamba2",
    "short_conv", "kda") and its named tensors."""
    kind: str
    tensors: tuple[StateTensorSpec, ...]

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)

    @classmethod
    def conv_and_recurrent(cls, kind: str, conv_dim: int, kernel: int, conv_dtype: torch.dtype,
                           recurrent_shape: tuple[int, ...]) -> "RecurrentStateSpec":
        """The common case: a causal depthwise conv's last kernel-1 inputs and a float32 recurrent state."""
        return cls(kind, (StateTensorSpec("conv", (conv_dim, kernel - 1), conv_dtype),
                          StateTensorSpec("ssm", tuple(recurrent_shape), torch.float32)))


@dataclass(frozen=True)
class StateLayout:
    specs: tuple[RecurrentStateSpec, ...]     # one per recurrent layer, in layer order

    @property
    def bytes_per_seq(self) -> int:
        return sum(s.nbytes for s in self.specs)

    def num_slots(self, budget_bytes: int, max_num_seqs: int, share: float = 0.5) -> int:
        """Sequence slots: one per max_num_seqs, unless their states would take more than `share` of
        the budget (the KV blocks need the rest), then as many as fit in that share; 0: not one fits."""
        return max(0, min(max_num_seqs, int(budget_bytes * share) // max(1, self.bytes_per_seq)))

    def num_checkpoints(self, budget_bytes: int, max_num_seqs: int, share: float = 0.25, per_seq: int = 4) -> int:
        """Prefix-cache checkpoint slots: as many as fit in `share` of the budget, at most `per_seq` per
        sequence slot (each checkpoint is one cached prefix a later request can resume)."""
        return max(0, min(per_seq * max_num_seqs, int(budget_bytes * share) // max(1, self.bytes_per_seq)))

    def describe(self, num_slots: int, budget_bytes: int, max_num_seqs: int, num_checkpoints: int = 0) -> str:
        """The start-up log's line: bytes per sequence, slots, what they cost of the budget."""
        kinds = sorted({s.kind for s in self.specs})
        per_name: dict[str, int] = {}
        for spec in self.specs:
            for t in spec.tensors:
                per_name[t.name] = per_name.get(t.name, 0) + t.nbytes
        parts = " + ".join(f"{name} {n}" for name, n in per_name.items())
        total = num_slots * self.bytes_per_seq
        capped = (f"; max_num_seqs capped from {max_num_seqs} to {num_slots} (one slot per running sequence)"
                  if num_slots < max_num_seqs else "")
        checkpoints = (f"; {num_checkpoints} prefix-cache state checkpoints = "
                       f"{num_checkpoints * self.bytes_per_seq / 2**20:.2f} MiB" if num_checkpoints else "")
        return (f"recurrent state: {len(self.specs)} {'/'.join(kinds)} layers, {self.bytes_per_seq} bytes per sequence "
                f"({parts}); {num_slots} sequence slots = {total / 2**20:.2f} MiB of the "
                f"{budget_bytes / 2**20:.2f} MiB cache budget{checkpoints}{capped}")


class StateSlots:
    """The free sequence slots (the block manager's, in the engine process)."""

    def __init__(self, num_slots: int) -> None:
        if num_slots <= 0:
            raise ValueError(f"the recurrent state cache needs at least one sequence slot, got {num_slots}")
        self.num_slots = num_slots
        self.free: list[int] = list(range(num_slots - 1, -1, -1))     # pop() gives the lowest first

    @property
    def num_free(self) -> int:
        return len(self.free)

    def take(self) -> int:
        if not self.free:
            raise RuntimeError("no free recurrent-state slot")
        return self.free.pop()

    def release(self, slot: int) -> None:
        assert 0 <= slot < self.num_slots and slot not in self.free, f"state slot {slot} released twice"
        self.free.append(slot)


class StateCheckpoints:
    """The prefix cache's state checkpoints (the block manager's): slots `first`..`first + count - 1`
    of the state tensors, each free, reserved for a save in flight (owner None) or holding the state
    after a cached block (owner: that block's id), in least recently used order."""

    def __init__(self, first: int, count: int) -> None:
        self.first, self.count = first, count
        self.free: list[int] = list(range(first + count - 1, first - 1, -1))
        self.owner: OrderedDict[int, Optional[int]] = OrderedDict()

    def reserve(self) -> tuple[int, Optional[int]]:
        """A slot for a new save, and the block whose checkpoint was evicted for it (None: a free one).
        (-1, None): every slot holds a save still in flight."""
        if self.free:
            slot = self.free.pop()
            self.owner[slot] = None
            return slot, None
        slot = next((s for s, block in self.owner.items() if block is not None), -1)
        if slot < 0:
            return -1, None
        evicted = self.owner.pop(slot)
        self.owner[slot] = None
        return slot, evicted

    def commit(self, slot: int, block_id: int) -> None:
        self.owner[slot] = block_id
        self.owner.move_to_end(slot)

    def touch(self, slot: int) -> None:
        self.owner.move_to_end(slot)

    def release(self, slot: int) -> None:
        assert slot in self.owner, f"checkpoint slot {slot} released twice"
        del self.owner[slot]
        self.free.append(slot)


@dataclass
class RecurrentBatch:
    """One step as the recurrent layers read it: per entry (the attention metadata's order) its slot,
    its first position (0: the state starts empty) and the device tensor of the slots."""
    slots: list[int]
    starts: list[int]
    slots_t: Optional[torch.Tensor] = None
    decode_rows: int = 0            # the first entries are one-token decodes (continuing a state)
    extra: dict = field(default_factory=dict)     # a kernel's per-step scratch, built once per step


class StateCache:
    """The runner's side: the slot tensors of every recurrent layer and, per slot, how many tokens of
    its sequence the state holds, so a step that would continue a state from another position
    (a prefix-cache hit, a rolled-back draft, a bug) fails loudly instead of computing garbage."""

    def __init__(self, layers: list, layout: StateLayout, num_slots: int, zeros) -> None:
        """`layers`: modules with `state_spec`, each given `state` {name: [num_slots, *shape]}; `zeros`:
        the platform's allocator (shape, dtype) -> tensor."""
        self.layout = layout
        self.num_slots = num_slots
        for layer, spec in zip(layers, layout.specs):
            layer.state = {t.name: zeros((num_slots, *t.shape), t.dtype) for t in spec.tensors}
        self.held = [0] * num_slots
        self.tensors = [t for layer in layers for t in layer.state.values()]
        self.pending_saves: list[tuple[int, int]] = []      # (slot, checkpoint): copied at the next step

    def copy(self, src: int, dst: int) -> None:
        """Every recurrent layer's state of slot `src` into slot `dst` (a checkpoint saved or restored, a fork)."""
        for t in self.tensors:
            t[dst].copy_(t[src])
        self.held[dst] = self.held[src]

    def batch(self, slots: list[int], starts: list[int], num_tokens: list[int], num_decodes: int,
              device: torch.device, restores: Optional[list[int]] = None,
              saves: Optional[list[int]] = None) -> RecurrentBatch:
        """`restores`: per entry, the checkpoint its state starts from (-1: none), copied first;
        `saves`: per entry, the checkpoint its state after this step goes to (-1: none), copied at
        the start of the next step (before any restore, so a save is never read before it is made)."""
        for slot, checkpoint in self.pending_saves:
            self.copy(slot, checkpoint)
        self.pending_saves = []
        for slot, checkpoint in zip(slots, restores or ()):
            if checkpoint >= 0:
                self.copy(checkpoint, slot)
        for slot, checkpoint in zip(slots, saves or ()):
            if checkpoint >= 0:
                self.pending_saves.append((slot, checkpoint))
        for slot, start, n in zip(slots, starts, num_tokens):
            if not 0 <= slot < self.num_slots:
                raise RuntimeError(f"a sequence without a recurrent-state slot was scheduled (slot {slot})")
            if start != 0 and self.held[slot] != start:
                raise RuntimeError(f"recurrent state slot {slot} holds {self.held[slot]} tokens; the step "
                                   f"continues from position {start}")
            self.held[slot] = start + n
        return RecurrentBatch(slots, starts, torch.tensor(slots, dtype=torch.long, device=device), num_decodes)


def state_layout_of(model: torch.nn.Module) -> Optional[tuple[list, StateLayout]]:
    """The model's recurrent layers (modules with a `state_spec`) and their layout; None without any."""
    layers = list(getattr(model, "recurrent_layers", []) or [])
    if not layers:
        return None
    return layers, StateLayout(tuple(layer.state_spec for layer in layers))
