"""What a platform must answer. Small and versioned: a third-party platform is one class.

A platform plugin is a subclass of `Platform`, registered under the entry-point group
`tokenmill.platforms`. The core never calls device APIs directly; it asks the platform.
Bump PLATFORM_API_VERSION on any incompatible change; plugins built for another version
are reported and skipped.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, ClassVar, Optional

import torch

if TYPE_CHECKING:  # the core's config, only for type hints: platforms import nothing upward
    from tokenmill.core.config import EngineConfig

PLATFORM_API_VERSION = 1
logger = logging.getLogger("tokenmill.platforms")


@dataclass(frozen=True)
class Availability:
    available: bool
    reason: str = ""      # why not, in words a user can act on

    @classmethod
    def yes(cls, detail: str = "") -> "Availability":
        return cls(True, detail)

    @classmethod
    def no(cls, reason: str) -> "Availability":
        return cls(False, reason)


class MemoryProfiler:
    """Decides how many KV blocks fit."""

    def num_kv_blocks(self, config: "EngineConfig", bytes_per_block: int,
                      profile_forward: Callable[[], None]) -> int:
        """`profile_forward` runs one dummy forward pass at max_num_batched_tokens."""
        raise NotImplementedError


class GraphCapture:
    """How a platform turns the eager forward into something cheaper to launch."""
    name: ClassVar[str] = "none"

    def wrap(self, forward: Callable[..., torch.Tensor], runner: Any) -> Callable[..., torch.Tensor]:
        """Return the callable the model runner invokes each step, same signature as `forward`:
        forward(input_ids, positions, attn_metadata) -> hidden states."""
        return forward


class Platform:
    api_version: ClassVar[int] = PLATFORM_API_VERSION
    name: ClassVar[str] = ""
    torch_device: ClassVar[str] = "cpu"
    priority: ClassVar[int] = 0          # auto-detection: highest available wins
    dispatch_key: ClassVar[str] = "cpu"  # which attention backends' `supported_devices` apply

    @classmethod
    def probe(cls) -> Availability:
        """Is this platform usable here? Never raises."""
        raise NotImplementedError

    def attention_backends(self) -> list[str]:
        """Backend names in preference order."""
        return ["reference"]

    def memory_profiler(self) -> MemoryProfiler:
        raise NotImplementedError

    def graph_capture(self, config: "EngineConfig") -> GraphCapture:
        return GraphCapture()

    def graph_capture_name(self, config: "EngineConfig") -> str:
        """The strategy `graph_capture(config)` will use ("none", "torch.compile", "cuda_graphs",
        "xla"): what the runner puts in AttentionConfig.graph_capture."""
        return self.graph_capture(config).name

    def graph_capture_strategies(self) -> list[str]:
        """Names of the strategies this platform offers, default first (for `tokenmill platforms`)."""
        return ["none"]

    def distributed_backend(self) -> str:
        return "gloo"

    def check_and_update_config(self, config: "EngineConfig") -> None:
        """Fill platform defaults (dtype, block size) and refuse what cannot run here (ValueError)."""

    def activation_dtype(self, dtype: torch.dtype) -> torch.dtype:
        """The dtype activations and the KV cache use when weights are `dtype`."""
        return dtype

    def prepare_model(self, model: Any, config: "EngineConfig") -> None:
        """After loading: re-lay out weights for this device's fastest kernels (optional)."""

    def quantization_methods(self) -> list[str]:
        """Run-time weight quantizations (`quantization=`) that prepare_model applies (optional)."""
        return []

    # Device services the core needs without naming a device API.
    def device(self) -> torch.device:
        return torch.device(self.torch_device)

    def synchronize(self) -> None:
        pass

    def set_seed(self, seed: int) -> None:
        torch.manual_seed(seed)

    def describe(self) -> dict[str, Any]:
        """What `tokenmill platforms` shows. Must not touch the device (it runs for unavailable ones)."""
        return {
            "name": self.name, "api_version": self.api_version, "torch_device": self.torch_device,
            "priority": self.priority, "dispatch_key": self.dispatch_key,
            "attention_backends": self.attention_backends(),
            "graph_capture": self.graph_capture_strategies(),
            "distributed_backend": self.distributed_backend(),
            "quantization": self.quantization_methods(),
            "description": (type(self).__doc__ or "").strip().splitlines()[0] if type(self).__doc__ else "",
        }


def resolve_dtype(name: str, default: torch.dtype) -> torch.dtype:
    table = {"float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
             "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
             "float16": torch.float16, "fp16": torch.float16, "half": torch.float16}
    if name == "auto":
        return default
    if name not in table:
        raise ValueError(f"dtype must be one of auto, {', '.join(sorted(table))}; got {name!r}")
    return table[name]


def blocks_from_budget(budget_bytes: int, bytes_per_block: int) -> int:
    """Whole blocks that fit in a byte budget; the shared arithmetic of every profiler."""
    if bytes_per_block <= 0:
        raise ValueError("bytes_per_block must be positive")
    return max(0, int(budget_bytes) // bytes_per_block)


def choose_graph_capture(config: "EngineConfig", platform_name: str, offered: list[str], default: str) -> str:
    """The strategy name to use: "none" under enforce_eager, else the requested one (ValueError if
    the platform does not offer it), else the platform's default."""
    if config.device.enforce_eager:
        return "none"
    choice = config.device.graph_capture or default
    if choice not in offered:
        raise ValueError(f"graph_capture {choice!r} is not offered by the {platform_name} platform "
                         f"(offers {offered})")
    return choice
