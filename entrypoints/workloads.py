"""The benchmark workloads W1-W4 (defined in docs/benchmarks.md): token-id prompts, greedy, EOS ignored."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Workload:
    name: str
    description: str
    prompts: list[list[int]]
    output_len: int

    @property
    def num_prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)

    @property
    def num_output_tokens(self) -> int:
        return self.output_len * len(self.prompts)


def _ids(seed: int, shape) -> np.ndarray:
    return np.random.default_rng(seed).integers(1000, 40000, size=shape)


def build_workload(name: str) -> Workload:
    name = name.upper()
    if name == "W1":
        return Workload("W1", "offline batch throughput", _ids(0, (64, 128)).tolist(), 128)
    if name == "W2":
        return Workload("W2", "single-stream decode latency", _ids(1, (1, 128)).tolist(), 256)
    if name == "W3":
        prefix = _ids(2, 512).tolist()
        return Workload("W3", "shared prefix (prefix caching)",
                        [prefix + s for s in _ids(3, (64, 32)).tolist()], 32)
    if name == "W4":
        return Workload("W4", "long prompts (prefill)", _ids(4, (8, 2048)).tolist(), 32)
    raise ValueError(f"workload must be one of W1, W2, W3, W4; got {name!r}")


WORKLOAD_NAMES = ("W1", "W2", "W3", "W4")
