"""HF model directories: config.json, safetensors weights (single or sharded), tokenizer,
generation_config.json."""
from __future__ import annotations

import json
import os
from typing import Any, Iterator

import torch

# generation_config.json keys that are sampling defaults, as the engine's SamplingParams name them.
GENERATION_DEFAULT_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "max_new_tokens")


def load_hf_config(path: str, trust_remote_code: bool = False) -> Any:
    from transformers import AutoConfig
    return AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)


def load_hf_tokenizer(path: str, trust_remote_code: bool = False) -> Any:
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)


def read_generation_config(path: str) -> tuple[dict, list[int]]:
    """(sampling defaults, eos token ids) from generation_config.json; empty when absent."""
    file = os.path.join(path, "generation_config.json")
    if not os.path.isfile(file):
        return {}, []
    with open(file, encoding="utf-8") as fh:
        data = json.load(fh)
    defaults = {k: data[k] for k in GENERATION_DEFAULT_KEYS if data.get(k) is not None}
    # A config that does not ask for sampling means greedy, whatever temperature it carries.
    if data.get("do_sample") is False and "temperature" in defaults:
        defaults["temperature"] = 0.0
    eos = data.get("eos_token_id")
    eos_ids = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
    return defaults, eos_ids


def safetensors_files(path: str) -> list[str]:
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index, encoding="utf-8") as fh:
            weight_map = json.load(fh)["weight_map"]
        return [os.path.join(path, f) for f in sorted(set(weight_map.values()))]
    single = os.path.join(path, "model.safetensors")
    if os.path.isfile(single):
        return [single]
    others = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    if others:
        return [os.path.join(path, f) for f in others]
    raise FileNotFoundError(f"{path} has no safetensors weights (model.safetensors or "
                            "model.safetensors.index.json); .bin checkpoints are not supported")


def iterate_safetensors(path: str, lazy: bool = False) -> Iterator[tuple[str, Any]]:
    """(HF name, tensor) for every tensor of the checkpoint, one file open at a time. `lazy`
    (tensor parallelism): a LazySlice instead, so that a rank's loader reads only its rows/columns."""
    from safetensors import safe_open
    for file in safetensors_files(path):
        with safe_open(file, framework="pt", device="cpu") as fh:
            for name in fh.keys():
                yield name, (LazySlice(fh.get_slice(name)) if lazy else fh.get_tensor(name))


class LazySlice:
    """A checkpoint tensor not read yet: `narrow` reads only that part of the file (safetensors'
    get_slice); `materialize` reads it all. Weight loaders that narrow (`narrows_lazily`) get
    this; every other one gets the tensor."""

    def __init__(self, handle: Any) -> None:
        self._handle = handle
        self.shape = torch.Size(handle.get_shape())

    def dim(self) -> int:
        return len(self.shape)

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        index = [slice(None)] * self.dim()
        index[dim] = slice(start, start + length)
        return self._handle[tuple(index)]

    def materialize(self) -> torch.Tensor:
        return self._handle[:]

    def float(self) -> torch.Tensor:       # for readers of small tensors by value (kv_scales.py)
        return self.materialize().float()
