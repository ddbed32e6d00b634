"""What the rest of tokenmill calls to find its extensions: one facade over the registry.

Every extension point is an entry-point group loaded by plugins/registry.py (kinds in
plugins/kinds.py); platforms are probed and resolved by plugins/platforms.py; pluggy hooks the
engine calls with arguments are in plugins/hooks.py. Refused extensions are reported, never fatal.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Optional

from tokenmill.attention_backends.interface import AttentionConfig
from tokenmill.attention_backends.selector import select_backend

from . import hooks, platforms, registry
from .platforms import PlatformReport, discover_platforms, platform_class, resolve_platform
from .registry import ExtensionReport

__all__ = [
    "PlatformReport", "ExtensionReport", "resolve_platform", "discover_platforms", "platform_class",
    "attention_backend_classes", "attention_backend_errors", "select_attention_backend",
    "model_architectures", "model_architecture_reports", "quantization_methods", "tool_parsers",
    "reasoning_parsers", "grammar_backends", "extension_reports", "clear_caches",
]


def attention_backend_classes() -> dict[str, type]:
    """name -> AttentionBackend subclass, built-in and third-party alike."""
    return registry.load("attention_backend")


def attention_backend_errors() -> dict[str, str]:
    """name -> why, for attention-backend entry points that were refused."""
    return registry.refused("attention_backend")


def select_attention_backend(platform: Any, attn_config: AttentionConfig, requested: Optional[str] = None) -> type:
    """The backend class the engine binds: the requested one (ValueError with reasons if it cannot
    run), else the first of the platform's preferences that validates."""
    return select_backend(attention_backend_classes(), platform.attention_backends(), attn_config,
                          requested=requested, unavailable=attention_backend_errors(),
                          platform_name=getattr(platform, "name", ""))


def model_architectures() -> dict[str, type]:
    """HF `architectures` name -> model class: tokenmill's own and every plugin's."""
    return registry.load("model_architecture")


def model_architecture_reports() -> list[ExtensionReport]:
    """Every model-architecture entry point, loaded or refused and why (`tokenmill models`)."""
    return registry.reports("model_architecture")


def quantization_methods() -> dict[str, type]:
    """Quantization method name -> QuantizationMethod subclass."""
    return registry.load("quantization_method")


def tool_parsers() -> dict[str, type]:
    return registry.load("tool_parser")


def reasoning_parsers() -> dict[str, type]:
    return registry.load("reasoning_parser")


def grammar_backends() -> dict[str, type]:
    return registry.load("grammar_backend")


def extension_reports() -> list[ExtensionReport]:
    """Every extension of every kind -- hooks and what sits in the retired group included --
    loaded or refused and why: what `tokenmill plugins` lists."""
    from .kinds import KINDS

    out: list[ExtensionReport] = []
    for kind in KINDS:
        out.extend(registry.reports(kind))
    out.extend(hooks.hook_reports())
    out.extend(dataclasses.replace(r) for r in registry.retired_reports())
    return out


def clear_caches() -> None:
    """Forget everything discovered (tests; after installing a plugin into a running process)."""
    registry.clear_caches()
    platforms.clear_caches()
    hooks.clear_caches()
