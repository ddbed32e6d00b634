"""The batched LoRA op: every row of a flat batch gets its own adapter's delta, base rows none.

One `LoRAMapping` per step (built by the model runner through the manager) says which rows run on
which slot, grouped by slot the way punica/S-LoRA group them (SGMV): the layers then do one op
call each. This is the torch implementation; a platform may offer its own with the same signature
(`Platform.lora_kernels()`, e.g. platforms/triton_lora.py).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch


@dataclass
class LoRAMapping:
    """Rows grouped by slot, slots in increasing order. `token_indices` lists the adapted rows, group g's at
    [group_starts[g], group_starts[g] + group_lens[g]); `slots[g]` is its slot. `padded_rows`
    [G, max_len] are the same rows padded (with row 0) for a batched bmm, `padding` marks the pads.
    `contiguous`: (slot, lo, hi) when one slot's rows are the whole adapted set and consecutive (one
    adapter in the batch): two plain matmuls then."""
    num_rows: int
    slot_list: list[int]
    slots: torch.Tensor
    token_indices: torch.Tensor
    group_starts: torch.Tensor
    group_lens: torch.Tensor
    max_len: int
    padded_rows: torch.Tensor
    padding: Optional[torch.Tensor]    # [G, max_len, 1] True at the padding of shorter groups; None: none
    contiguous: Optional[tuple[int, int, int]] = None


def build_mapping(row_slots: list[tuple[int, int]], device: torch.device) -> Optional[LoRAMapping]:
    """From (slot, number of rows) per scheduled sequence, in batch order (slot -1: the base model).
    None when no row is adapted: the layers then skip LoRA entirely."""
    def t(values: list, dtype: torch.dtype) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype, device=device)

    groups: dict[int, list[int]] = {}
    row = 0
    for slot, n in row_slots:
        if slot >= 0:
            groups.setdefault(slot, []).extend(range(row, row + n))
        row += n
    num_rows = row
    if not groups:
        return None
    slot_list = sorted(groups)
    lens = [len(groups[s]) for s in slot_list]
    max_len = max(lens)
    rows = [r for s in slot_list for r in groups[s]]
    starts = [0]
    for n in lens[:-1]:
        starts.append(starts[-1] + n)
    padded = [groups[s] + [0] * (max_len - len(groups[s])) for s in slot_list]
    padding = None
    if min(lens) != max_len:
        padding = t([[[i >= n] for i in range(max_len)] for n in lens], torch.bool)
    contiguous = None
    if len(slot_list) == 1 and rows[-1] - rows[0] + 1 == len(rows):
        contiguous = (slot_list[0], rows[0], rows[-1] + 1)
    return LoRAMapping(num_rows=num_rows, slot_list=slot_list, slots=t(slot_list, torch.long),
                       token_indices=t(rows, torch.long), group_starts=t(starts, torch.int32),
                       group_lens=t(lens, torch.int32), max_len=max_len, padded_rows=t(padded, torch.long),
                       padding=padding, contiguous=contiguous)


def add_lora(y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
             mapping: LoRAMapping, output_sizes: Optional[Sequence[int]] = None) -> None:
    """y[row] += x[row] A[slot]^T B[slot]^T for every adapted row, in place.

    lora_a = A^T [slots, in, R], lora_b = B^T [slots, R, out] (scale folded in; a fused layer's shards
    stacked along R, B block-diagonal with diagonal blocks `output_sizes` wide: an op may skip the
    zero blocks; this one multiplies B whole). Work is per group, never per row: one matmul pair for a single
    contiguous group, else one gather, two bmm over the groups' slots and one scatter-add."""
    if mapping.contiguous is not None:
        slot, lo, hi = mapping.contiguous
        y[lo:hi].addmm_(x[lo:hi] @ lora_a[slot], lora_b[slot])
        return
    num_groups, width = mapping.padded_rows.shape
    if num_groups != lora_a.shape[0]:      # groups are sorted by slot: all slots in use need no gather
        lora_a, lora_b = lora_a.index_select(0, mapping.slots), lora_b.index_select(0, mapping.slots)
    rows = mapping.padded_rows.view(-1)
    shrunk = torch.bmm(x.index_select(0, rows).view(num_groups, width, x.shape[-1]), lora_a)
    if mapping.padding is not None:
        shrunk.masked_fill_(mapping.padding, 0)     # padding rows then add exactly zero (to row 0)
    y.index_add_(0, rows, torch.bmm(shrunk, lora_b).view(num_groups * width, -1))
