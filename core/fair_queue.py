"""The scheduler's waiting queue as admission sees it: round-robin across request groups
(`Sequence.group_id`), so that one request with many sequences cannot take every free slot first."""
from __future__ import annotations

import heapq
from collections import Counter, deque

from .sequence import Sequence


class FairQueue:
    """The waiting sequences in admission order, round-robin across groups: the head of the group with the
    fewest running sequences first (the most urgent priority before that, under the priority policy),
    waiting-queue order among equals. A heap of groups, so a step admitting k of W waiting costs
    O(W + k log groups)."""

    def __init__(self, waiting: list[Sequence], running: list[Sequence], by_priority: bool) -> None:
        self.by_priority = by_priority
        self.held = Counter(s.group_id for s in running)
        self.queues: dict[str, deque[tuple[int, Sequence]]] = {}
        for pos, seq in enumerate(waiting):
            self.queues.setdefault(seq.group_id, deque()).append((pos, seq))
        self.heap = [self._key(g) for g in self.queues]
        heapq.heapify(self.heap)

    def _key(self, group: str) -> tuple:
        pos, seq = self.queues[group][0]
        return (seq.priority if self.by_priority else 0, self.held[group], pos, group)

    def __bool__(self) -> bool:
        return bool(self.heap)

    def head(self) -> Sequence:
        return self.queues[self.heap[0][-1]][0][1]

    def skip(self) -> None:
        """The head waits (for an adapter slot): it stays queued, the sequences behind it go on."""
        group = heapq.heappop(self.heap)[-1]
        self.queues[group].popleft()
        if self.queues[group]:
            heapq.heappush(self.heap, self._key(group))

    def pop(self) -> None:
        """The head was admitted: its group holds one more slot; its next sequence queues up."""
        group = heapq.heappop(self.heap)[-1]
        self.queues[group].popleft()
        self.held[group] += 1
        if self.queues[group]:
            heapq.heappush(self.heap, self._key(group))
