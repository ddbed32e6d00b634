"""What each model implementation supports, as `tokenmill models` lists it.

A model class declares `features`: {feature: (supported, how / why not)} (core/models/llama.py,
bert.py, transformers_impl.py); a plugin's class inherits its base's declaration or declares its
own. What a class does not declare is inferred where its interface tells (a fast path needs
`decoder_stack()`), else reported as not declared.
"""
from __future__ import annotations

import importlib.metadata
from typing import Any, Optional

FEATURES = ("tp", "pp", "lora", "quantization", "fast_path", "sliding_window", "pooling")


def model_features(cls: type) -> dict[str, dict[str, Any]]:
    """feature -> {"supported": True / False / None (not declared), "detail": how or why not}."""
    declared: dict[str, tuple[bool, str]] = getattr(cls, "features", None) or {}
    out: dict[str, dict[str, Any]] = {}
    for name in FEATURES:
        if name in declared:
            supported, detail = declared[name]
        elif name == "fast_path" and not hasattr(cls, "decoder_stack"):
            supported, detail = False, "no decoder_stack(): decode steps run eagerly"
        elif name == "pooling" and getattr(cls, "is_pooling_model", False):
            supported, detail = True, "a pooling model"
        else:
            supported, detail = None, f"not declared by {cls.__name__}.features"
        out[name] = {"supported": supported, "detail": detail}
    return out


def transformers_version() -> Optional[str]:
    """The installed transformers' version, without importing it (None when absent)."""
    try:
        return importlib.metadata.version("transformers")
    except importlib.metadata.PackageNotFoundError:
        return None


def architecture_rows() -> list[dict[str, Any]]:
    """Every entry point of `tokenmill.model_architectures`, loaded or refused, with its features."""
    from tokenmill.plugins import discovery

    registered = discovery.model_architectures()
    rows = []
    for report in discovery.model_architecture_reports():
        row = {"name": report.name, "implementation": "native", "entry_point": report.entry_point,
               "package": report.package, "package_version": report.package_version, "state": report.state,
               "reason": report.reason}
        cls = registered.get(report.name) if report.loaded else None
        row["features"] = model_features(cls) if cls is not None else {}
        rows.append(row)
    return rows


def transformers_row() -> dict[str, Any]:
    """The transformers implementation (model_impl="transformers"): any other causal LM."""
    from .transformers_impl import TransformersForCausalLM

    version = transformers_version()
    return {"name": "*", "implementation": "transformers", "available": version is not None,
            "transformers_version": version, "features": model_features(TransformersForCausalLM),
            "note": "any other causal LM runs through --model-impl transformers (the default, auto, picks it for "
                    "an unregistered architecture) when transformers knows its architecture and its attention "
                    "goes through transformers' AttentionInterface"}
