"""The benchmark workloads (defined in docs/benchmarks.md): token-id prompts, greedy, EOS ignored.

W1-W4 are random token ids (../shared/WORKLOADS.md: the same for every engine). W5 is text, made
with the served model's tokenizer: 16 prompts of ~512 tokens holding a piece of code the answer is
asked to repeat with one line changed -- what n-gram speculative decoding is for -- run one request
at a time (single stream)."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Workload:
    name: str
    description: str
    prompts: list[list[int]]
    output_len: int
    sequential: bool = False     # one request after another (single-stream), not all at once

    @property
    def num_prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)

    @property
    def num_output_tokens(self) -> int:
        return self.output_len * len(self.prompts)


def _ids(seed: int, shape) -> np.ndarray:
    return np.random.default_rng(seed).integers(1000, 40000, size=shape)


def _w5_code(i: int) -> str:
    """A ~450-token Python module, different for each i."""
    rng = np.random.default_rng(500 + i)
    names = ["total", "count", "limit", "offset", "scale", "price", "weight", "score", "index", "value"]
    lines = [f"# inventory module {i}", "import math", ""]
    for f in range(7):
        a, b = rng.choice(names, 2, replace=False)
        k = int(rng.integers(2, 99))
        lines += [f"def update_{a}_{f}({a}, {b}):",
                  f"    \"\"\"Return the new {a} after applying {b}.\"\"\"",
                  f"    if {b} < {k}:",
                  f"        return {a} + {b} * {k}",
                  f"    return math.floor({a} / ({b} + {k}))", ""]
    return "\n".join(lines)


def _w5(tokenizer) -> Workload:
    if tokenizer is None:
        raise ValueError("workload W5 is text: it needs the model's tokenizer")
    prompts = []
    for i in range(16):
        text = (f"{_w5_code(i)}\n\nRepeat the code above exactly, with one change: in update_*_3 "
                f"use {i + 2} instead of the constant. Write only the code.\n\n")
        ids = tokenizer.encode(text)
        prompts.append(list(ids[-512:]))
    return Workload("W5", "input-grounded single stream (n-gram speculation)", prompts, 256, sequential=True)


def build_workload(name: str, tokenizer=None) -> Workload:
    name = name.upper()
    if name == "W5":
        return _w5(tokenizer)
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
    raise ValueError(f"workload must be one of W1, W2, W3, W4, W5; got {name!r}")


WORKLOAD_NAMES = ("W1", "W2", "W3", "W4")


def workload_names(spec: str, known: tuple[str, ...]) -> list[str]:
    """--workload: "all" (W1-W4), one name, or several separated by commas ("W1,W2,W4"), in order."""
    names: list[str] = []
    for part in spec.split(","):
        part = part.strip().upper()
        for name in (known[:4] if part == "ALL" else (part,)):
            if name not in known:
                raise SystemExit(f"--workload must be all, {', '.join(known)} or a comma-separated list of "
                                 f"them; got {spec!r}")
            if name not in names:
                names.append(name)
    return names
