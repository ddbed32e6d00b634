"""Finding platforms, attention backends, model architectures and quantization methods.

(Interim version: in-tree only. Replaced by stevedore/pluggy discovery; the public
functions below are the contract the core uses.)
"""
from __future__ import annotations

import importlib
from typing import Optional

BUILTIN_PLATFORMS = {
    "cpu": "tokenmill.platforms.cpu:CpuPlatform",
}
BUILTIN_ATTENTION_BACKENDS = {
    "reference": "tokenmill.attention_backends.reference:ReferenceAttention",
}


def _load(target: str):
    module, _, attr = target.partition(":")
    return getattr(importlib.import_module(module), attr)


def resolve_platform(device: str = "auto"):
    """The platform instance for `device` ("auto" = highest-priority available). ValueError if unusable."""
    if device == "auto":
        device = "cpu"
    if device not in BUILTIN_PLATFORMS:
        raise ValueError(f"unknown device {device!r}; known: {sorted(BUILTIN_PLATFORMS)}")
    cls = _load(BUILTIN_PLATFORMS[device])
    availability = cls.probe()
    if not availability.available:
        raise ValueError(f"device {device!r} is not available: {availability.reason}")
    return cls()


def attention_backend_classes() -> dict:
    return {name: _load(t) for name, t in BUILTIN_ATTENTION_BACKENDS.items()}


def select_attention_backend(platform, attn_config, requested: Optional[str] = None):
    """The backend class to use: the requested one (ValueError with reasons if it cannot run),
    else the first of the platform's preferences that validates."""
    backends = attention_backend_classes()
    if requested:
        if requested not in backends:
            raise ValueError(f"unknown attention backend {requested!r}; known: {sorted(backends)}")
        reasons = backends[requested].validate(attn_config)
        if reasons:
            raise ValueError(f"attention backend {requested!r} cannot run here: " + "; ".join(reasons))
        return backends[requested]
    tried = []
    for name in platform.attention_backends():
        cls = backends.get(name)
        if cls is None:
            tried.append(f"{name}: not installed")
            continue
        reasons = cls.validate(attn_config)
        if not reasons:
            return cls
        tried.append(f"{name}: {'; '.join(reasons)}")
    raise ValueError("no attention backend can run this model here: " + " | ".join(tried))


def extra_model_architectures() -> dict:
    """Architectures contributed by plugins: HF architecture name -> model class."""
    return {}
