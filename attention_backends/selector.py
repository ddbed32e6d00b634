"""Choosing the attention backend: a pure function of the backends found, the platform's
preference order and the configuration. It knows nothing of how backends are discovered
(plugins/discovery.py passes them in), so it sits beside the backends."""
from __future__ import annotations

import dataclasses
import logging
from typing import Optional

from .interface import AttentionConfig

logger = logging.getLogger("tokenmill.attention_backends")


def select_backend(backends: dict[str, type], preferences: list[str], config: AttentionConfig,
                   requested: Optional[str] = None, unavailable: Optional[dict[str, str]] = None,
                   platform_name: str = "") -> type:
    """The backend class to use.

    `backends`: name -> AttentionBackend subclass; `preferences`: the platform's names in order;
    `unavailable`: name -> why, for backends registered but not loaded. The requested backend
    (ValueError with every reason if it cannot run), else the first preference that validates;
    when none can run under the configuration's graph capture, the first that runs eagerly.
    """
    unavailable = unavailable or {}
    if requested:
        if requested not in backends:
            if requested in unavailable:
                raise ValueError(f"attention backend {requested!r} is unavailable: {unavailable[requested]}")
            raise ValueError(f"unknown attention backend {requested!r}; known: {sorted(backends)}")
        reasons = backends[requested].validate(config)
        if reasons:
            hint = ""
            if any(r.startswith("graph capture") for r in reasons):
                hint = " (add --enforce-eager, or pick another --graph-capture, to run it without graph capture)"
            raise ValueError(f"attention backend {requested!r} cannot run here: " + "; ".join(reasons) + hint)
        return backends[requested]
    try:
        return _first_valid(backends, preferences, config, unavailable)
    except ValueError as first_error:
        if config.graph_capture == "none":
            raise
        # Run eagerly rather than not at all: the platform's graph capture checks the bound
        # backend's supported_graph_modes and steps aside.
        eager = dataclasses.replace(config, graph_capture="none")
        try:
            cls = _first_valid(backends, preferences, eager, unavailable)
        except ValueError:
            raise first_error from None
        logger.warning("no attention backend of %s supports graph capture %r; using %s without graph capture",
                       platform_name or "this platform", config.graph_capture, cls.name)
        return cls


def _first_valid(backends: dict[str, type], preferences: list[str], config: AttentionConfig,
                 unavailable: dict[str, str]) -> type:
    tried = []
    for name in preferences:
        cls = backends.get(name)
        if cls is None:
            tried.append(f"{name}: {unavailable.get(name, 'not installed')}")
            continue
        reasons = cls.validate(config)
        if not reasons:
            if tried:
                logger.info("attention backend %s chosen; passed over: %s", name, " | ".join(tried))
            return cls
        tried.append(f"{name}: {'; '.join(reasons)}")
    raise ValueError("no attention backend can run this model here: " + " | ".join(tried))
