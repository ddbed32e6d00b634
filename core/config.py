"""One configuration tree for the engine, built alike from the CLI and from `LLM(...)` kwargs."""
from __future__ import annotations

import dataclasses
import json
import numbers
import os
import re
import typing
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Optional

if TYPE_CHECKING:
    import torch

    from .lora.config import LoRAConfig


# dtype names users may pass -> the canonical name EngineConfig.validate() leaves in ModelConfig.dtype.
DTYPE_ALIASES = {"auto": "auto", "float32": "float32", "fp32": "float32", "float": "float32",
                 "bfloat16": "bfloat16", "bf16": "bfloat16",
                 "float16": "float16", "fp16": "float16", "half": "float16"}


_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B?)?\s*$", re.IGNORECASE)
_SIZE_UNITS = {"": 1, "K": 10**3, "M": 10**6, "G": 10**9, "T": 10**12,
               "KI": 2**10, "MI": 2**20, "GI": 2**30, "TI": 2**40}


def parse_size(value: Any, what: str) -> int:
    """Bytes from an int or a string such as "512MiB", "2GB", "1.5GiB" (ValueError naming `what`)."""
    if isinstance(value, bool):
        raise ValueError(f"{what} must be a number of bytes (or e.g. '512MiB'), got {value!r}")
    if isinstance(value, numbers.Integral):
        size = int(value)
    elif isinstance(value, str) and (m := _SIZE.match(value)) is not None:
        unit = (m.group(2) or "").upper().rstrip("B")
        size = int(float(m.group(1)) * _SIZE_UNITS[unit])
    else:
        raise ValueError(f"{what} must be a number of bytes (or e.g. '512MiB'), got {value!r}")
    if size <= 0:
        raise ValueError(f"{what} must be positive, got {value!r}")
    return size


def torch_dtype(name: str) -> "torch.dtype":
    """The torch dtype of a canonical (or aliased) dtype name other than "auto"."""
    import torch
    canonical = DTYPE_ALIASES.get(name)
    if canonical in (None, "auto"):
        raise ValueError(f"dtype must be one of {', '.join(sorted(DTYPE_ALIASES))}; got {name!r}")
    return getattr(torch, canonical)


GENERATION_CONFIG_MODES = ("auto", "vllm", "none")


@dataclass
class ModelConfig:
    model: Optional[str] = None          # path to a .gguf file or an HF directory; None = default model
    tokenizer: Optional[str] = None      # HF directory with a tokenizer; default: from the model
    dtype: str = "auto"                  # "auto" lets the platform choose (bf16 on CPUs with AVX512_BF16)
    max_model_len: Optional[int] = None  # default: the model's context length
    seed: int = 0
    served_model_name: Optional[str] = None
    quantization: Optional[str] = None   # None: as stored (GGUF blocks are dequantized at load)
    trust_remote_code: bool = False
    # "auto": the model's generation_config.json defaults; "vllm" / "none": none; or a folder holding one
    generation_config: str = "auto"
    structured_outputs_backend: str = "auto"   # grammar backend: auto (= xgrammar) | xgrammar | guidance | plugin
    reasoning_parser: Optional[str] = None     # structured outputs constrain the answer after the reasoning
    runner: str = "auto"                 # "generate" | "pooling" (embeddings) | "auto": from the checkpoint
    pooler_config: Any = None            # pooling overrides, e.g. {"pooling_type": "MEAN", "normalize": true}
    model_impl: str = "auto"             # "native" | "transformers" | "auto": native when registered (vLLM's)


@dataclass
class CacheConfig:
    block_size: int = 16
    enable_prefix_caching: bool = True
    kv_cache_memory: Optional[int] = None      # bytes for the KV pool (CPU); None = platform default
    gpu_memory_utilization: float = 0.9        # share of device memory (GPU-like platforms)
    kv_cache_dtype: str = "auto"
    num_gpu_blocks_override: Optional[int] = None  # force the block count (tests, debugging)
    # vLLM's flag: every layer keeps every block, even where sliding and full layers mix (core/kv_groups.py).
    disable_hybrid_kv_cache_manager: bool = False


@dataclass
class SchedulerConfig:
    max_num_seqs: int = 256
    max_num_batched_tokens: Optional[int] = None   # default decided in EngineConfig.finalize
    enable_chunked_prefill: bool = True
    long_prefill_token_threshold: int = 0          # 0 = no cap per prefill chunk beyond the budget
    policy: str = "fcfs"                           # "fcfs" | "priority"
    max_waiting_requests: Optional[int] = None     # the server refuses with 503 beyond this


EXPERT_PARALLEL_EXCHANGES = ("auto", "all_reduce", "all_to_all")


@dataclass
class ParallelConfig:
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    # "mp" (one process per rank, this machine), "ray" (one actor per rank, any cluster) or "uni"
    # (tp = pp = 1, in process); None: uni for one rank, else mp. See core/executor.py.
    distributed_executor_backend: Optional[str] = None
    # vLLM's flag: each mixture-of-experts layer's experts split over the tensor-parallel ranks (each
    # rank holds whole experts, E / tp of them) instead of every expert's intermediate size.
    enable_expert_parallel: bool = False
    # How tokens reach the rank owning their expert (core/layers/moe_parallel.py): "all_reduce" (every
    # rank runs its experts on the tokens it already holds, then one all-reduce), "all_to_all" (each rank
    # dispatches its 1/tp of the tokens to the owners and gathers the results), "auto": all_reduce.
    expert_parallel_exchange: str = "auto"

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size


@dataclass
class DeviceConfig:
    device: str = "auto"                  # platform name, or "auto" for the best available
    attention_backend: Optional[str] = None   # explicit backend name; None = platform preference
    enforce_eager: bool = False           # skip graph capture / compilation
    graph_capture: Optional[str] = None   # override the platform's default strategy by name
    num_threads: Optional[int] = None     # CPU intra-op threads; None = all cores


SPECULATIVE_METHODS = ("ngram", "draft_model")


@dataclass
class SpeculativeConfig:
    """vLLM's `--speculative-config` (core/spec_decode.py); `method` None: no speculation."""
    method: Optional[str] = None
    num_speculative_tokens: int = 3
    prompt_lookup_max: int = 4            # ngram: the longest suffix looked up
    prompt_lookup_min: int = 2            # ngram: the shortest
    model: Optional[str] = None           # draft_model: the drafter's checkpoint (HF dir or .gguf)
    # No drafts in a step with more decoding sequences than this (None: always draft). Batched
    # decode on a CPU is compute-bound, so verifying drafts costs more than it saves there.
    disable_by_batch_size: Optional[int] = 4

    @classmethod
    def parse(cls, value: Any) -> "SpeculativeConfig":
        """From a dict or its JSON text (the CLI's form); ValueError naming speculative_config."""
        if isinstance(value, cls):
            return value
        if value is None:
            return cls()
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError as e:
                raise ValueError(f"speculative_config is not valid JSON: {e}") from None
        if not isinstance(value, dict):
            raise ValueError(f"speculative_config must be an object, got {type(value).__name__}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"speculative_config has unknown keys {unknown}; known: {sorted(known)}")
        config = cls(**value)
        config.validate()
        return config

    def validate(self) -> None:
        if self.method is None:
            return
        if self.method not in SPECULATIVE_METHODS:
            raise ValueError(f"speculative_config method must be one of {', '.join(SPECULATIVE_METHODS)}; "
                             f"got {self.method!r}")
        if not isinstance(self.num_speculative_tokens, int) or not 1 <= self.num_speculative_tokens <= 16:
            raise ValueError("speculative_config num_speculative_tokens must be an integer in 1..16")
        if self.method == "draft_model" and (not isinstance(self.model, str) or not self.model):
            raise ValueError("speculative_config method 'draft_model' needs 'model': the draft checkpoint "
                             "(an HF directory or a .gguf file sharing the target's vocabulary)")
        if not (isinstance(self.prompt_lookup_min, int) and isinstance(self.prompt_lookup_max, int)
                and 1 <= self.prompt_lookup_min <= self.prompt_lookup_max):
            raise ValueError("speculative_config needs 1 <= prompt_lookup_min <= prompt_lookup_max")
        if self.disable_by_batch_size is not None and self.disable_by_batch_size < 1:
            raise ValueError("speculative_config disable_by_batch_size must be >= 1 (or null: always)")


@dataclass
class EngineConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    device: DeviceConfig = field(default_factory=DeviceConfig)
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)
    lora: "LoRAConfig" = field(default_factory=lambda: _lora_config())

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> "EngineConfig":
        """Route flat keyword arguments (as `LLM(...)` and the CLI take them) to their section."""
        config = cls()
        sections = [config.model, config.cache, config.scheduler, config.parallel, config.device, config.lora]
        # `device` is both a section and its one important field: accept the flat name.
        for key, value in kwargs.items():
            if key == "speculative_config":
                config.speculative = SpeculativeConfig.parse(value)
                continue
            for section in sections:
                if key in {f.name for f in dataclasses.fields(section)}:
                    setattr(section, key, _typed_value(type(section), key, value))
                    break
            else:
                raise ValueError(f"unknown engine argument {key!r}")
        config.validate()
        return config

    def validate(self) -> None:
        if self.model.dtype not in DTYPE_ALIASES:
            raise ValueError(f"dtype must be one of {', '.join(sorted(DTYPE_ALIASES))}; got {self.model.dtype!r}")
        self.model.dtype = DTYPE_ALIASES[self.model.dtype]
        if self.cache.block_size <= 0 or self.cache.block_size & (self.cache.block_size - 1):
            raise ValueError(f"block_size must be a positive power of two, got {self.cache.block_size}")
        if self.scheduler.max_num_seqs <= 0:
            raise ValueError(f"max_num_seqs must be positive, got {self.scheduler.max_num_seqs}")
        if self.scheduler.max_num_batched_tokens is not None and self.scheduler.max_num_batched_tokens <= 0:
            raise ValueError("max_num_batched_tokens must be positive")
        if self.scheduler.policy not in ("fcfs", "priority"):
            raise ValueError(f"policy must be 'fcfs' or 'priority', got {self.scheduler.policy!r}")
        if self.scheduler.long_prefill_token_threshold < 0:
            raise ValueError("long_prefill_token_threshold must be >= 0")
        if self.cache.kv_cache_memory is not None:
            self.cache.kv_cache_memory = parse_size(self.cache.kv_cache_memory, "kv_cache_memory")
        if self.cache.num_gpu_blocks_override is not None and self.cache.num_gpu_blocks_override < 1:
            raise ValueError(f"num_gpu_blocks_override must be >= 1, got {self.cache.num_gpu_blocks_override}")
        if self.device.num_threads is not None and self.device.num_threads < 1:
            raise ValueError(f"num_threads must be a positive integer, got {self.device.num_threads}")
        generation_config = self.model.generation_config
        if generation_config not in GENERATION_CONFIG_MODES and not os.path.isfile(
                os.path.join(generation_config, "generation_config.json")):
            raise ValueError(f"generation_config must be one of {', '.join(GENERATION_CONFIG_MODES)} or a folder "
                             f"holding a generation_config.json; got {generation_config!r}")
        if not 0.0 < self.cache.gpu_memory_utilization <= 1.0:
            raise ValueError("gpu_memory_utilization must be in (0, 1]")
        if self.model.max_model_len is not None and self.model.max_model_len <= 0:
            raise ValueError("max_model_len must be positive")
        if self.model.structured_outputs_backend != "auto":   # "auto" needs no plugin discovery here
            from .structured_outputs import resolve_backend_name
            resolve_backend_name(self.model.structured_outputs_backend)
        from .pooler_config import RUNNERS, parse_pooler_override
        if self.model.runner not in RUNNERS:
            raise ValueError(f"runner must be one of {', '.join(RUNNERS)}; got {self.model.runner!r}")
        parse_pooler_override(self.model.pooler_config)
        self.lora.validate()
        if self.lora.enable_lora and (self.parallel.tensor_parallel_size != 1
                                      or self.parallel.pipeline_parallel_size != 1):
            raise ValueError("enable_lora is not supported with tensor/pipeline parallelism yet")
        if self.lora.enable_lora:     # captured/fused decode steps bypass the layers' per-row adapter op
            self.device.enforce_eager = True
        for name in ("tensor_parallel_size", "pipeline_parallel_size"):
            value = getattr(self.parallel, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.parallel.expert_parallel_exchange not in EXPERT_PARALLEL_EXCHANGES:
            raise ValueError(f"expert_parallel_exchange must be one of {', '.join(EXPERT_PARALLEL_EXCHANGES)}; "
                             f"got {self.parallel.expert_parallel_exchange!r}")
        if self.parallel.distributed_executor_backend not in (None, "mp", "ray", "uni"):
            raise ValueError("distributed_executor_backend must be 'mp', 'ray' or 'uni', got "
                             f"{self.parallel.distributed_executor_backend!r}")

    def finalize(self, model_max_len: int, pooling: bool = False, causal: bool = True) -> None:
        """Fill defaults that depend on the loaded model (`pooling`: an embedding run; `causal`:
        False for an encoder, whose prompts must run whole)."""
        if pooling:
            self._finalize_pooling(causal)
        if self.model.max_model_len is None:
            self.model.max_model_len = model_max_len
        elif self.model.max_model_len > model_max_len:
            raise ValueError(
                f"max_model_len={self.model.max_model_len} exceeds the model's context length {model_max_len}")
        if self.scheduler.max_num_batched_tokens is None:
            self.scheduler.max_num_batched_tokens = (
                2048 if self.scheduler.enable_chunked_prefill else max(2048, self.model.max_model_len))
        if not causal:   # bidirectional attention needs the whole prompt in one step
            self.scheduler.max_num_batched_tokens = max(self.scheduler.max_num_batched_tokens, self.model.max_model_len)

    def _finalize_pooling(self, causal: bool) -> None:
        """Prefix caching off: a cached block skips computing its tokens' hidden states, which MEAN and
        CLS pooling need (and an encoder's K/V depend on later tokens, so they are no prefix's).
        Encoders cannot chunk a prompt: each token attends to the ones after it too."""
        if self.speculative.method is not None:
            raise ValueError("speculative_config does not apply to a pooling (embedding) model")
        self.cache.enable_prefix_caching = False
        if not causal:
            self.scheduler.enable_chunked_prefill = False
            self.scheduler.long_prefill_token_threshold = 0


# Fields whose value is parsed rather than taken as given (the CLI's flags accept the same forms).
_PARSERS: dict[str, Any] = {"kv_cache_memory": parse_size}
_PATH_FIELDS = ("model", "tokenizer")
_TYPE_WORDS = {bool: "a boolean", int: "an integer", float: "a number", str: "a string", list: "a list"}


def _typed_value(section: type, name: str, value: Any) -> Any:
    """`value` checked against the field's declared type, so that a wrong type is a ValueError naming
    the argument here rather than a TypeError from deep inside the engine."""
    if value is None:
        hint = typing.get_type_hints(section)[name]
        if type(None) in typing.get_args(hint) or hint is Any:
            return None
        raise ValueError(f"{name} must not be None")
    if name in _PARSERS:
        return _PARSERS[name](value, name)
    if name in _PATH_FIELDS and isinstance(value, os.PathLike):
        return os.fspath(value)
    hint = typing.get_type_hints(section)[name]
    accepted = [t for t in (typing.get_args(hint) or (hint,)) if t is not type(None)]
    for expected in accepted:
        if expected is Any:
            return value
        origin = typing.get_origin(expected) or expected
        if origin is bool and isinstance(value, bool):
            return value
        if origin is int and isinstance(value, numbers.Integral) and not isinstance(value, bool):
            return int(value)
        if origin is float and isinstance(value, numbers.Real) and not isinstance(value, bool):
            return float(value)
        if origin is list and isinstance(value, (list, tuple)):
            return list(value)
        if origin is str and isinstance(value, str):
            return value
    names = " or ".join(_TYPE_WORDS.get(typing.get_origin(t) or t, str(t)) for t in accepted)
    raise ValueError(f"{name} must be {names}, got {type(value).__name__} {value!r}")


def _lora_config() -> "LoRAConfig":
    from .lora.config import LoRAConfig
    return LoRAConfig()
